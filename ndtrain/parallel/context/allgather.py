"""All-gather attention (the Llama 3 paper's context parallelism): gather every rank's keys
and values, attend with the local queries, reduce-scatter the key/value gradients back.

One block per layer: local queries × the keys of the whole sequence, masked by global token
index (and document). The gathered K/V stay saved for backward, so a rank holds the keys
and values of the whole sequence per layer (2·S·G·d), which the ring avoids; in exchange
document masks need nothing special and the collectives are the simplest there are.

Messages per rank and layer: an all-gather of 2·T·G·d elements forward and a reduce-scatter
of as many (in fp32) backward, (cp−1)/cp of each on the wire: 4·T·G·d·(cp−1)/cp.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ndtrain.comm import ops
from ndtrain.mesh import Group
from ndtrain.model.llama import widened
from ndtrain.parallel.context.kernels import attend, attend_backward, from_heads, to_heads
from ndtrain.parallel.context.visibility import Visibility


def _gathered_heads(kv: Tensor) -> Tensor:
    """[cp, 2, b, s, G, d] (rank order) → [2, b, G, cp·s, d]."""
    cp, two, b, s, g, d = kv.shape
    return kv.permute(1, 2, 4, 0, 3, 5).reshape(two, b, g, cp * s, d)


def allgather_forward(q: Tensor, k: Tensor, v: Tensor, group: Group, vis: Visibility, recorder=None,
                      layer: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """out [b, G, H/G, s, d] and lse [b, G, H/G, s] of this rank's queries against the
    gathered keys (fp32, or fp64), and the gathered K/V [cp, 2, b, s, G, d]."""
    local = torch.stack([k, v]).contiguous()  # [2, b, s, G, d]
    gathered = local.new_empty((group.size, *local.shape))
    start = recorder.now() if recorder else 0.0
    ops.all_gather(gathered.view(-1), local.view(-1), group)
    if recorder:
        recorder.message("kv", layer, 0, start, start)
    start = recorder.now() if recorder else 0.0
    kv = widened(_gathered_heads(gathered))
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = attend(to_heads(widened(q), kv.shape[2]), kv[0], kv[1], vis.gathered_mask(), scale)
    if recorder:
        recorder.compute("attn F", layer, 0, start)
    return out, lse, gathered


class AllGatherAttention(torch.autograd.Function):
    """q [b, s, H, d], k and v [b, s, G, d] (after rotary) → [b, s, H·d]."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: Group, vis: Visibility, recorder=None,
                layer: str = "") -> Tensor:
        out, lse, gathered = allgather_forward(q, k, v, group, vis, recorder, layer)
        result = from_heads(out).to(q.dtype)
        ctx.save_for_backward(q, gathered, result, lse)
        ctx.group, ctx.vis, ctx.shape, ctx.dtype = group, vis, gathered.shape[1:], k.dtype
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, gathered, out, lse = ctx.saved_tensors
        group, vis = ctx.group, ctx.vis
        kv = widened(_gathered_heads(gathered))
        n_kv = kv.shape[2]
        dout = to_heads(widened(grad).reshape(q.shape), n_kv)
        delta = (dout * to_heads(widened(out).view(q.shape), n_kv)).sum(-1)
        dq, dk, dv = attend_backward(to_heads(widened(q), n_kv), kv[0], kv[1], vis.gathered_mask(),
                                     1.0 / math.sqrt(q.shape[-1]), lse, delta, dout)
        # [2, b, G, cp·s, d] → [cp, 2, b, s, G, d], this rank's slice summed over the group
        two, b, g, s_all, d = 2, *dk.shape
        dkv = torch.stack([dk, dv]).view(two, b, g, group.size, s_all // group.size, d)
        dkv = dkv.permute(3, 0, 1, 4, 2, 5).contiguous()
        mine = dkv.new_empty(ctx.shape)
        ops.reduce_scatter(mine.view(-1), dkv.view(-1), group)
        return from_heads(dq).view(q.shape).to(q.dtype), mine[0].to(ctx.dtype), mine[1].to(ctx.dtype), \
            None, None, None, None

