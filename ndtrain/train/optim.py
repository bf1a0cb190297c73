"""AdamW on whatever the layout's states hand it, and the warmup + cosine LR schedule.
(Which parameters decay, and in which groups, is parallel/states.py's: ZeRO groups its flat
shards by the same rule.)"""

from __future__ import annotations

import math

import torch

from ndtrain.config import TrainConfig


def build_optimizer(groups: list[dict], t: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                             fused=fused or None, foreach=None if fused else True)


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup over `warmup` steps to `lr`, then cosine decay to `lr·min_lr_ratio`
    at the last step. `step` counts from 0."""
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    span = max(1, t.steps - 1 - t.warmup)
    progress = min(1.0, (step - t.warmup) / span)
    floor = t.lr * t.min_lr_ratio
    return floor + 0.5 * (t.lr - floor) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
