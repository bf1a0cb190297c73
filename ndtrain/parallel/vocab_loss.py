"""The loss of a tensor-parallel model from its vocabulary-split logits (parallel/tensor.py
splits the head by vocabulary rows): each position's cross-entropy without ever holding the
full [b, s, vocab] logits on one rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ndtrain.comm import ops
from ndtrain.mesh import Group
from ndtrain.model.dtypes import widened
from ndtrain.model.loss import IGNORE

class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of targets [n] from logits [n, V/t] split over the vocabulary.

    Forward: the max over the vocabulary (all-reduce MAX of n numbers), then the sum of
    exponentials and the target's logit (one all-reduce of 2n numbers): loss = log Σ exp −
    target logit, shifted by the max. No rank ever holds more than its V/t columns.
    Backward: no communication: the gradient of this rank's logits is softmax − one-hot on
    its own columns.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, group: Group) -> Tensor:
        n_local, dtype = logits.shape[-1], logits.dtype
        logits = widened(logits)
        top = logits.max(dim=-1).values
        ops.all_reduce(top, group, op=dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        local = targets - group.rank * n_local
        mine = (local >= 0) & (local < n_local)  # IGNORE (negative) is never anyone's
        local = local.masked_fill(~mine, 0)
        # where, not × mine: a shard of padding only gathers −inf, and −inf × 0 is NaN
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp_()
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        ops.all_reduce(sums, group)
        valid = targets != IGNORE
        loss = (sums[0].log() - sums[1]) * valid
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local, mine, valid)
        ctx.dtype = dtype
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        softmax, local, mine, valid = ctx.saved_tensors
        g = grad * valid
        out = softmax.mul_(g.unsqueeze(-1))  # saved tensors are not used again
        out.scatter_add_(-1, local.unsqueeze(-1), -(g * mine).unsqueeze(-1))
        return out.to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, group: Group) -> Tensor:
    return VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), group)


@dataclass
class VocabParallelNLL:
    """The layout's half of the loss under TP (model/loss.TokenLoss): each position's
    cross-entropy [b·s], from this rank's logit columns. The same values on every rank of
    the group."""

    group: Group

    def __call__(self, logits: Tensor, targets: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.group)
