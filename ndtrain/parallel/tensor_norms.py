"""Tensor parallelism for OLMo 2's block (parallel/tensor.py's PLAN calls these).

- No norm before attention or the MLP (`model.pre_norm = false`): the entry into each TP
  region (f, or the SP all-gather) is then a module of its own, `RegionEntry`.
- q/k norms over all heads together (`model.qk_norm_all`): each rank holds its heads' part
  of the projection, so the mean of squares is completed over tp, one all-reduce of
  [b, s, 1] per norm (its backward one more), and the weight is split with the heads:
  `WholeWidthNorm`. The K/V heads must be split too (n_kv_heads divisible by tp), since a
  rank with replicated K/V computes only the head it reads (config.validate refuses the rest).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ndtrain.mesh import Group
from ndtrain.model.dtypes import widened
from ndtrain.parallel.tensor import CopyToTP, ReduceFromTP, enter_region


class RegionEntry(nn.Module):
    """The entry into a TP region where no norm stands in front of it."""

    def __init__(self, group: Group, sp: bool):
        super().__init__()
        self.group, self.sp = group, sp

    def forward(self, x: Tensor) -> Tensor:
        return enter_region(x, self.group, self.sp)


class WholeWidthNorm(nn.Module):
    """RMSNorm over the whole width `full` of a projection split by columns over tp: this
    rank's columns x [..., full/t] and weight [full/t]; Σx² all-reduced (forward; its
    gradient all-reduced backward)."""

    def __init__(self, weight: nn.Parameter, eps: float, full: int, group: Group):
        super().__init__()
        self.weight, self.eps, self.full, self.group = weight, eps, full, group

    def forward(self, x: Tensor) -> Tensor:
        x32 = widened(x)
        squares = CopyToTP.apply(ReduceFromTP.apply(x32.pow(2).sum(-1, keepdim=True), self.group), self.group)
        return self.weight * (x32 * torch.rsqrt(squares / self.full + self.eps)).to(x.dtype)
