"""The single-stage schedule: forward and backward of each micro-batch in turn.

A schedule owns the loss of its micro-batches (each divided by the global target count)
and tells the gradient synchroniser which backward is the last, so only that one
communicates. Pipeline schedules (`ndtrain.parallel.pipeline`) keep the same interface.

The objective may hold more than the token loss: a model can report loss terms of its own
during a forward (the MoE load-balancing loss, model/moe.py) into the step's `RoutingLog`.
Every schedule takes them after each forward (`routing.take_loss()`), in the same
sum-over-tokens units, and differentiates (token loss + them) / global target count,
without knowing what produced them. The loss it returns (and the trainer reports) is the
token loss alone.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn

from ndtrain.data.batch import MicroBatch
from ndtrain.kernels.fp8_linear import set_micro
from ndtrain.model.moe import RoutingLog


class GradSync(Protocol):
    def set_sync(self, enabled: bool) -> None: ...
    def finish(self) -> None: ...
    def zero_grad(self) -> None: ...


def forward_loss(model: nn.Module, mb: MicroBatch, loss_fn: Callable,
                 routing: RoutingLog | None = None) -> torch.Tensor:
    """The sum of the micro-batch's token losses (weighted, where it has weights)."""
    out = model(mb.tokens, positions=mb.positions, doc_ids=mb.doc_ids, routing=routing, **loss_fn.model_kwargs(mb))
    return loss_fn(out, mb)


def with_model_loss(loss: torch.Tensor, routing: RoutingLog | None) -> torch.Tensor:
    """The token-loss sum plus the loss terms the model reported in this forward."""
    extra = routing.take_loss() if routing is not None else None
    return loss if extra is None else loss + extra


class _CarryLoss(torch.autograd.Function):
    """Forward: x. Backward: x's gradient, and 1 for `loss`, so a backward from x also
    differentiates `loss` as a term of the objective."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device)


def carry_loss(x: torch.Tensor, routing: RoutingLog | None, n_targets: float) -> torch.Tensor:
    """x (a pipeline chunk's output), carrying the loss terms the model reported in this
    forward (divided by the global target count) into its backward."""
    extra = routing.take_loss() if routing is not None else None
    return x if extra is None else _CarryLoss.apply(x, extra / n_targets)


class SingleStage:
    def __init__(self, model: nn.Module, loss_fn: Callable):
        self.model, self.loss_fn = model, loss_fn

    def run(self, micro_batches: list[MicroBatch], n_targets: float, grad_sync: GradSync,
            routing: RoutingLog | None = None) -> torch.Tensor:
        """Forward and backward every micro-batch; returns this rank's share of the token
        loss. `routing`: the step's log, handed to the model (see module docstring)."""
        total = torch.zeros((), dtype=torch.float64, device=micro_batches[0].tokens.device)
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            grad_sync.set_sync(i == last)
            if routing is not None and routing.mtp is not None:  # multi-token prediction reads the batch
                routing.mtp.batch = mb
            set_micro(self.model, i)
            loss = forward_loss(self.model, mb, self.loss_fn, routing)
            (with_model_loss(loss, routing) / n_targets).backward()
            total += loss.detach() / n_targets
        grad_sync.finish()
        return total

    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Sum of token losses over the micro-batches (no division), forward only."""
        total = torch.zeros((), dtype=torch.float64, device=micro_batches[0].tokens.device)
        for mb in micro_batches:
            total += forward_loss(self.model, mb, self.loss_fn).double()
        return total

    @torch.no_grad()
    def logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """log p(target) [b, s] of every micro-batch, forward only."""
        return [self.loss_fn.logprobs(self.model(mb.tokens, positions=mb.positions, doc_ids=mb.doc_ids,
                                                 **self.loss_fn.model_kwargs(mb)), mb) for mb in micro_batches]
