"""Dropout under sequence parallelism (parallel/tensor.py): each rank draws the whole
sequence's mask from the TP group's shared random stream and keeps its own positions."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ndtrain.mesh import Group


class SequenceShardedDropout(nn.Module):
    """Dropout on this rank's positions that equals dropout on the whole sequence.

    The ranks of a TP group share one random stream, the one a single device would use.
    Each draws the mask of the full [b, s, h] tensor from it, exactly as `F.dropout` on the
    full tensor would, and keeps its own positions: t× the random numbers, the same result.
    """

    def __init__(self, p: float, group: Group):
        super().__init__()
        self.p, self.group = p, group

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        s = x.shape[1]
        full = x.new_ones((x.shape[0], s * self.group.size, *x.shape[2:]))
        mask = F.dropout(full, self.p)  # the draws (and the 1/(1−p) scaling) of F.dropout
        return x * mask.narrow(1, self.group.rank * s, s)
