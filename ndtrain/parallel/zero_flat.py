"""ZeRO's flat buffers and units (parallel/zero.py shards, reduces and gathers them).

A `FlatParam` packs the parameters of one unit that share placement, weight-decay group and
dtype into one buffer padded to a multiple of the shard group, and holds this rank's slice,
its fp32 master and the gradient accumulators. A `Unit` is a decoder block, or a decoder's
root: what stage 3 gathers and frees together. `decoder_units` finds them in a model and
`link_units` orders them for prefetching and for the reduce-scatters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ndtrain.kernels.fp8 import E4M3
from ndtrain.mesh import Group
from ndtrain.parallel.construct import new_parameter
from ndtrain.parallel.placement import copy_placement, flat_layout, mark_sharded, shard_dims
from ndtrain.parallel.precision import has_masters
from ndtrain.parallel.states import decays

SHARD_DIMS = ("dp_shard", "cp")

def free_storage(t: torch.Tensor) -> int:
    """Release the memory behind `t` (and every view of it); returns the bytes freed."""
    n = t.untyped_storage().nbytes()
    t.untyped_storage().resize_(0)
    return n


def allocate_storage(t: torch.Tensor) -> int:
    """Give `t`'s storage its memory back (contents undefined); returns the bytes allocated."""
    n = t.numel() * t.element_size()
    t.untyped_storage().resize_(n)
    return n


