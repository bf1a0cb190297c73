"""The loss of a step: a sum over target tokens, divided by the step's global target count.

Every micro-batch of every rank divides its *sum* by the same global count, the number of
targets (positions whose target is not IGNORE) in the whole global batch, across
micro-batches, data-parallel and context-parallel ranks. Summing those gradients over the
ranks then gives exactly the single-device gradient of the mean loss, whatever the layout,
and the same rule covers pretraining, SFT masks (IGNORE on prompt tokens) and RL, whose
per-token `weights` (a normalisation, an advantage) multiply each token's loss.

A loss has two halves with two owners (`TokenLoss`):
- the *layout* computes each token's negative log-likelihood from the logits it holds
  (`token_nll` here; tensor parallelism swaps in a vocabulary-parallel one);
- the *task* turns those into the micro-batch's loss sum (its *objective*): the weighted
  sum `weighted_sum` for pretraining and SFT; RL's policy-gradient objectives read the
  micro-batch's advantages and recorded log-probabilities too (train/rl/losses.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ndtrain.data.batch import IGNORE, MicroBatch
from ndtrain.model.llama import widened


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's next-token cross-entropy [b·s] (0 where the target is IGNORE), in
    fp32 (fp64 for fp64 logits)."""
    return F.cross_entropy(widened(logits.flatten(0, -2)), targets.flatten(), ignore_index=IGNORE, reduction="none")


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of next-token cross-entropies (times `weights`, if given) over the targets that
    are not IGNORE, in fp32 (fp64 for fp64 logits)."""
    logits, targets = widened(logits.flatten(0, -2)), targets.flatten()
    if weights is None:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    losses = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none")
    return (losses * weights.flatten().to(losses.dtype)).sum()


def weighted_sum(nll: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """The objective of pretraining and SFT: Σ nll (times the micro-batch's weights, if any)."""
    return nll.sum() if mb.weights is None else (nll * mb.weights.flatten().to(nll.dtype)).sum()


@dataclass
class TokenLoss:
    """The schedule's loss: `objective(nll(logits, targets), micro_batch)`, a sum."""

    nll: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_nll
    objective: Callable[[torch.Tensor, MicroBatch], torch.Tensor] = weighted_sum

    def __call__(self, logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return self.objective(self.nll(logits, mb.targets), mb)

    def logprobs(self, logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """log p(target) at every position [b, s] (0 where the target is IGNORE)."""
        return -self.nll(logits, mb.targets).view(mb.targets.shape)


def count_targets(targets: torch.Tensor) -> int:
    return int((targets != IGNORE).sum())
