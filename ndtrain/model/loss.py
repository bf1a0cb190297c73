"""The loss of a step: a sum over target tokens, divided by the step's global target count.

Every micro-batch of every rank divides its *sum* by the same global count, the number of
targets (positions whose target is not IGNORE) in the whole global batch, across
micro-batches, data-parallel and context-parallel ranks. Summing those gradients over the
ranks then gives exactly the single-device gradient of the mean loss, whatever the layout,
and the same rule covers pretraining, SFT masks (IGNORE on prompt tokens) and RL, whose
per-token `weights` (an advantage) multiply each token's loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ndtrain.model.llama import widened

IGNORE = -100


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of next-token cross-entropies (times `weights`, if given) over the targets that
    are not IGNORE, in fp32 (fp64 for fp64 logits)."""
    logits, targets = widened(logits.flatten(0, -2)), targets.flatten()
    if weights is None:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    losses = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none")
    return (losses * weights.flatten().to(losses.dtype)).sum()


def count_targets(targets: torch.Tensor) -> int:
    return int((targets != IGNORE).sum())
