"""The one executor that runs any pipeline schedule: `PipelineSchedule`, the `schedule` of a
pipelined `Parallelized` (same `run` and `evaluate` as `parallel.schedule.SingleStage`).

A step walks this rank's action list (schedules.py) in order:
- a group of messages is posted at once; a received buffer is waited for only by the action
  that consumes it, then dropped;
- F runs a chunk on a micro-batch: token ids on the first chunk, a received activation, or
  (a V's turn) the output of this rank's previous chunk; the last chunk turns its logits
  into the loss, divided by the step's global target count (the schedule owns the loss, so
  gradients equal one device's); loss terms the model reports during a chunk's forward (MoE
  load balancing) join that chunk's backward (`schedule.carry_loss`), or the loss on the
  last chunk;
- B runs the backward of one micro-batch of one chunk, from the loss, from the received
  output gradient, or from this rank's next chunk's input gradient; where the list has a W
  for it, only the input gradient (weightgrad.py), and W the weight gradients later. Where
  nobody reads that input gradient before the W (the first chunk, whose input is token ids;
  a V's turn, whose gradient stays on the rank: `lists.deferred`), B does nothing and W is
  the whole backward: no graph to split, no work moved before the W it was planned as;
- FB runs a forward and a backward together through `overlap(forward, backward)`: by
  default one after the other; a hook can interleave them, e.g. to hide one's messages (the
  MoE all-to-all under expert parallelism) behind the other's compute;
- gradient synchronisation over dp × cp (DP buckets or ZeRO) is switched on only for the
  last backward action that touches each chunk, so its buckets are reduced once per step,
  overlapped with the rest of the schedule, never per micro-batch;
- at the end: sends completed, the gradient sync finished, the tied embedding summed.

Every action is timed into `timeline` (timeline.py; an F&B as its two parts), and the number
of micro-batches whose activations are held (forward done, last backward not) is tracked:
`peak_held`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ndtrain.comm import ops
from ndtrain.mesh import ParallelMesh
from ndtrain.parallel.pipeline.partition import owner
from ndtrain.parallel.pipeline.p2p import StageLinks
from ndtrain.parallel.pipeline.lists import build_schedule, deferred, for_async_messages
from ndtrain.parallel.pipeline.schedules import (B, COMPUTE, F, MESSAGES, RECV_B, RECV_F, SEND_B, SEND_F, W,
                                                 Action, parts, peer, vshape)
from ndtrain.parallel.pipeline.stage import TiedEmbedding
from ndtrain.parallel.pipeline.timeline import Event, Timeline
from ndtrain.parallel.pipeline.verify import groups, verify
from ndtrain.parallel.pipeline.weightgrad import SplitBackward
from ndtrain.data.batch import MicroBatch
from ndtrain.model.moe import RoutingLog
from ndtrain.kernels.fp8_linear import set_micro
from ndtrain.parallel.schedule import GradSync, carry_loss, with_model_loss


class _Step:
    """What one step keeps between actions, keyed by (chunk, micro)."""

    def __init__(self, micro_batches: list[MicroBatch], n_targets: float, grad_sync: GradSync | None,
                 routing: RoutingLog | None, device: torch.device):
        self.micro_batches, self.n_targets, self.grad_sync, self.routing = micro_batches, n_targets, grad_sync, routing
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.received: dict[tuple[str, int, int], tuple[object, torch.Tensor]] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.split: dict[tuple[int, int], SplitBackward] = {}
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.held = 0
        self.peak = 0


def run_in_turn(forward: Callable[[], None], backward: Callable[[], None]) -> None:
    """The default overlap of an F&B: the forward, then the backward."""
    forward()
    backward()


class PipelineSchedule:
    def __init__(self, chunks: dict[int, nn.Module], mesh: ParallelMesh, name: str, virtual: int,
                 loss_fn: Callable, tied: TiedEmbedding | None = None):
        self.chunks, self.mesh, self.name, self.loss_fn, self.tied = chunks, mesh, name, loss_fn, tied
        self.pp, self.v, self.vshape = mesh.shape.pp, virtual, vshape(name)
        self.rank = mesh.coord("pp")
        self.n_chunks = self.pp * self.v
        self.links = StageLinks(mesh.group("pp"), mesh.device)
        self.timeline = Timeline(mesh.device)  # `.sync = True` to time CUDA kernels, not launches
        self.peak_held = 0
        # `overlap(forward, backward)` runs the two halves of an F&B action (see module docstring)
        self.overlap: Callable[[Callable[[], None], Callable[[], None]], None] = run_in_turn
        self._plans: dict[tuple[int, bool], _Plan] = {}
        self._probed: tuple | None = None
        self._positions: torch.Tensor | None = None  # 0..s-1, for micro-batches that give none
        # gloo: posting a message blocks nothing, so receives are posted a compute action
        # early (lists.for_async_messages); NCCL runs a communicator's messages in order on
        # its stream: there the lists run as verified
        self.async_p2p = ops.independent_messages(mesh.group("pp"))
        # NCCL: the first operation on a group must involve all of its ranks.
        ops.all_reduce_scalars([0.0], mesh.group("pp"))

    def owner(self, chunk: int) -> int:
        return owner(chunk, self.pp, self.vshape)

    # -- plans ---------------------------------------------------------------------
    def plan(self, m: int, train: bool) -> "_Plan":
        """This rank's actions in groups (a message group, or one compute action), verified."""
        key = (m, train)
        if key not in self._plans:
            schedule = build_schedule(self.name, self.pp, self.v, m, train=train)
            verify(schedule, self.pp, self.v, m, train=train, v_shape=self.vshape)
            mine = schedule[self.rank]
            if self.async_p2p:
                mine = for_async_messages(mine)
            self._plans[key] = _Plan(groups(mine), self.pp, self.vshape)
        return self._plans[key]

    # -- shapes, once per run ----------------------------------------------------------
    @torch.no_grad()
    def agree_shapes(self, mb: MicroBatch) -> None:
        """Run one micro-batch through the chunks in pipeline order, with dropout off, each
        boundary's sender announcing the shape of what it sends (p2p.StageLinks); a boundary
        inside a rank (a V's turn) sends nothing."""
        key = (tuple(mb.tokens.shape), mb.tokens.dtype)
        if self._probed == key:
            return
        modes = {m: m.training for chunk in self.chunks.values() for m in chunk.modules()}
        for chunk in self.chunks.values():
            chunk.eval()
        out = None
        for c in range(self.n_chunks):
            if self.owner(c) != self.rank:
                continue
            x = mb.tokens if c == 0 else out if self.owner(c - 1) == self.rank else \
                self.links.recv_with_header(c - 1, self.owner(c - 1))
            if c == self.n_chunks - 1:
                break
            out = self._chunk(c, x, mb)
            if self.owner(c + 1) != self.rank:
                self.links.send_with_header(out, c, self.owner(c + 1))
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
        step = _Step(micro_batches, n_targets, grad_sync, routing, self.mesh.device)
        timeline = self.timeline
        timeline.begin()
        for k, group in enumerate(plan.groups):
            a = group[0]
            kind = a.kind
            if kind in MESSAGES:
                start = timeline.now()
                self._post(group, step, plan, train=True)
                timeline.add("post", a.chunk, a.micro, start)
            elif kind == F:
                self._run_forward(a, step)
            elif kind == B:
                self._run_backward(a, step, plan, k)
            elif kind == W:
                start = timeline.now()
                step.grad_sync.set_sync(plan.last_backward[a.chunk] == k)
                step.split.pop((a.chunk, a.micro)).weights()
                if a.chunk > 0 and (a.chunk, a.micro) in plan.deferred:  # the whole backward ran here
                    step.input_grads[(a.chunk, a.micro)] = step.inputs[(a.chunk, a.micro)].grad
                self._release(a, step)
                timeline.add(W, a.chunk, a.micro, start)
            else:  # FB
                fwd, bwd = parts(a)
                self.overlap(lambda: self._run_forward(fwd, step), lambda: self._run_backward(bwd, step, plan, k))
        self.links.wait_sends()
        # every activation released, every received buffer consumed, every gradient sent
        assert not (step.inputs or step.received or step.input_grads or step.split), "pipeline step left state behind"
        grad_sync.finish()
        if self.tied is not None:
            self.tied.sync()
        self.peak_held = step.peak
        return step.loss

    def _run_forward(self, a: Action, step: _Step) -> None:
        mb = step.micro_batches[a.micro]
        x = self._input(a, step, mb, train=True)
        start = self.timeline.now()
        self._forward(a, x, mb, step)
        self.timeline.add(F, a.chunk, a.micro, start)

    def _run_backward(self, a: Action, step: _Step, plan: "_Plan", k: int) -> None:
        key = (a.chunk, a.micro)
        if a.chunk == self.n_chunks - 1:
            grad = None
        elif plan.local_after(a.chunk):
            grad = step.input_grads.pop((a.chunk + 1, a.micro))
        else:
            grad = self._take(RECV_B, a, step)
        start = self.timeline.now()
        step.grad_sync.set_sync(plan.last_backward[a.chunk] == k)
        self._backward(a, grad, step, key in plan.split, key in plan.deferred)
        self.timeline.add(B, a.chunk, a.micro, start)

    def _input(self, a: Action, step: _Step, mb: MicroBatch, train: bool) -> torch.Tensor:
        """What chunk a.chunk runs on: token ids, this rank's previous chunk's output (a leaf
        of its own, so each chunk's backward stops at its input), or a received activation."""
        if a.chunk == 0:
            return mb.tokens
        if self.owner(a.chunk - 1) == self.rank:
            key = (a.chunk - 1, a.micro)
            if not train:
                return step.outputs.pop(key)
            return step.outputs[key].detach().requires_grad_()
        x = self._take(RECV_F, a, step)
        return x.requires_grad_() if train else x

    def _chunk(self, c: int, x: torch.Tensor, mb: MicroBatch, routing: RoutingLog | None = None) -> torch.Tensor:
        """Chunk c on x. Positions come from the micro-batch, not from x: a received
        activation may hold only part of the sequence (sequence parallelism)."""
        positions = mb.positions
        if positions is None:
            s = mb.tokens.shape[1]
            if self._positions is None or self._positions.numel() != s:
                self._positions = torch.arange(s, device=mb.tokens.device)
            positions = self._positions
        extra = self.loss_fn.model_kwargs(mb) if c == self.n_chunks - 1 else {}  # chunked logits: the loss
        return self.chunks[c](x, positions=positions, doc_ids=mb.doc_ids, routing=routing, **extra)

    def _forward(self, a: Action, x: torch.Tensor, mb: MicroBatch, step: _Step) -> None:
        """Adds the micro-batch's token loss to the step's on the last chunk."""
        set_micro(self.chunks[a.chunk], a.micro)
        if a.chunk == self.n_chunks - 1 and step.routing is not None and step.routing.mtp is not None:
            step.routing.mtp.batch = mb  # multi-token prediction reads the batch (model/mtp.py)
        out = self._chunk(a.chunk, x, mb, step.routing)
        if a.chunk == self.n_chunks - 1:
            token_loss = self.loss_fn(out, mb)
            out = with_model_loss(token_loss, step.routing) / step.n_targets
            step.loss += token_loss.detach() / step.n_targets
        else:
            out = carry_loss(out, step.routing, step.n_targets)
        step.inputs[(a.chunk, a.micro)], step.outputs[(a.chunk, a.micro)] = x, out
        step.held += 1
        step.peak = max(step.peak, step.held)

    def _backward(self, a: Action, grad: torch.Tensor | None, step: _Step, split: bool, defer: bool) -> None:
        """`split`: B now, W later (weightgrad.py); `defer`: a split backward whose input
        gradient nobody reads before its W (lists.deferred): nothing now, the whole backward at W."""
        key = (a.chunk, a.micro)
        x, out = step.inputs[key], step.outputs[key]
        needs_input_grad = a.chunk > 0
        if split:
            work = SplitBackward(out, None if defer else x, grad)
            step.split[key] = work
            if defer:
                return
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

    def _post(self, group: list[Action], step: _Step, plan: "_Plan", train: bool) -> None:
        sends, recvs = [], []
        for a in group:
            if a.kind == SEND_F:
                key = (a.chunk, a.micro)
                out = step.outputs[key] if train else step.outputs.pop(key)  # kept for backward
                sends.append((out.detach(), plan.peer(a)))
            elif a.kind == SEND_B:
                sends.append((step.input_grads.pop((a.chunk, a.micro)), plan.peer(a)))
            else:
                recvs.append((a, a.chunk - 1 if a.kind == RECV_F else a.chunk))
        handles = self.links.post(sends, [(b, plan.peer(a)) for a, b in recvs])
        for (a, _), handle in zip(recvs, handles):
            step.received[(a.kind, a.chunk, a.micro)] = handle
        now = self.timeline.now()
        for a in group:  # when each message left: the trace estimates what a message takes
            if a.kind in (SEND_F, SEND_B):
                self.timeline.events.append(Event(a.kind, a.chunk, a.micro, now, now))

    def _take(self, kind: str, a: Action, step: _Step) -> torch.Tensor:
        """A received buffer, once it has arrived; the step forgets it."""
        start = self.timeline.now()
        work, buf = step.received.pop((kind, a.chunk, a.micro))
        work.wait()
        self.timeline.add("wait_F" if kind == RECV_F else "wait_B", a.chunk, a.micro, start)
        return buf

    # -- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Forward only through the pipeline: the sum of token losses (no division), which
        only the last stage computes; summed over pp so every rank returns it."""
        sums = self._forward_only(micro_batches, lambda out, mb: float(self.loss_fn(out, mb).double()))
        total = ops.all_reduce_scalars([sum(sums)], self.mesh.group("pp"))[0]
        return torch.tensor(total, dtype=torch.float64)

    @torch.no_grad()
    def logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """log p(target) [b, s] of every micro-batch (fp64), computed by the last stage and
        broadcast over pp, so every rank returns them."""
        mine = self._forward_only(micro_batches, lambda out, mb: self.loss_fn.logprobs(out, mb).double())
        last = self.owner(self.n_chunks - 1)
        out = []
        for i, mb in enumerate(micro_batches):
            t = mine[i] if self.rank == last else torch.empty(mb.targets.shape, dtype=torch.float64,
                                                              device=mb.targets.device)
            ops.broadcast(t, self.mesh.group("pp"), src=last)
            out.append(t)
        return out

    def _forward_only(self, micro_batches: list[MicroBatch], on_last) -> list:
        """Forward every micro-batch through the pipeline; `on_last(output, mb)` of each on
        the last stage (an empty list elsewhere)."""
        self._check(micro_batches)
        self.agree_shapes(micro_batches[0])
        step, results = _Step(micro_batches, 1.0, None, None, self.mesh.device), []
        plan = self.plan(len(micro_batches), train=False)
        for group in plan.groups:
            a = group[0]
            if a.kind in MESSAGES:
                self._post(group, step, plan, train=False)
                continue
            mb = micro_batches[a.micro]
            out = self._chunk(a.chunk, self._input(a, step, mb, train=False), mb)
            if a.chunk == self.n_chunks - 1:
                results.append((a.micro, on_last(out, mb)))
            else:
                step.outputs[(a.chunk, a.micro)] = out
        self.links.wait_sends()
        return [r for _, r in sorted(results, key=lambda x: x[0])]

    @staticmethod
    def _check(micro_batches: list[MicroBatch]) -> None:
        shape = micro_batches[0].tokens.shape
        if any(mb.tokens.shape != shape for mb in micro_batches):
            raise ValueError("pipeline micro-batches must all have the same shape "
                             f"(got {sorted({tuple(mb.tokens.shape) for mb in micro_batches})})")


class _Plan:
    """This rank's groups of a schedule, and what the executor looks up while running them."""

    def __init__(self, groups: list[list[Action]], pp: int, v_shape: bool):
        self.groups, self.pp, self.v_shape = groups, pp, v_shape
        computed = [p for g in groups if g[0].kind in COMPUTE for p in parts(g[0])]
        self.split = {(p.chunk, p.micro) for p in computed if p.kind == W}  # backwards split into B and W
        self.deferred = deferred([a for g in groups for a in g])  # of them: nothing at B, whole at W
        self.last_backward: dict[int, int] = {}  # chunk -> index of the group of its last backward
        for k, g in enumerate(groups):
            for p in (parts(g[0]) if g[0].kind in COMPUTE else ()):
                if p.kind in (B, W):
                    self.last_backward[p.chunk] = k
        self._peers: dict[Action, int] = {}

    def local_after(self, chunk: int) -> bool:
        """Whether the chunk after `chunk` is on this rank too (a V's turn)."""
        return owner(chunk + 1, self.pp, self.v_shape) == owner(chunk, self.pp, self.v_shape)

    def peer(self, a: Action) -> int:
        if a not in self._peers:
            self._peers[a] = peer(a, self.pp, self.v_shape)
        return self._peers[a]
