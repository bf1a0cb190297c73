"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine LR schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from ndtrain.config import TrainConfig


def decays(p: torch.Tensor) -> bool:
    """Matrices (linear weights, embeddings) decay; vectors (norm weights) do not."""
    return p.ndim >= 2


def param_groups(named_params, weight_decay: float) -> list[dict]:
    decay, no_decay, seen = [], [], set()
    for _, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if decays(p) else no_decay).append(p)
    return decay_groups(decay, no_decay, weight_decay)


def decay_groups(decay: list, no_decay: list, weight_decay: float) -> list[dict]:
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


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


def model_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
