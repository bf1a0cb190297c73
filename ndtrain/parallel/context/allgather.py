"""All-gather attention (the Llama 3 paper's context parallelism): gather every rank's keys
and values, attend with the local queries, reduce-scatter the key/value gradients back.

The gathered K/V are put in sequence order; each local query chunk j (of the zigzag
layout's 2·cp) then sees keys [0, j·c) fully and its own chunk causally: two fused blocks
per chunk (`Visibility.gathered_blocks`, `fused.py`), merged by their log-sum-exp, so a
rank computes the same 2·cp·c² visible pairs as a ring and nothing masked (with documents
the blocks carry their masks). The gathered K/V stay saved for backward, so a rank holds
the keys and values of the whole sequence per layer (2·S·G·d), which the ring avoids; in
exchange the collectives are the simplest there are.

Messages per rank and layer: an all-gather of 2·T·G·d elements forward and a reduce-scatter
of as many (in fp32) backward, (cp−1)/cp of each on the wire: 4·T·G·d·(cp−1)/cp.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ndtrain.comm import ops
from ndtrain.mesh import Group
from ndtrain.model.dtypes import wide_dtype
from ndtrain.parallel.context import fused
from ndtrain.parallel.context.kernels import Partial, fold_sinks, from_heads, sinks_grad, to_heads
from ndtrain.parallel.context.visibility import Visibility


def _natural(gathered: Tensor) -> Tensor:
    """Every rank's K/V [cp, 2, b, s, G, d] (rank order: rank j holds chunks j and 2·cp−1−j)
    → [2, b, G, S, d] in sequence order."""
    cp, two, b, s, g, d = gathered.shape
    halves = gathered.view(cp, two, b, 2, s // 2, g, d)
    chunks = torch.cat([halves[:, :, :, 0], halves[:, :, :, 1].flip(0)])  # chunk j at index j
    return chunks.permute(1, 2, 4, 0, 3, 5).reshape(two, b, g, cp * s, d)


def _rank_order(natural: Tensor, cp: int) -> Tensor:
    """The inverse of `_natural`: [2, b, G, S, d] → [cp, 2, b, s, G, d] (contiguous)."""
    two, b, g, seq, d = natural.shape
    chunks = natural.view(two, b, g, 2 * cp, seq // (2 * cp), d).permute(3, 0, 1, 4, 2, 5)
    return torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim=3).reshape(cp, two, b, seq // cp, g, d)


def allgather_forward(q: Tensor, k: Tensor, v: Tensor, group: Group, vis: Visibility, recorder=None,
                      layer: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """out [b, H, s, d] and lse [b, H, s] of this rank's queries against the gathered keys
    (fp32, or fp64), and the gathered K/V in sequence order [2, b, G, S, d]."""
    local = torch.stack([k, v]).contiguous()  # [2, b, s, G, d]
    gathered = local.new_empty((group.size, *local.shape))
    start = recorder.now() if recorder else 0.0
    ops.all_gather(gathered.view(-1), local.view(-1), group)
    if recorder:
        recorder.message("kv", layer, 0, start, start)
    start = recorder.now() if recorder else 0.0
    del local
    kv, qh, scale = _natural(gathered), to_heads(q), 1.0 / math.sqrt(q.shape[-1])
    del gathered  # the sequence-ordered copy is what backward keeps
    partial = Partial(qh.shape, wide_dtype(qh.dtype), qh.device)
    for block in vis.gathered_blocks():
        rows = (slice(None), slice(None), block.rows)
        partial.add(block.rows, *fused.forward(qh[rows], kv[0][:, :, block.cols], kv[1][:, :, block.cols], block,
                                               scale))
    if recorder:
        recorder.compute("attn F", layer, 0, start)
    return (*partial.result(), kv)


class AllGatherAttention(torch.autograd.Function):
    """q [b, s, H, d], k and v [b, s, G, d] (after rotary) → [b, s, H·d]; `sinks` [H] as in
    ring.RingAttention."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: Group, vis: Visibility, recorder=None,
                layer: str = "", sinks: Tensor | None = None) -> Tensor:
        out, lse, kv = allgather_forward(q, k, v, group, vis, recorder, layer)
        if sinks is not None:
            out, lse = fold_sinks(out, lse, sinks)
        result = from_heads(out).to(q.dtype)
        ctx.save_for_backward(q, kv, result, lse, sinks)
        ctx.group, ctx.vis, ctx.dtype = group, vis, k.dtype
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, kv, out, lse, sinks = ctx.saved_tensors
        group, vis, scale = ctx.group, ctx.vis, 1.0 / math.sqrt(q.shape[-1])
        qh, dout, outh = (to_heads(t.reshape(q.shape)) for t in (q, grad, out))
        dq = torch.zeros(qh.shape, dtype=lse.dtype, device=qh.device)
        dkv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)  # sequence order
        for block in vis.gathered_blocks():
            rows, cols = (slice(None), slice(None), block.rows), (slice(None), slice(None), block.cols)
            b_dq, b_dk, b_dv = fused.backward(dout[rows], qh[rows], kv[0][cols], kv[1][cols], outh[rows], lse[rows],
                                              block, scale)
            dq[rows] += b_dq
            dkv[0][cols] += b_dk
            dkv[1][cols] += b_dv
        send = _rank_order(dkv, group.size)
        mine = send.new_empty(send.shape[1:])
        ops.reduce_scatter(mine.view(-1), send.view(-1), group)  # this rank's slice, summed over the group
        dsinks = sinks_grad(dout, outh, lse, sinks).to(sinks.dtype) if sinks is not None else None
        return (dq.transpose(1, 2).to(q.dtype), mine[0].to(ctx.dtype), mine[1].to(ctx.dtype), None, None, None, None,
                dsinks)
