"""Attention with sinks (gpt-oss) on one device, on the fused attention ops: no s × s matrix.

A sink is one more logit per head in every row's softmax denominator, with no value. The
fused ops do not take it, but they return each row's log-sum-exp: the sink folds in after
them, out' = out·e^(lse−lse'), lse' = logaddexp(lse, σ_h), and their backward, given out'
and lse', is the gradient of attention with sinks (parallel/context/kernels.py derives both
and the sink's own gradient). This is context parallelism's merge with a single block: the
same ops (`fused.kernel_for` picks one: the CPU's fused op, flash, efficient attention or
the plain kernel), so what runs is what the ring runs. The model calls it for training and
evaluation forwards (no KV cache); decoding one token at a time uses
`model/llama.plain_attention`, which materialises the few scores it has.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class SinkAttention(torch.autograd.Function):
    """q [b, H, s, d], k and v [b, G, s, d], sinks [H] → [b, H, s, d]; `mask` [b or 1, 1, s, s]
    (True: visible), or None for the causal square."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None) -> Tensor:
        from ndtrain.parallel.context import fused
        from ndtrain.parallel.context.kernels import fold_sinks
        from ndtrain.parallel.context.visibility import Block
        rows = slice(0, q.shape[2])
        block = Block(rows, slice(0, k.shape[2]), mask, causal=mask is None)
        q, k, v = (t.contiguous() for t in (q, k, v))
        out, lse = fold_sinks(*fused.forward(q, k, v, block, 1.0 / math.sqrt(q.shape[-1])), sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        from ndtrain.parallel.context import fused
        from ndtrain.parallel.context.kernels import sinks_grad
        q, k, v, sinks, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = fused.backward(dout, q, k, v, out, lse, ctx.block, 1.0 / math.sqrt(q.shape[-1]))
        dsinks = sinks_grad(dout, out, lse, sinks).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None) -> Tensor:
    return SinkAttention.apply(q, k, v, sinks, mask)