class FlatParam:
    """Parameters of one unit with the same placement, decay group and dtype, in one buffer.

    full: the whole buffer in the compute dtype, every parameter a view into it (stage 3:
      its memory exists only while the unit is gathered).
    shard: this rank's slice of `full` (stage 3: a tensor of its own, always there).
    master: the fp32 slice the optimizer updates (`shard` itself when computing in fp32).
    grad_full: the full local gradient, accumulated in `accum_dtype` (the compute dtype, or
      fp32 under bf16/fp16). Stage 1: persistent; in the compute dtype it is the storage
      behind every param.grad (autograd accumulates in place), else each micro-batch's
      gradient is added into it and dropped. Stages 2-3: lives from the first gradient of a
      backward pass to its reduce-scatter (under a pipeline, `defer`: of the step's first
      backward pass to the chunk's last).
    grad_shard: this rank's slice of the summed gradient, in accum_dtype (the master's
      gradient); stage 1, a view into grad_full; stages 2-3, allocated by the step's first
      reduction, freed by zero_grad.
    frozen: parameters that do not train (a LoRA run's base weights): `full` and `shard` as
      above (stage 3 gathers and frees them with their unit), and nothing else: no master,
      no gradient accumulator, no reduction.
    """

    def __init__(self, name: str, params: list[nn.Parameter], stage: int, group: Group,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype, init: Callable, device: torch.device,
                 group_dims: tuple[str, ...] = SHARD_DIMS, fp8: bool = False):
        """`params` may live on the meta device (parallel/construct.py): only this rank's
        slice is allocated and filled with `init(p)`, the fp32 initial value of what p holds
        (stages 1-2 also the whole buffer, which every rank keeps); `adopt` then swaps in
        the parameters that view the buffer."""
        self.name, self.params, self.stage, self.group = name, params, stage, group
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self.accum_dtype = torch.float32 if has_masters(compute_dtype) else compute_dtype
        self.decays = decays(params[0])
        self.muon = False  # Muon's matrices (ZeRO sets it: train.optimizer = muon)
        self.slot: dict[int, tuple[int, int]] = {}  # id(param) -> (offset, numel) in `full`
        # Each parameter and each slice starts aligned (placement.ALIGN); the gaps hold zeros.
        offsets, self.numel, self.shard_numel = flat_layout([p.numel() for p in params], group.size)
        for p, offset in zip(params, offsets):
            self.slot[id(p)] = (offset, p.numel())
        lo, hi = group.rank * self.shard_numel, (group.rank + 1) * self.shard_numel

        padded = self.shard_numel * group.size
        # fp8 (stage 3, parallel/fp8_gather.py): `full` is gathered in fp8 from `shard_fp8`; the
        # parameters are views of a compute-dtype buffer that never gets memory.
        self.fp8 = fp8 and stage == 3
        if stage == 3:
            initial = self._initial(init, lo, hi, device)
            self.full = torch.empty(padded, dtype=compute_dtype, device=device)
            self.shard = initial.to(compute_dtype)  # no copy in fp32
        else:
            initial = self._initial(init, 0, padded, device)
            self.full = initial.to(compute_dtype)  # no copy in fp32
            self.shard = self.full[lo:hi]
            initial = initial[lo:hi]
        # The parameters become views into `full` (new objects: parallel/construct.py); under
        # stage 3 its memory then goes, and comes back only while the unit is gathered.
        self.replacements = {id(p): new_parameter(p, self.view_of(self.full, p)) for p in params}
        if stage == 3:
            free_storage(self.full)
        if self.fp8:
            self.full = torch.empty(padded, dtype=E4M3, device=device)
            self.shard_fp8 = torch.zeros(self.shard_numel, dtype=E4M3, device=device)
            self.fp8_views = [self.view_of(self.full, p) for p in params]  # made while it has memory
            free_storage(self.full)
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.ready = 0  # parameters whose gradient arrived in this backward pass
        self.pending: tuple | None = None  # (work, output, input) of a reduce-scatter in flight
        self.frozen = not params[0].requires_grad
        if self.frozen:  # no master, no gradient: only this rank's slice, marked as a master would be
            self.master = None
            copy_placement(params[0], self.shard)
            mark_sharded(self.shard, shard_dims(params[0]) + group_dims)
            return
        # A separate master starts from the fp32 initial values, not from their rounding.
        master = initial if stage == 3 else initial.clone()
        self.master = nn.Parameter(master if has_masters(compute_dtype) else self.shard)
        copy_placement(params[0], self.master)
        mark_sharded(self.master, shard_dims(params[0]) + group_dims)
        if stage == 1:
            self.grad_full = self._zeros(self.full.numel())
            self.grad_shard = self.grad_full[lo:hi]

    @torch.no_grad()
    def _initial(self, init: Callable, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """Elements [lo, hi) of the flat buffer's fp32 initial values, one parameter's
        initial value at a time (padding: zeros)."""
        values = torch.zeros(hi - lo, dtype=torch.float32, device=device)
        for p in self.params:
            start, n = self.slot[id(p)]
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                values[a - lo:b - lo].copy_(init(p, a - start, b - start))
        return values

    def adopt(self) -> None:
        """Hold the parameters that replaced the meta ones; in the compute dtype, stage 1's
        param.grad are views into its accumulator."""
        self.params = [self.replacements[id(p)] for p in self.params]
        self.slot = {id(q): self.slot[old] for q, old in zip(self.params, list(self.slot))}
        del self.replacements
        if self.stage == 1 and self.accum_dtype == self.compute_dtype and not self.frozen:
            for p in self.params:
                p.grad = self.view_of(self.grad_full, p)

    def range(self, p: nn.Parameter) -> slice:
        start, n = self.slot[id(p)]
        return slice(start, start + n)

    def view_of(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        return flat[self.range(p)].view(p.shape)

    @property
    def separate_master(self) -> bool:
        return self.master.untyped_storage().data_ptr() != self.shard.untyped_storage().data_ptr()

    @property
    def complete(self) -> bool:
        return self.ready == len(self.params)

    def _zeros(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=self.accum_dtype, device=self.shard.device)

    @torch.no_grad()
    def take_grad(self, p: nn.Parameter) -> None:
        """Add a fresh gradient from param.grad into the accumulator, and drop it (unless
        param.grad is the accumulator's own view: stage 1 in the compute dtype)."""
        if self.stage == 1 and self.accum_dtype == self.compute_dtype:
            return  # param.grad is a view into grad_full: autograd accumulated in place
        if self.grad_full is None:
            self.grad_full = self._zeros(self.full.numel())
        self.view_of(self.grad_full, p).add_(p.grad)
        p.grad = None

    def reduce_input(self) -> torch.Tensor:
        """The full local gradient, in reduce_dtype, to reduce-scatter (stages 2-3 hand
        their accumulator over)."""
        if self.grad_full is None:  # no gradient arrived on this rank: contribute zeros
            self.grad_full = self._zeros(self.full.numel())
        g = self.grad_full
        if self.stage >= 2:
            self.grad_full = None
        return g if g.dtype == self.reduce_dtype else g.to(self.reduce_dtype)

    def accumulate(self, reduced: torch.Tensor) -> None:
        """Keep this rank's slice of a reduced gradient (stage 1: the step's only one), in
        accum_dtype."""
        if self.stage == 1:
            self.grad_shard.copy_(reduced)
        elif self.grad_shard is None:
            self.grad_shard = reduced.to(self.accum_dtype)  # no copy when the dtypes agree
        else:
            self.grad_shard.add_(reduced)


@dataclass
class Unit:
    """A block, or a decoder's root; stage 3 gathers and frees its flat buffers together."""

    name: str
    module: nn.Module
    flats: list[FlatParam]
    next: "Unit | None" = None  # the unit whose forward follows (prefetched in forward)
    prev: "Unit | None" = None  # the unit whose backward follows (prefetched in backward)
    state: str = "sharded"  # sharded | gathering | gathered
    works: list = field(default_factory=list)


def decoder_units(model: nn.Module, decoders: dict[str, nn.Module] | None = None,
                  ) -> list[list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]]:
    """The units of every decoder found in `model`, or of the `decoders` given by name (a
    pipeline stage's chunks: the modules its schedule actually calls, whose parameters
    `model` names): [(name, module, [(param name, param)])], the root first, then the
    blocks in order. A tied parameter belongs to the first unit that holds it; a unit
    without parameters is left out; parameters outside any decoder form a last unit, "rest"."""
    named = {id(p): n for n, p in model.named_parameters()}  # a tied parameter: first name
    claimed: set[int] = set()

    def claim(params):
        out = []
        for p in params:
            if id(p) not in claimed:
                claimed.add(id(p))
                out.append((named[id(p)], p))
        return out

    if decoders is None:
        decoders = {name: module for name, module in model.named_modules()
                    if isinstance(getattr(module, "layers", None), nn.ModuleDict)}
    found = []
    for name, module in decoders.items():
        prefix = f"{name}." if name else ""
        in_blocks = {id(p) for p in module.layers.parameters()}
        units = [(f"{prefix}root", module, claim(p for p in module.parameters() if id(p) not in in_blocks))]
        units += [(f"{prefix}layers.{key}", block, claim(block.parameters())) for key, block in module.layers.items()]
        found.append([u for u in units if u[2]])
    rest = claim(model.parameters())
    if rest:
        found.append([("rest", model, rest)])
    return [d for d in found if d]


def link_units(units: list[Unit]) -> list[Unit]:
    """Set each unit's prefetch neighbours; return the units in the order their gradients
    complete. Forward runs the root, block 0, block 1, ...; backward starts at the root's
    head, then runs the last block to the first, and the root's embedding gradient is the
    last of all."""
    for a, b in zip(units, units[1:]):
        a.next = b
    has_root = units[0].name.endswith("root")
    blocks = units[1:] if has_root else units
    for a, b in zip(blocks, blocks[1:]):
        b.prev = a
    if has_root and blocks:
        units[0].prev = blocks[-1]
    return list(reversed(blocks)) + (units[:1] if has_root else [])
