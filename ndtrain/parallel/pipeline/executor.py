"""The one executor that runs any pipeline schedule: `PipelineSchedule`, the `schedule` of a
pipelined `Parallelized` (same `run` and `evaluate` as `parallel.schedule.SingleStage`).

A step walks this rank's action list (schedules.py) in order:
- a group of messages is posted at once; a received buffer is waited for only by the action
  that consumes it, then dropped;
- F runs a chunk on a micro-batch: token ids on the first chunk, a received activation
  otherwise; the last chunk turns its logits into the loss, divided by the step's global
  target count (the schedule owns the loss, so gradients equal one device's); loss terms
  the model reports during a chunk's forward (MoE load balancing) join that chunk's
  backward (`schedule.carry_loss`), or the loss on the last chunk;
- B runs the backward of one micro-batch of one chunk, from the loss or from the received
  output gradient; under the zero-bubble schedule only the input gradient (weightgrad.py)
  and W the weight gradients later;
- gradient synchronisation over dp × cp (DP buckets or ZeRO) is switched on only for the
  last backward action that touches each chunk, so its buckets are reduced once per step,
  overlapped with the rest of the schedule, never per micro-batch;
- at the end: sends completed, the gradient sync finished, the tied embedding summed.

Every action is timed into `timeline` (timeline.py), and the number of micro-batches whose
activations are held (forward done, last backward not) is tracked: `peak_held`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ndtrain.comm import ops
from ndtrain.mesh import ParallelMesh
from ndtrain.parallel.pipeline.partition import owner
from ndtrain.parallel.pipeline.p2p import StageLinks
from ndtrain.parallel.pipeline.schedules import (B, F, MESSAGES, RECV_B, RECV_F, SEND_B, SEND_F, W, Action,
                                                 build_schedule, peer)
from ndtrain.parallel.pipeline.stage import TiedEmbedding
from ndtrain.parallel.pipeline.timeline import Timeline
from ndtrain.parallel.pipeline.verify import groups, verify
from ndtrain.parallel.pipeline.weightgrad import SplitBackward
from ndtrain.data.batch import MicroBatch
from ndtrain.model.moe import RoutingLog
from ndtrain.parallel.schedule import GradSync, carry_loss, with_model_loss


class _Step:
    """What one step keeps between actions, keyed by (chunk, micro)."""

    def __init__(self):
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.received: dict[tuple[str, int, int], tuple[object, torch.Tensor]] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.split: dict[tuple[int, int], SplitBackward] = {}
        self.held = 0
        self.peak = 0


class PipelineSchedule:
    def __init__(self, chunks: dict[int, nn.Module], mesh: ParallelMesh, name: str, virtual: int,
                 loss_fn: Callable, tied: TiedEmbedding | None = None):
        self.chunks, self.mesh, self.name, self.loss_fn, self.tied = chunks, mesh, name, loss_fn, tied
        self.pp, self.v = mesh.shape.pp, virtual
        self.rank = mesh.coord("pp")
        self.n_chunks = self.pp * self.v
        self.links = StageLinks(mesh.group("pp"), mesh.device)
        self.timeline = Timeline(mesh.device)  # `.sync = True` to time CUDA kernels, not launches
        self.peak_held = 0
        self._plans: dict[tuple[int, bool], list[list[Action]]] = {}
        # The first chunk's embedding output: where the zero-bubble split of that chunk stops.
        self._embedded: torch.Tensor | None = None
        if 0 in chunks and getattr(chunks[0], "tok_embeddings", None) is not None:
            chunks[0].tok_embeddings.register_forward_hook(self._keep_embedded)
        self._probed: tuple | None = None
        self._positions: torch.Tensor | None = None  # 0..s-1, for micro-batches that give none
        # NCCL: the first operation on a group must involve all of its ranks.
        ops.all_reduce_scalars([0.0], mesh.group("pp"))

    # -- plans ---------------------------------------------------------------------
    def plan(self, m: int, train: bool) -> list[list[Action]]:
        """This rank's actions in groups (a message group, or one compute action), verified."""
        key = (m, train)
        if key not in self._plans:
            schedule = build_schedule(self.name, self.pp, self.v, m, train=train)
            verify(schedule, self.pp, self.v, m, train=train)
            self._plans[key] = groups(schedule[self.rank])
        return self._plans[key]

    # -- shapes, once per run ----------------------------------------------------------
    @torch.no_grad()
    def agree_shapes(self, mb: MicroBatch) -> None:
        """Run one micro-batch through the chunks in pipeline order, with dropout off, each
        boundary's sender announcing the shape of what it sends (p2p.StageLinks)."""
        key = (tuple(mb.tokens.shape), mb.tokens.dtype)
        if self._probed == key:
            return
        modes = {m: m.training for chunk in self.chunks.values() for m in chunk.modules()}
        for chunk in self.chunks.values():
            chunk.eval()
        for c in range(self.n_chunks - 1):
            if owner(c, self.pp) == self.rank:
                x = mb.tokens if c == 0 else self.links.recv_with_header(c - 1, owner(c - 1, self.pp))
                self.links.send_with_header(self._chunk(c, x, mb), c, owner(c + 1, self.pp))
        last = self.n_chunks - 1
        if owner(last, self.pp) == self.rank:
            self.links.recv_with_header(last - 1, owner(last - 1, self.pp))
        for m, training in modes.items():
            m.training = training
        self._probed = key

    # -- training ------------------------------------------------------------------------
    def run(self, micro_batches: list[MicroBatch], n_targets: float, grad_sync: GradSync,
            routing: RoutingLog | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch through the pipeline; returns this
        rank's share of the token loss (the sum on the last stage, 0 elsewhere).
        `routing`: the step's log, handed to every chunk's forward."""
        self._check(micro_batches)
        self.agree_shapes(micro_batches[0])
        plan = self.plan(len(micro_batches), train=True)
        last_backward = {}
        for k, group in enumerate(plan):
            if group[0].kind in (B, W):
                last_backward[group[0].chunk] = k
        split = any(g[0].kind == W for g in plan)
        step, total = _Step(), torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        self.timeline.begin()
        for k, group in enumerate(plan):
            a = group[0]
            if a.kind in MESSAGES:
                start = self.timeline.now()
                self._post(group, step, train=True)
                self.timeline.add("post", a.chunk, a.micro, start)
                continue
            if a.kind == F:
                mb = micro_batches[a.micro]
                x = mb.tokens if a.chunk == 0 else self._take(RECV_F, a, step).requires_grad_()
                start = self.timeline.now()
                loss = self._forward(a, x, mb, n_targets, step, routing)
                if loss is not None:
                    total += loss
            elif a.kind == B:
                grad = None if a.chunk == self.n_chunks - 1 else self._take(RECV_B, a, step)
                start = self.timeline.now()
                grad_sync.set_sync(last_backward[a.chunk] == k)
                self._backward(a, grad, step, split)
            else:
                start = self.timeline.now()
                grad_sync.set_sync(last_backward[a.chunk] == k)
                step.split.pop((a.chunk, a.micro)).weights()
                self._release(a, step)
            self.timeline.add(a.kind, a.chunk, a.micro, start)
        self.links.wait_sends()
        # every activation released, every received buffer consumed, every gradient sent
        assert not (step.inputs or step.received or step.input_grads or step.split), "pipeline step left state behind"
        grad_sync.finish()
        if self.tied is not None:
            self.tied.sync()
        self.peak_held = step.peak
        return total

    def _chunk(self, c: int, x: torch.Tensor, mb: MicroBatch, routing: RoutingLog | None = None) -> torch.Tensor:
        """Chunk c on x. Positions come from the micro-batch, not from x: a received
        activation may hold only part of the sequence (sequence parallelism)."""
        positions = mb.positions
        if positions is None:
            s = mb.tokens.shape[1]
            if self._positions is None or self._positions.numel() != s:
                self._positions = torch.arange(s, device=mb.tokens.device)
            positions = self._positions
        return self.chunks[c](x, positions=positions, doc_ids=mb.doc_ids, routing=routing)

    def _forward(self, a: Action, x: torch.Tensor, mb: MicroBatch, n_targets: float,
                 step: _Step, routing: RoutingLog | None) -> torch.Tensor | None:
        """Returns the micro-batch's token loss on the last chunk."""
        out = self._chunk(a.chunk, x, mb, routing)
        if a.chunk == 0:
            x, self._embedded = self._embedded, None
        loss = None
        if a.chunk == self.n_chunks - 1:
            token_loss = self.loss_fn(out, mb.targets, mb.weights)
            out = with_model_loss(token_loss, routing) / n_targets
            loss = token_loss.detach() / n_targets
        else:
            out = carry_loss(out, routing, n_targets)
        step.inputs[(a.chunk, a.micro)], step.outputs[(a.chunk, a.micro)] = x, out
        step.held += 1
        step.peak = max(step.peak, step.held)
        return loss

    def _keep_embedded(self, module, args, out) -> None:
        self._embedded = out if torch.is_grad_enabled() else None

    def _backward(self, a: Action, grad: torch.Tensor | None, step: _Step, split: bool) -> None:
        key = (a.chunk, a.micro)
        x, out = step.inputs[key], step.outputs[key]
        needs_input_grad = a.chunk > 0
        if split:
            work = SplitBackward(out, x, grad)
            step.split[key] = work
            if needs_input_grad:
                step.input_grads[key] = work.input_grad
            return
        torch.autograd.backward(out, grad)
        if needs_input_grad:
            step.input_grads[key] = x.grad
        self._release(a, step)

    def _release(self, a: Action, step: _Step) -> None:
        """The micro-batch's last backward on this chunk: its activations can go."""
        del step.inputs[(a.chunk, a.micro)], step.outputs[(a.chunk, a.micro)]
        step.held -= 1

    def _post(self, group: list[Action], step: _Step, train: bool) -> None:
        sends, recvs = [], []
        for a in group:
            if a.kind == SEND_F:
                key = (a.chunk, a.micro)
                out = step.outputs[key] if train else step.outputs.pop(key)  # kept for backward
                sends.append((out.detach(), peer(a, self.pp)))
            elif a.kind == SEND_B:
                sends.append((step.input_grads.pop((a.chunk, a.micro)), peer(a, self.pp)))
            elif a.kind in (RECV_F, RECV_B):
                boundary = a.chunk - 1 if a.kind == RECV_F else a.chunk
                recvs.append((a, boundary))
        handles = self.links.post(sends, [(b, peer(a, self.pp)) for a, b in recvs])
        for (a, _), handle in zip(recvs, handles):
            step.received[(a.kind, a.chunk, a.micro)] = handle

    def _take(self, kind: str, a: Action, step: _Step) -> torch.Tensor:
        """A received buffer, once it has arrived; the step forgets it."""
        start = self.timeline.now()
        work, buf = step.received.pop((kind, a.chunk, a.micro))
        work.wait()
        self.timeline.add("wait", a.chunk, a.micro, start)
        return buf

    # -- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Forward only through the pipeline: the sum of token losses (no division), which
        only the last stage computes; summed over pp so every rank returns it."""
        self._check(micro_batches)
        self.agree_shapes(micro_batches[0])
        step, total = _Step(), 0.0
        for group in self.plan(len(micro_batches), train=False):
            a = group[0]
            if a.kind in MESSAGES:
                self._post(group, step, train=False)
                continue
            mb = micro_batches[a.micro]
            x = mb.tokens if a.chunk == 0 else self._take(RECV_F, a, step)
            out = self._chunk(a.chunk, x, mb)
            if a.chunk == self.n_chunks - 1:
                total += float(self.loss_fn(out, mb.targets, mb.weights).double())
            else:
                step.outputs[(a.chunk, a.micro)] = out
        self.links.wait_sends()
        total = ops.all_reduce_scalars([total], self.mesh.group("pp"))[0]
        return torch.tensor(total, dtype=torch.float64)

    @staticmethod
    def _check(micro_batches: list[MicroBatch]) -> None:
        shape = micro_batches[0].tokens.shape
        if any(mb.tokens.shape != shape for mb in micro_batches):
            raise ValueError("pipeline micro-batches must all have the same shape "
                             f"(got {sorted({tuple(mb.tokens.shape) for mb in micro_batches})})")
