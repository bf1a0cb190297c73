"""Tensor parallelism for OLMo 2's q/k norms (parallel/tensor.py's PLAN calls this).

A norm over all heads of q (or of k) together (`model.qk_norm_all`): each rank holds its
heads' columns of the projection, so the sum of squares is completed over tp, one
all-reduce of [b, s, 1] per norm forward and one backward, and the weight is split with
the heads: `WholeWidthNorm`. The K/V heads must be split too (n_kv_heads divisible by tp),
since a rank with replicated K/V computes only the head it reads (config.validate refuses
the rest). (OLMo 2's other difference, no norm before attention or the MLP, is
tensor.RegionEntry: the region entered without one.)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ndtrain.comm import ops
from ndtrain.mesh import Group
from ndtrain.model.dtypes import widened


class _SumOverTP(torch.autograd.Function):
    """Σ over the tp ranks, which every rank then uses: all-reduce forward and backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        out = x.clone()
        ops.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone()
        ops.all_reduce(grad, ctx.group)
        return grad, None


class WholeWidthNorm(nn.Module):
    """RMSNorm over the whole width `full` of a projection split by columns over tp: this
    rank's columns x [..., full/t] and weight [full/t]."""

    def __init__(self, weight: nn.Parameter, eps: float, full: int, group: Group):
        super().__init__()
        self.weight, self.eps, self.full, self.group = weight, eps, full, group

    def forward(self, x: Tensor) -> Tensor:
        x32 = widened(x)
        squares = _SumOverTP.apply(x32.pow(2).sum(-1, keepdim=True), self.group)
        return self.weight * (x32 * torch.rsqrt(squares / self.full + self.eps)).to(x.dtype)
