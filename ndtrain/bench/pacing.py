"""Paced blocks: each decoder block costs a fixed, known time in F, B and W.

A bubble theory assumes ranks that compute independently. On a machine whose cores slow
each other down (a small VM, hyperthreads), an idle rank speeds up its neighbour and the
measured bubble reads high for reasons that have nothing to do with the schedule. Pacing
replaces that uncertainty with sleeps: the real executor, messages and B/W split run
unchanged, but each block's forward, input-gradient and weight-gradient work take exactly
`f`, `b` and `w` seconds without occupying a core. What remains of the bubble is the
schedule's dependency structure plus our executor's own overhead, which is what the theory
describes.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ndtrain.model.llama import Block


class _DelayBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the input-gradient (B) cost of a block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


def pace(model: nn.Module, f: float, b: float, w: float) -> list:
    """Give every Block in `model` the costs f (forward), b (input gradient), w (weight
    gradient, charged when its first weight's gradient is accumulated). Returns the hooks."""
    handles = []
    for block in model.modules():
        if not isinstance(block, Block):
            continue

        def forward_hook(module, inputs, output):
            time.sleep(f)
            return _DelayBackward.apply(output, b)

        handles.append(block.register_forward_hook(forward_hook))
        first = next(p for p in block.parameters() if p.requires_grad)
        handles.append(first.register_post_accumulate_grad_hook(lambda p: time.sleep(w)))
    return handles
