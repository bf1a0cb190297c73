"""ZeRO-1/2/3 and hybrid sharding (HSDP): data parallelism whose model states are split.

Plain data parallelism keeps on every rank the parameters (Ψ values), their gradients and
the optimizer state (fp32 master weights and Adam's two moments). ZeRO (Rajbhandari et al.
2020) gives each of the N ranks of the shard group one N-th of them:
- stage 1: the optimizer state. Gradients are *reduce-scattered* (each rank receives the
  sum of its slice only), each rank updates its slice, and the parameters are
  *all-gathered* back. Same bytes on the wire as an all-reduce, which is exactly a
  reduce-scatter followed by an all-gather.
- stage 2: the gradients too. Each unit's gradients are reduce-scattered as soon as its
  backward ends, and only this rank's slice of the sum is kept.
- stage 3: the parameters too. A unit's parameters are all-gathered just before its forward,
  freed after it, gathered again just before its backward and freed after it. The gather of
  the next unit is started early (prefetched) so it overlaps the current unit's compute.
  With `parallel.reshard_after_forward = false` a unit stays gathered from its forward to
  its backward: one gather fewer, the memory of stage 2 in between.

Units. Each decoder block (`model.layers[k]`) is one unit; everything else of a decoder
(embedding, final norm, output head; a tied head is the embedding's own parameter) is its
*root* unit. Stage 3 gathers and frees units; every stage reduces gradients per unit.
ZeRO only sees the module's local parameters, so a tensor-parallel shard or a pipeline
stage's chunks are sharded the same way.

Flat buffers (parallel/zero_flat.py). The parameters of one unit that share placement
(`shard_dims`, duplicate or not, parallel/placement.py), weight-decay group, optimizer
(Muon's matrices apart under train.optimizer = muon: parallel/muon.py) and dtype are
packed into one flat buffer `full`, padded to a multiple of N; every parameter becomes a view
into it. Rank r owns the slice [r·S, (r+1)·S), S = padded / N. Its fp32 *master* of that
slice is what the optimizer updates (one tensor per flat buffer, so AdamW runs on N times
fewer elements), marked with the parameters' shard dims plus "dp_shard" and "cp", so
parallel/clip.py's global norm counts each element once. In fp32 the master *is* the slice
of the parameters (no copy).

Groups. ZeRO shards over `dp_shard × cp` (the mesh group `dp_shard_cp`, which is just
dp_shard while context parallelism is off): context-parallel ranks hold the same
parameters, so they can share the sharding, and one reduce-scatter sums gradients over both.
With `parallel.dp_replicate > 1` (HSDP) every group of dp_shard ranks holds a full sharded
copy: after the reduce-scatter, each rank all-reduces its slice with the ranks holding the
same slice in the other replicas (`dp_replicate`). Together: a sum over dp × cp, as
DESIGN.md asks of dense gradients. Routed experts' weights (placement `expert_slice`) go into
flats of their own, sharded over `edp_shard` (the ranks of dp_shard × cp holding the same
experts, mesh.py) and reduced over `edp_shard × dp_replicate`, each flat with its own group.

Frozen parameters (LoRA's base weights) go into flats of their own (`FlatParam.frozen`):
sharded and, under stage 3, gathered and freed with their unit like the others, but without
master, gradient buffer, reduction or optimizer state. `flats` lists the flats that train,
`frozen` the others. A stage-3 unit holding frozen weights is freed when the gradient of its
input is complete (its frozen matmuls may still need their weights after its last trainable
gradient), or at the end of the backward pass.

Gradients are stored in the compute dtype and reduced in `reduce_dtype` (fp32 by default,
parallel/precision.py). Stage 1 accumulates micro-batches locally and reduces once per step;
stages 2 and 3 reduce after every micro-batch's backward (that is what keeps the full
gradients from ever existing), so accumulation multiplies their gradient traffic.

Collectives on one group must be issued in the same order on every rank: reduce-scatters
start strictly in unit order (last block first, root last); a unit whose gradients are not
all ready delays the ones after it until the end of the backward pass, never forever.
Stage 3 assumes every rank runs the same units in the same order, as the decoder does.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ndtrain.comm import ops
from ndtrain.mesh import ParallelMesh
from ndtrain.parallel.construct import swap_parameters
from ndtrain.parallel.fp8_gather import Fp8AllGather
from ndtrain.parallel.placement import OptimSlice, is_duplicate, is_expert, partial_dims, shard_dims
from ndtrain.parallel.states import decay_groups, decays, muon_matrix, persistent_buffers
from ndtrain.parallel.zero_flat import (SHARD_DIMS, FlatParam, Unit, allocate_storage, decoder_units, free_storage,
                                        link_units)


class ZeRO:
    """Sharded model states over `dp_shard × cp`, replicated over `dp_replicate`.

    The gradient synchroniser of every schedule (`set_sync`, `finish`, `zero_grad`) and the
    owner of what the optimizer updates (`param_groups`, `grads_to_optimizer`, `after_step`).

    `defer` (a pipeline stage, whose chunks run many backward passes per step): stages 2
    and 3 accumulate a chunk's gradient locally until its last backward pass of the step
    (the schedule's `set_sync(True)`) and reduce-scatter it once, as stage 1 does; stage 3
    keeps each unit gathered from its first forward to that last backward (see "With ZeRO"
    in docs/architecture.md for the memory this costs).
    """

    def __init__(self, model: nn.Module, mesh: ParallelMesh, stage: int, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, init: Callable, reshard_after_forward: bool = True,
                 defer: bool = False, decoders: dict[str, nn.Module] | None = None,
                 fp8_weights: set[int] = frozenset(), muon: bool = False):
        """`fp8_weights`: ids of the parameters stage 3 gathers in fp8 (parallel/fp8_gather.py).
        `muon` (train.optimizer = muon): Muon's matrices (states.muon_matrix) get flats of their own."""
        self.muon = muon
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage}")
        self.stage, self.defer, self.fp8_weights = stage, defer, fp8_weights
        self.group = mesh.group("dp_shard_cp")
        self.expert_group = mesh.group("edp_shard")
        self.expert_dims = ("edp_shard",) if mesh.shape.ep > 1 else SHARD_DIMS
        self.replicas = mesh.group("dp_replicate")
        self.reshard_after_forward = reshard_after_forward and not defer
        self.model = model
        self.units: list[Unit] = []
        names: dict[int, str] = {}
        backward_order: list[Unit] = []
        make = functools.partial(self._flats, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype, init=init,
                                 device=mesh.device)
        for decoder in decoder_units(model, decoders):
            units = [Unit(unit_name, module, make(unit_name, named)) for unit_name, module, named in decoder]
            names.update({id(p): n for _, _, named in decoder for n, p in named})
            self.units += units
            backward_order = link_units(units) + backward_order  # later decoders run backward first
        # The flats that train (what is reduced and updated, in the order gradients complete)
        # and those that do not (LoRA's base weights: gathered and freed with their units only).
        everything = [f for u in backward_order for f in u.flats]
        self.flats = [f for f in everything if not f.frozen]
        self.frozen = [f for f in everything if f.frozen]
        # Every parameter becomes a view into its flat buffer (construct.py: new objects).
        new = {old: q for f in everything for old, q in f.replacements.items()}
        swap_parameters(model, new)
        for f in everything:
            f.adopt()
        self.names = {id(new[old]): n for old, n in names.items()}
        self._flat_of = {id(p): f for f in self.flats for p in f.params}
        self._unit_of = {id(f): u for u in self.units for f in u.flats}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for f in self.flats for p in f.params]
        # A unit holding frozen weights still needs them after its last trainable gradient
        # (the input gradient of a frozen matmul can come later): it is freed once the
        # gradient of its input is complete, or at the end of the backward pass.
        self._free_on_input_grad = {id(u) for u in self.units if any(f.frozen for f in u.flats)}
        if stage == 3:
            for unit in self.units:
                self._hooks.append(unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit)))
                self._hooks.append(unit.module.register_forward_hook(functools.partial(self._post_forward, unit)))
        self.sync = True
        self._next_launch = 0
        self._in_backward = False
        self.gathered_bytes = 0  # stage 3: bytes of units gathered right now (memory accounting)
        self.fp8_gather = Fp8AllGather([f for f in self.flats if f.fp8], [mesh.group("tp")])
        self.fp8_gather.refresh()

    def _flats(self, unit_name, named, compute_dtype, reduce_dtype, init, device) -> list[FlatParam]:
        by_key: dict[tuple, list[nn.Parameter]] = {}
        for param_name, p in named:
            fp8 = id(p) in self.fp8_weights and not is_expert(p)
            muon = self.muon and muon_matrix(param_name, p)
            key = (shard_dims(p), is_duplicate(p), is_expert(p), decays(p), p.dtype, p.device, fp8, p.requires_grad,
                   muon)
            by_key.setdefault(key, []).append(p)
        flats = []
        for (dims, dup, experts, decay, _, _, fp8, trains, muon), params in by_key.items():
            name = ".".join([unit_name, "decay" if decay else "no_decay", *dims] + (["duplicate"] if dup else [])
                            + (["experts"] if experts else []) + (["fp8"] if fp8 else [])
                            + ([] if trains else ["frozen"]) + (["muon"] if muon else []))
            group, group_dims = (self.expert_group, self.expert_dims) if experts else (self.group, SHARD_DIMS)
            flats.append(FlatParam(name, params, self.stage, group, compute_dtype, reduce_dtype, init, device,
                                   group_dims, fp8))
            flats[-1].muon = muon
        return flats

    # -- the optimizer's view ---------------------------------------------------
    def param_groups(self, weight_decay: float, muon: bool = False) -> list[dict]:
        """`muon`: the flats of Muon's matrices in a group of their own (built with muon=True)."""
        return decay_groups([f.master for f in self.flats if f.decays and not f.muon],
                            [f.master for f in self.flats if not f.decays], weight_decay,
                            [f.master for f in self.flats if f.muon])

    def optim_params(self) -> list[nn.Parameter]:
        return [f.master for f in self.flats]

    @torch.no_grad()
    def grads_to_optimizer(self, unscale: float) -> None:
        """Each master's gradient: the summed slice (fp32 under bf16/fp16: no copy), unscaled (fp16)."""
        for f in self.flats:
            g = f.grad_shard if f.grad_shard is not None else f._zeros(f.shard_numel)
            f.master.grad = g.float() if f.separate_master else g
            if unscale != 1.0:
                f.master.grad.mul_(unscale)

    @torch.no_grad()
    def after_step(self) -> None:
        """The updated masters become this rank's slice of the parameters; stages 1-2
        all-gather the slices so every rank holds the whole updated model again."""
        self.drop_grads()
        for f in self.flats:
            if f.separate_master:
                f.shard.copy_(f.master)
        self.fp8_gather.refresh()
        if self.stage < 3:
            works = [ops.all_gather(f.full, f.shard, f.group, async_op=True) for f in self.flats]
            for w in works:
                w.wait()

    def drop_grads(self) -> None:
        for f in self.flats:
            f.master.grad = None

    def partial_grads(self, dim: str) -> list[torch.Tensor]:
        """The parts of this rank's summed gradient slices that belong to parameters marked
        partial over `dim` (tensor.sum_partial_grads completes them). Ranks of `dim` hold
        the same flats and the same slice of each, so the lists line up."""
        out = []
        for f in self.flats:
            lo, hi = f.group.rank * f.shard_numel, (f.group.rank + 1) * f.shard_numel
            spans = [(max(s.start, lo) - lo, min(s.stop, hi) - lo)
                     for s in (f.range(p) for p in f.params if dim in partial_dims(p))]
            spans = [(a, b) for a, b in spans if a < b]
            if spans and f.grad_shard is None:  # no gradient arrived here: zeros take part
                f.grad_shard = f._zeros(f.shard_numel)
            out += [f.grad_shard[a:b] for a, b in spans]
        return out

    def summed_grad(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's slice of `p`'s summed gradient, for a parameter alone in its flat
        buffer (the pipeline's tied embedding and head)."""
        flat = self._flat_of[id(p)]
        assert flat.params == [p], f"{flat.name} holds more than one parameter"
        return flat.grad_shard

    # -- GradSync: called by the schedule ---------------------------------------
    def set_sync(self, enabled: bool) -> None:
        """Stage 1 (and every stage under `defer`): True on the last micro-batch, whose
        backward communicates. Stages 2-3 otherwise reduce every micro-batch regardless."""
        self.sync = enabled

    def _reduces_now(self) -> bool:
        return self.sync or (self.stage >= 2 and not self.defer)

    def _accumulates_locally(self) -> bool:
        """Gradients wait in the full local buffer until `finish` (stage 1, or deferred)."""
        return self.stage == 1 or self.defer

    def _note_backward(self) -> None:
        """At the first hook of a backward pass, ask autograd to call us when it ends."""
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        flat = self._flat_of[id(p)]
        flat.take_grad(p)
        if not self._reduces_now():
            return
        self._note_backward()
        flat.ready += 1
        if flat.complete:
            self._launch_ready_prefix()
            if self.stage == 3:
                unit = self._unit_of[id(flat)]
                if id(unit) not in self._free_on_input_grad and all(f.complete for f in unit.flats):
                    self._reshard(unit)  # its backward is over

    def _launch_ready_prefix(self) -> None:
        """Launch the flats that complete the ordered prefix. Before a new batch goes out,
        wait for the reduce-scatters still in flight and keep their slices: that frees their
        full-size inputs, so one batch (about one unit's gradient) waits on the wire at a
        time, as in FSDP2, instead of every unit's until the end of the backward pass."""
        if self._next_launch < len(self.flats) and self.flats[self._next_launch].complete:
            for f in self.flats[:self._next_launch]:
                self._resolve(f)
        while self._next_launch < len(self.flats) and self.flats[self._next_launch].complete:
            self._launch(self.flats[self._next_launch])

    def _launch(self, flat: FlatParam) -> None:
        """Reduce-scatter a flat buffer's gradients over its shard group (asynchronous)."""
        grads = flat.reduce_input()
        out = torch.empty(flat.shard_numel, dtype=grads.dtype, device=grads.device)
        work = ops.reduce_scatter(out, grads, flat.group, async_op=True)
        flat.pending = (work, out, grads)
        self._next_launch += 1

    def _resolve(self, flat: FlatParam) -> None:
        if flat.pending is not None:
            work, out, _ = flat.pending
            work.wait()
            flat.accumulate(out)
            flat.pending = None

    def _end_of_backward(self) -> None:
        """Launch what is still waiting (in order), keep every reduced slice (which frees
        the full-size gradients), free what stage 3 still holds. Stage 1 reduces once per
        step: its flats launch as they complete, and `finish()` launches the rest, since
        a pipeline stage runs several backward passes whose last ones touch different
        chunks (a flat still incomplete here has its last gradients still to come)."""
        self._in_backward = False
        if self._accumulates_locally():
            return
        self._flush()
        if self.stage == 3:
            for unit in self.units:
                self._reshard(unit)

    def _flush(self) -> None:
        while self._next_launch < len(self.flats):
            self._launch(self.flats[self._next_launch])
        for f in self.flats:
            self._resolve(f)
            f.ready = 0
        self._next_launch = 0

    def finish(self) -> None:
        """Wait for every reduce-scatter; HSDP: all-reduce each slice across the replicas.
        Stage 1 (and a deferred stage) first launches the flats its backward passes left
        incomplete; a deferred stage 3 then frees what its chunks kept gathered."""
        if self._accumulates_locally():
            self._flush()
            if self.stage == 3:
                for unit in self.units:
                    self._reshard(unit)
        for f in self.flats:
            self._resolve(f)
        if self.replicas.active:
            sends = [f.grad_shard if f.grad_shard.dtype == f.reduce_dtype else f.grad_shard.to(f.reduce_dtype)
                     for f in self.flats]
            works = [ops.all_reduce(s, self.replicas, async_op=True) for s in sends]
            for f, s, w in zip(self.flats, sends, works):
                w.wait()
                if s is not f.grad_shard:
                    f.grad_shard.copy_(s)
        self.sync = True

    def replica_grads(self) -> list[torch.Tensor]:
        """The summed gradient slices a replica group sums with the others' (replicas/):
        what HSDP all-reduces over dp_replicate in `finish`."""
        return [f.grad_shard for f in self.flats]

    def zero_grad(self) -> None:
        for f in self.flats:
            if self.stage == 1:
                f.grad_full.zero_()
            else:
                f.grad_shard = None

    # -- stage 3: gather before use, free after ------------------------------------
    def _gather(self, unit: Unit) -> None:
        """Start all-gathering a unit's parameters (no-op if it is gathered or on its way)."""
        if unit.state != "sharded":
            return
        for f in unit.flats:
            self.gathered_bytes += allocate_storage(f.full)
            out, part = (f.full.view(torch.uint8), f.shard_fp8.view(torch.uint8)) if f.fp8 else (f.full, f.shard)
            unit.works.append(ops.all_gather(out, part, f.group, async_op=True))
        unit.state = "gathering"

    def _wait(self, unit: Unit) -> None:
        if unit.state == "gathering":
            for w in unit.works:
                w.wait()
            unit.works, unit.state = [], "gathered"

    def _reshard(self, unit: Unit) -> None:
        if unit.state == "sharded":
            return
        self._wait(unit)
        for f in unit.flats:
            self.gathered_bytes -= free_storage(f.full)
        unit.state = "sharded"

    def _pre_forward(self, unit: Unit, module, args) -> None:
        self._gather(unit)
        self._wait(unit)
        if unit.next is not None:
            self._gather(unit.next)  # prefetch: overlaps this unit's forward
        x = args[0] if args else None
        trains = torch.is_grad_enabled() and not self.defer
        if trains and id(unit) in self._free_on_input_grad and isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(functools.partial(self._input_grad_done, unit))

    def _input_grad_done(self, unit: Unit, grad: torch.Tensor) -> None:
        """The gradient of a unit's input is complete: its backward used its weights for the
        last time."""
        self._reshard(unit)

    def _post_forward(self, unit: Unit, module, args, output) -> None:
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, unit))
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._reshard(unit)

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._note_backward()
        self._gather(unit)
        self._wait(unit)
        if unit.prev is not None:
            self._gather(unit.prev)  # prefetch: overlaps this unit's backward

    # -- state for checkpoints ----------------------------------------------------
    def optim_slices(self) -> list[OptimSlice]:
        """What this rank's masters hold: for each parameter overlapping the rank's slice
        [lo, hi) of a flat buffer, the part of it there (checkpoint/layout.py)."""
        return [s for f in self.flats for s in self._slices(f, f.master)]

    def _slices(self, f: FlatParam, holder: torch.Tensor) -> list[OptimSlice]:
        out = []
        lo, hi = f.group.rank * f.shard_numel, (f.group.rank + 1) * f.shard_numel
        for p in f.params:
            start, n = f.slot[id(p)]
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                out.append(OptimSlice(self.names[id(p)], p, holder, a - lo, a - start, b - start))
        return out

    def frozen_slices(self) -> list[OptimSlice]:
        """What this rank holds of the parameters that do not train (LoRA's base weights),
        for checkpoints: stage 3, its slices of their flat buffers; stages 1-2, each whole."""
        if self.stage < 3:
            return [OptimSlice(self.names[id(p)], p, p, 0, 0, p.numel()) for f in self.frozen for p in f.params]
        return [s for f in self.frozen for s in self._slices(f, f.shard)]

    def local_state(self) -> dict[str, torch.Tensor]:
        """Stage 3: this rank's slices by flat-buffer name; stages 1-2: the (replicated)
        parameters by name, copied out of the flat buffers. And the model's buffers (an MoE
        router's bias), by name."""
        flats = self.flats + self.frozen
        if self.stage == 3:
            state = {f.name: f.shard for f in flats}
        else:
            state = {self.names[id(p)]: p.detach().clone() for f in flats for p in f.params}
        return {**state, **self.buffers()}

    def buffers(self) -> dict[str, torch.Tensor]:
        return persistent_buffers(self.model)

    @torch.no_grad()
    def gathered_state(self) -> dict[str, torch.Tensor] | None:
        """The local model's parameters (and buffers), whole over each flat's shard group,
        on that group's rank 0 (None where a rank is rank 0 of no group; expert flats have
        a group of their own). Collective over the shard groups under stage 3."""
        first = self.group.rank == 0 or self.expert_group.rank == 0
        if self.stage < 3:
            return self.local_state() if first else None
        out = self._gather_flats(lambda f: f.shard, self.flats + self.frozen)
        return {**out, **self.buffers()} if first else None

    @torch.no_grad()
    def gathered_grads(self) -> dict[str, torch.Tensor] | None:
        """The optimizer's gradients (summed, unclipped), whole over each flat's shard
        group, by parameter name, on that group's rank 0 (None elsewhere). Collective over
        the shard groups."""
        out = self._gather_flats(lambda f: f.master.grad if f.master.grad is not None else torch.zeros_like(f.master),
                                 self.flats)
        return out if self.group.rank == 0 or self.expert_group.rank == 0 else None

    def _gather_flats(self, slice_of, flats: list[FlatParam]) -> dict[str, torch.Tensor]:
        out = {}
        for f in flats:
            part = slice_of(f)
            full = torch.empty(f.full.numel(), dtype=part.dtype, device=part.device)
            ops.all_gather(full, part.contiguous(), f.group)
            if f.group.rank == 0:
                out.update({self.names[id(p)]: f.view_of(full, p).clone() for p in f.params})
        return out

    # -- memory accounting ---------------------------------------------------------
    def _flats_of(self, experts: bool, flats: list[FlatParam] | None = None) -> list[FlatParam]:
        return [f for f in (self.flats if flats is None else flats) if is_expert(f.params[0]) or not experts]

    def param_tensors(self, experts: bool = False) -> list[torch.Tensor]:
        """The parameters' buffers: gathered, this rank's slices, and their fp8 copies."""
        flats = self._flats_of(experts, self.flats + self.frozen)
        return [t for f in flats for t in (f.full, f.shard) + ((f.shard_fp8,) if f.fp8 else ())]

    def grad_tensors(self, experts: bool = False) -> list[torch.Tensor]:
        return [t for f in self._flats_of(experts) for t in (f.grad_full, f.grad_shard) if t is not None]

    def master_tensors(self, experts: bool = False) -> list[torch.Tensor]:
        return [f.master for f in self._flats_of(experts)]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def model_state_bytes(psi: int, stage: int, n: int, compute_bytes: int, moments: int = 2) -> dict[str, float]:
    """Model-state bytes per rank for Ψ parameters over n ranks (the ZeRO paper's terms, with
    our gradient accumulator): parameters in `compute_bytes` (c) each; gradients accumulated
    in fp32 under bf16/fp16 (4 bytes: the paper counts 2, but adding many micro-batches in
    bf16 loses precision), else in the compute dtype; K bytes of optimizer state per
    parameter: the fp32 master (unless the compute dtype is fp32 or wider) and Adam's two
    moments in that dtype. bf16/fp16: 2Ψ + 4Ψ + 12Ψ; fp32: 4Ψ + 4Ψ + 8Ψ; fp64: 8Ψ + 8Ψ + 16Ψ.
    `moments`: 1 for Muon's matrices (one momentum buffer: train/muon.py)."""
    low = compute_bytes < 4
    k = (4 + 4 * moments) if low else moments * compute_bytes
    params, grads, optim = compute_bytes * psi, (4 if low else compute_bytes) * psi, k * psi
    if stage >= 1:
        optim /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        params /= n
    return {"params": params, "grads": grads, "optimizer": optim}
