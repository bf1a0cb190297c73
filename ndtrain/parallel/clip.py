"""Gradient clipping by the global norm, correct for any sharding of the parameters.

The squared norm is a sum over the *unique* elements of the full model. A parameter sharded
over some mesh dimensions holds a distinct slice on each rank of those dimensions, so its
local sum of squares must be summed over them; a replicated dimension holds equal copies,
which must be counted once. We therefore keep one partial sum per set of shard dimensions
(a bitmask over the mesh dimensions) and, for each live dimension in a fixed order, sum over
that dimension only the partial sums whose set contains it. Pipeline stages hold disjoint
parameters, so every set contains "pp"; duplicates (a tied head on the last stage) are
skipped. Routed experts add the two factors of dp_shard × cp that expert parallelism uses
(mesh.EXPERT_DIMS): "ep" (different experts) and "edp_shard" (ZeRO slices of the same
experts), so each expert is counted once, whatever holds copies of it. Without expert
parallelism they are not in use, and the vector of partial sums stays 2^5 long.
"""

from __future__ import annotations

import torch

from ndtrain.comm import ops
from ndtrain.mesh import DIMS, EXPERT_DIMS, ParallelMesh
from ndtrain.parallel.placement import is_duplicate, shard_dims


def grad_norm(params, mesh: ParallelMesh) -> torch.Tensor:
    """The global L2 norm of the gradients of `params` (this rank's local tensors)."""
    device = mesh.device
    dims = DIMS + (EXPERT_DIMS if mesh.shape.ep > 1 else ())  # no expert dims in use without EP
    partial = torch.zeros(2 ** len(dims), dtype=torch.float64, device=device)
    by_mask: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if is_duplicate(p):
            continue
        # Every parameter names its mask, with a gradient or not: which groups reduce below
        # must follow from the layout alone, never from which gradients a rank happens to hold.
        held = set(shard_dims(p)) | {"pp"}
        mask = sum(1 << i for i, d in enumerate(dims) if d in held)
        grads = by_mask.setdefault(mask, [])
        if p.grad is not None:
            grads.append(p.grad)
    for mask, grads in by_mask.items():
        if grads:
            norms = torch._foreach_norm(grads, 2.0)
            partial[mask] = torch.stack(norms).double().pow(2).sum()
    present = 0
    for mask in by_mask:
        present |= mask
    for i, d in enumerate(dims):
        group = mesh.group(d)
        # Every rank of a group must agree on whether it reduces; they do, because the masks
        # come from the parameters' placement, and the parameters sharded over a dimension
        # exist on every rank of that dimension.
        if not group.active or not (present >> i) & 1:
            continue
        has_dim = (torch.arange(partial.numel(), device=device) >> i) & 1 == 1  # made on the device: no copy
        summed = partial * has_dim
        ops.all_reduce(summed, group)
        partial = torch.where(has_dim, summed, partial)
    return partial.sum().sqrt()


def clip_grad_norm_(params, max_norm: float, mesh: ParallelMesh) -> torch.Tensor:
    """Scale gradients so the global norm is at most `max_norm` (0 = measure only); returns
    the norm before clipping, on the device (reading it is the caller's host sync)."""
    params = list(params)
    total = grad_norm(params, mesh)
    grads = list({id(p): p.grad for p in params if p.grad is not None}.values())
    if max_norm > 0 and grads:
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))
    return total
