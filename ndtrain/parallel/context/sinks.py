"""Attention with sinks (gpt-oss) on the fused attention ops, with no s × s matrix: for one
device's attention core (`apply`, which parallel/parallelize.py calls when cp = 1) and for
Ulysses' attention over the gathered heads.

A sink is one more logit per head in every row's softmax denominator, with no value. The
fused ops do not take it, but they return each row's log-sum-exp, so it folds in after them
(kernels.fold_sinks: out' = out·e^(lse−lse'), lse' = logaddexp(lse, σ_h)); their backward,
given out' and lse', is the gradient of attention with sinks, and kernels.sinks_grad gives
the sink's own. This is the ring's merge with a single block: `fused.kernel_for` picks the
op (the CPU's fused op, flash, cuDNN, efficient attention, or the plain kernel), so what runs
is what context parallelism runs. The plain model (model/llama.py) computes the same in
plain torch (`plain_attention`), materialising the scores: the reference, what decoding
with the KV cache runs, and what this replaces in training.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ndtrain.model.llama import AttentionCore, KVCache, apply_rope, visible_keys
from ndtrain.parallel.context import fused
from ndtrain.parallel.context.kernels import fold_sinks, sinks_grad
from ndtrain.parallel.context.visibility import Block


class SinkAttention(torch.autograd.Function):
    """q [b, H, s, d], k and v [b, G, s_kv, d], sinks [H] → [b, H, s, d]; `mask`
    [b or 1, 1, s, s_kv] (True: visible), or None for the causal square."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None) -> Tensor:
        block = Block(slice(0, q.shape[2]), slice(0, k.shape[2]), mask, causal=mask is None)
        q, k, v = (t.contiguous() for t in (q, k, v))
        out, lse = fold_sinks(*fused.forward(q, k, v, block, 1.0 / math.sqrt(q.shape[-1])), sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = fused.backward(dout, q, k, v, out, lse, ctx.block, 1.0 / math.sqrt(q.shape[-1]))
        dsinks = sinks_grad(dout, out, lse, sinks).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None) -> Tensor:
    return SinkAttention.apply(q, k, v, sinks, mask)


class FusedSinkCore(AttentionCore):
    """`AttentionCore` whose sinks run on the fused ops (no KV cache, no soft-capping: the
    plain core's own computation otherwise)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                cache: KVCache | None = None, layer_key: str | None = None,
                doc_ids: Tensor | None = None, sinks: Tensor | None = None) -> Tensor:
        if sinks is None or cache is not None or self.softcap:
            return super().forward(q, k, v, cos, sin, cache, layer_key, doc_ids, sinks)
        b, s = q.shape[:2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = visible_keys(s, s, doc_ids, None, self.window, q.device)
        return sink_attention(q, k, v, sinks, mask).transpose(1, 2).reshape(b, s, -1)


def apply(model: nn.Module) -> int:
    """Swap the attention core of every layer with sinks for `FusedSinkCore`, in place;
    returns how many."""
    n = 0
    for block in getattr(model, "layers", nn.ModuleDict()).values():
        attention = getattr(block, "attention", None)
        core = getattr(attention, "core", None)
        if getattr(attention, "sinks", None) is not None and type(core) is AttentionCore:
            attention.core = FusedSinkCore(core.window, core.softcap, core.documents)
            n += 1
    return n
