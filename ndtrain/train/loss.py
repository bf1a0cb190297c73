"""The loss of a step: a sum over target tokens, divided by the step's global target count.

Every micro-batch of every rank divides its *sum* by the same global count, the number of
targets (positions whose target is not IGNORE) in the whole global batch, across
micro-batches, data-parallel and context-parallel ranks. Summing those gradients over the
ranks then gives exactly the single-device gradient of the mean loss, whatever the layout,
and the same rule covers pretraining, SFT masks (IGNORE on prompt tokens) and RL weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the targets that are not IGNORE, in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(),
                           ignore_index=IGNORE, reduction="sum")


def count_targets(targets: torch.Tensor) -> int:
    return int((targets != IGNORE).sum())
