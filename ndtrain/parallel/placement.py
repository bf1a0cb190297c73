"""Sharding metadata carried by each parameter (the nanotron idea), read by the global
gradient norm and by checkpoint resharding.

- `shard_dims(p)`: the mesh dimensions over which `p` holds only a slice of the full
  tensor (e.g. ("tp",) for a column-parallel weight, ("dp_shard",) for a ZeRO flat shard).
  Every dimension not listed holds a full replica. Pipeline stages hold disjoint
  parameters, so "pp" is implicitly a shard dimension of every parameter.
- `is_duplicate(p)`: a second copy that must not be counted twice, such as the output
  head that a tied embedding keeps on the last pipeline stage.
- `partial_dims(p)`: the mesh dimensions over which `p` is replicated but each rank's
  gradient is only part of the whole (a norm weight under sequence parallelism sees this
  rank's positions only). The step sums those gradients over the dimension once, after its
  last backward (`Parallelized.forward_backward`), instead of once per micro-batch.
- `region_of(p)`: where the local tensor sits in the whole one: the global shape and the
  offset of its first element along each dimension (a tensor-parallel chunk of rows starts
  at row r·n/t). A dimension that splits parameters marks them with `mark_region`; that is
  all checkpoints need to read and write any layout (checkpoint/layout.py).
- `OptimSlice`: what a tensor the optimizer updates holds of a parameter (the parameter
  itself, its fp32 master, or a ZeRO flat shard's part of it); `states.optim_slices()`
  lists them.
- `expert_slice(p)`: for the stacked weights of routed experts, which of the model's
  experts `p` holds along dim 0, (first, total); None for every other parameter. Expert
  states are reduced and sharded over the expert-data-parallel groups (mesh.py), and under
  expert parallelism `p` is sharded over "ep" (one of the EXPERT_DIMS of mesh.py) and
  marked with its region of the whole stack.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Where a parameter starts inside a flat buffer (DP buckets, ZeRO flats), and where each ZeRO
# slice starts: a multiple of 64 elements (128 bytes in bf16), as Megatron pads its buffers, so
# every parameter, gradient and slice view is aligned for vectorised kernels and the
# collectives' chunks. The gaps hold zeros and take no part in anything.
ALIGN = 64


def aligned(n: int, align: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `align`."""
    return -(-n // align) * align


def flat_layout(sizes: list[int], shards: int) -> tuple[list[int], int, int]:
    """Where parameters of `sizes` elements sit in one flat buffer split into `shards` slices:
    (each one's offset, the end of the last, the elements of one slice). Each parameter and
    each slice starts at a multiple of ALIGN."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(aligned(end))
        end = offsets[-1] + n
    return offsets, end, aligned(-(-end // shards))


_SHARD_ATTR = "_ndtrain_shard_dims"
_DUP_ATTR = "_ndtrain_duplicate"
_PARTIAL_ATTR = "_ndtrain_partial_dims"
_EXPERT_ATTR = "_ndtrain_experts"


def mark_sharded(p: torch.Tensor, dims: tuple[str, ...] | list[str]) -> torch.Tensor:
    setattr(p, _SHARD_ATTR, tuple(dims))
    return p


def shard_dims(p: torch.Tensor) -> tuple[str, ...]:
    return getattr(p, _SHARD_ATTR, ())


def mark_duplicate(p: torch.Tensor, duplicate: bool = True) -> torch.Tensor:
    setattr(p, _DUP_ATTR, duplicate)
    return p


def is_duplicate(p: torch.Tensor) -> bool:
    return getattr(p, _DUP_ATTR, False)


def mark_partial(p: torch.Tensor, dims: tuple[str, ...] | list[str]) -> torch.Tensor:
    setattr(p, _PARTIAL_ATTR, tuple(dims))
    return p


def partial_dims(p: torch.Tensor) -> tuple[str, ...]:
    return getattr(p, _PARTIAL_ATTR, ())


_REGION_ATTR = "_ndtrain_region"


@dataclass(frozen=True)
class Region:
    """The local tensor is the box of the global tensor (`shape`) that starts at `offsets`
    and has the local tensor's shape. It may reach past `shape` (tensor-parallel padding):
    only the overlap holds values."""

    shape: tuple[int, ...]
    offsets: tuple[int, ...]


def mark_region(p: torch.Tensor, shape, offsets) -> torch.Tensor:
    setattr(p, _REGION_ATTR, Region(tuple(shape), tuple(offsets)))
    return p


def region_of(p: torch.Tensor) -> Region:
    """The global tensor `p` is part of; a parameter no dimension split is its own whole."""
    return getattr(p, _REGION_ATTR, None) or Region(tuple(p.shape), (0,) * p.ndim)


@dataclass
class OptimSlice:
    """`holder.view(-1)[at : at + stop - start]` holds elements [start, stop) of the
    flattened local parameter `param` (named `name`, a global name)."""

    name: str
    param: torch.Tensor
    holder: torch.Tensor
    at: int
    start: int
    stop: int


def mark_expert(p: torch.Tensor, first: int, total: int) -> torch.Tensor:
    setattr(p, _EXPERT_ATTR, (first, total))
    return p


def expert_slice(p: torch.Tensor) -> tuple[int, int] | None:
    return getattr(p, _EXPERT_ATTR, None)


def is_expert(p: torch.Tensor) -> bool:
    return expert_slice(p) is not None


def copy_placement(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """`dst` (a master copy, a replacement) placed like `src`."""
    for attr in (_SHARD_ATTR, _DUP_ATTR, _PARTIAL_ATTR, _EXPERT_ATTR, _REGION_ATTR):
        if hasattr(src, attr):
            setattr(dst, attr, getattr(src, attr))
    return dst
