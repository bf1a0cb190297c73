"""AdamW (or Muon with AdamW: train/muon.py) on whatever the layout's states hand it, and the learning-rate schedules (`train.schedule`).
(Which parameters decay, and in which groups, is parallel/states.py's: ZeRO groups its flat
shards by the same rule.)"""

from __future__ import annotations

import math

import torch

from ndtrain.config import TrainConfig


def build_optimizer(groups: list[dict], t: TrainConfig, device: torch.device, muon: tuple | None = None,
                    ) -> torch.optim.Optimizer:
    """AdamW on `groups`; under train.optimizer = muon, AdamW on the groups not marked "muon"
    and Muon on those (train/muon.py), given `muon` = (the states' optim_slices, the stage
    group, the Newton–Schulz dtype)."""
    fused = device.type == "cuda"
    rest = [g for g in groups if not g.get("muon")]
    adamw = torch.optim.AdamW(rest, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                              fused=fused or None, foreach=None if fused else True) if rest else None
    if t.optimizer != "muon":
        return adamw
    from ndtrain.train.muon import MuonAdamW
    slices, group, ns_dtype = muon
    return MuonAdamW(groups, adamw, t, slices, group, ns_dtype)


def lr_at(step: int, t: TrainConfig) -> float:
    """The learning rate of step `step` (counting from 0) under `train.schedule`.

    Every schedule warms up linearly over `warmup` steps to `lr` (step 0 gets lr/warmup),
    then, with `floor = lr·min_lr_ratio` reached at the last step:
    cosine: half a cosine from lr down to floor;
    linear: a straight line from lr down to floor;
    constant: lr to the end (min_lr_ratio unused);
    wsd (warmup-stable-decay): lr until the last `decay_fraction` of the steps, then a
    straight line down to floor over them. A run stopped before the decay (a stable-phase
    checkpoint) can be continued or decayed later, which is what WSD is for."""
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    floor = t.lr * t.min_lr_ratio
    last = t.steps - 1
    if t.schedule == "constant":
        return t.lr
    if t.schedule == "wsd":
        decay = max(1, round(t.decay_fraction * t.steps))
        start = max(t.warmup, t.steps - decay)  # the first step below lr; the last step reaches floor
        if step < start:
            return t.lr
        progress = min(1.0, (step - start + 1) / max(1, last - start + 1))
        return t.lr + (floor - t.lr) * progress
    progress = min(1.0, (step - t.warmup) / max(1, last - t.warmup))
    if t.schedule == "linear":
        return t.lr + (floor - t.lr) * progress
    return floor + 0.5 * (t.lr - floor) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
