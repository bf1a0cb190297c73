"""The single-stage schedule: forward and backward of each micro-batch in turn.

A schedule owns the loss of its micro-batches (each divided by the global target count)
and tells the gradient synchroniser which backward is the last, so only that one
communicates. Pipeline schedules (`ndtrain.parallel.pipeline`) keep the same interface.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn

from ndtrain.data.batch import MicroBatch


class GradSync(Protocol):
    def set_sync(self, enabled: bool) -> None: ...
    def finish(self) -> None: ...
    def zero_grad(self) -> None: ...


def forward_loss(model: nn.Module, mb: MicroBatch, loss_fn: Callable) -> torch.Tensor:
    """The sum of the micro-batch's token losses (weighted, where it has weights)."""
    logits = model(mb.tokens, positions=mb.positions, doc_ids=mb.doc_ids)
    return loss_fn(logits, mb.targets, mb.weights)


class SingleStage:
    def __init__(self, model: nn.Module, loss_fn: Callable):
        self.model, self.loss_fn = model, loss_fn

    def run(self, micro_batches: list[MicroBatch], n_targets: float, grad_sync: GradSync) -> torch.Tensor:
        """Forward and backward every micro-batch; returns this rank's share of the loss."""
        total = torch.zeros((), dtype=torch.float64, device=micro_batches[0].tokens.device)
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            grad_sync.set_sync(i == last)
            loss = forward_loss(self.model, mb, self.loss_fn) / n_targets
            loss.backward()
            total += loss.detach()
        grad_sync.finish()
        return total

    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Sum of token losses over the micro-batches (no division), forward only."""
        total = torch.zeros((), dtype=torch.float64, device=micro_batches[0].tokens.device)
        for mb in micro_batches:
            total += forward_loss(self.model, mb, self.loss_fn).double()
        return total
