"""Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): trade the sequence split for a head split
around attention.

An all-to-all turns [b, S/cp, H, d] (this rank's tokens, every head) into [b, S, H/cp, d]
(every token, this rank's heads), for q, k and v in one message; attention runs over the whole sequence on H/cp heads;
a second all-to-all turns the output back. The gathered sequence arrives in rank order
(each rank's zigzag chunks); it is put in natural order before attention, so plain causal
(or document-masked) attention applies, and back after.

Heads: query heads per TP rank must be divisible by cp. Key/value heads are split the same
way when cp divides their number; when their number divides cp they are repeated first
(each rank then receives the one head its query heads read). config.validate refuses the
rest.

Messages per rank and layer (autograd's backward of an all-to-all is the inverse one):
q, k, v in and the output back, twice: 2·(cp−1)/cp·(T/cp)·(2H + 2G')·d elements, with G'
the KV heads after repetition (max(G, cp)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ndtrain.comm import ops
from ndtrain.mesh import Group
from ndtrain.parallel.context.sinks import sink_attention
from ndtrain.parallel.context.visibility import Visibility


def _all_to_all(x: Tensor, group: Group) -> Tensor:
    out = torch.empty_like(x)
    ops.all_to_all(out, x, group)
    return out


def sequence_to_heads(x: Tensor, group: Group) -> Tensor:
    """[b, s, n, d] → [b, cp·s, n/cp, d]: every rank's tokens (rank order), this rank's
    n/cp heads."""
    b, s, n, d = x.shape
    cp = group.size
    parts = x.view(b, s, cp, n // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp (dest), b, s, n/cp, d]
    got = _all_to_all(parts, group)  # [cp (source), b, s, n/cp, d]
    return got.permute(1, 0, 2, 3, 4).reshape(b, cp * s, n // cp, d)


def heads_to_sequence(x: Tensor, group: Group) -> Tensor:
    """The inverse: [b, cp·s, n/cp, d] → [b, s, n, d]."""
    b, total, n_local, d = x.shape
    cp = group.size
    parts = x.view(b, cp, total // cp, n_local, d).transpose(0, 1).contiguous()  # [cp (dest), b, s, n/cp, d]
    got = _all_to_all(parts, group)  # [cp (source: its heads), b, s, n/cp, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, total // cp, cp * n_local, d)


class _Resplit(torch.autograd.Function):
    """`sequence_to_heads` (or, with to_heads=False, `heads_to_sequence`) forward, its
    inverse backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, to_heads: bool) -> Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return sequence_to_heads(x, group) if to_heads else heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        back = heads_to_sequence(grad, ctx.group) if ctx.to_heads else sequence_to_heads(grad, ctx.group)
        return back, None, None


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: Group, vis: Visibility, recorder=None,
                      layer: str = "", sinks: Tensor | None = None) -> Tensor:
    """q [b, s, H, d], k and v [b, s, G, d] (after rotary) → [b, s, H·d]. `sinks` [H]
    (gpt-oss): this rank's heads' sinks fold into its attention as on one device
    (parallel/context/sinks.py), their gradient theirs (the other heads' entries 0; the step
    sums the cp ranks' gradients)."""
    cp, n_kv = group.size, k.shape[2]
    if n_kv % cp:  # fewer KV heads than ranks: each rank gets a copy of the one it reads
        k, v = k.repeat_interleave(cp // n_kv, dim=2), v.repeat_interleave(cp // n_kv, dim=2)
    b, s, heads, d = q.shape
    # one message for q, k and v: the heads each rank receives, side by side
    qkv = torch.cat([t.view(b, s, cp, -1, d) for t in (q, k, v)], dim=3).flatten(2, 3)
    start = recorder.now() if recorder else 0.0
    qkv = _Resplit.apply(qkv, group, True)  # [b, S, (H + 2·G')/cp, d], rank order
    if recorder:
        recorder.message("qkv", layer, 0, start, start)
    start = recorder.now() if recorder else 0.0
    order = torch.cat(vis.index)  # global position of each gathered token
    natural = torch.argsort(order)
    qkv = qkv[:, natural].transpose(1, 2)  # [b, heads, S, d] in sequence order
    q, k, v = qkv.split([heads // cp, k.shape[2] // cp, k.shape[2] // cp], dim=1)
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    mask = vis.sequence_mask(natural)
    causal = mask is None and vis.causal
    if sinks is not None:
        if mask is None and not causal:  # sink_attention reads None as causal
            mask = torch.ones((1, 1, q.shape[2], k.shape[2]), dtype=torch.bool, device=q.device)
        out = sink_attention(q, k, v, sinks.narrow(0, group.rank * (heads // cp), heads // cp), mask)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **gqa)
    out = out.transpose(1, 2)[:, order]  # back to rank order
    if recorder:
        recorder.compute("attn F", layer, 0, start)
    start = recorder.now() if recorder else 0.0
    out = _Resplit.apply(out.contiguous(), group, False)
    if recorder:
        recorder.message("out", layer, 0, start, start)
    return out.flatten(2)
