"""What a task hands the trainer: micro-batches of tokens with their targets, and what
attention and the loss need to know about them.

Pretraining fills only tokens and targets. SFT packs several examples into a row: positions
restart at each example, doc_ids keep attention inside it, and prompt tokens have target
IGNORE. RL adds per-token weights (its loss normalisation), the advantage of each sampled
token and the log-probabilities recorded before the update (of the policy that sampled, and
of a frozen reference), which its objective reads (train/rl/losses.py). Context parallelism
permutes every field the same way. The trainer, the schedules and the parallel modules
never branch on the task.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

IGNORE = -100  # the target of a position that takes no loss (cross_entropy's ignore_index)


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """A host tensor on `device` without the host waiting for the device: on CUDA through
    pinned memory and a non-blocking copy (a copy from pageable memory synchronises)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class MicroBatch:
    tokens: Tensor  # [b, s] input ids
    targets: Tensor  # [b, s] next-token ids, IGNORE where no loss is taken
    positions: Tensor | None = None  # [b, s] RoPE positions; None = 0..s-1 in every row
    doc_ids: Tensor | None = None  # [b, s] document of each token; None = one per row
    weights: Tensor | None = None  # [b, s] per-token loss weights; None = 1
    advantages: Tensor | None = None  # [b, s] RL: the advantage of each sampled token
    old_logprobs: Tensor | None = None  # [b, s] RL: log p(target) under the policy before the update
    ref_logprobs: Tensor | None = None  # [b, s] RL: log p(target) under the frozen reference
    is_weights: Tensor | None = None  # [b, s] RL, stale rollouts: each token's importance weight π_old / π_behaviour
    # [b, s, D] multi-token prediction under context parallelism (model/mtp.lookahead): module
    # d's input token and target at each position, from the whole rows before the permutation
    mtp_tokens: Tensor | None = None
    mtp_targets: Tensor | None = None

    def to(self, device: torch.device | str) -> "MicroBatch":
        return replace(self, **{f.name: to_device(getattr(self, f.name), device) for f in fields(self)
                                if getattr(self, f.name) is not None})

    def rows(self, start: int, stop: int) -> "MicroBatch":
        return replace(self, **{f.name: getattr(self, f.name)[start:stop] for f in fields(self)
                                if getattr(self, f.name) is not None})

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def split(self, rows: int) -> list["MicroBatch"]:
        """Consecutive micro-batches of `rows` rows each."""
        return [self.rows(i, i + rows) for i in range(0, self.size, rows)]
