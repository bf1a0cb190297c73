"""Ring attention: K/V blocks travel around the CP group while each rank attends to the
block it holds, with an explicit backward that sends K/V around again and the K/V gradient
accumulators after them, back to their owners.

Forward, at step i = 0 … cp−1 rank r holds the keys and values of rank (r − i) mod cp:
1. it posts the exchange for step i+1 (send what it holds to r+1, receive from r−1);
2. it computes its block against what it holds (`Visibility.ring_block`: under the zigzag
   layout the diagonal step is the local causal square and every other step 2c² unmasked
   pairs) on a fused attention op (`fused.py`) and merges it into the running output and
   log-sum-exp (kernels.Partial), in fp32 (fp64 for fp64 runs);
3. it waits for the exchange. Compute and communication overlap.
Only the local q, k, v, the output and the log-sum-exp are kept for backward: autograd
through the ring would keep every step's block.

Backward walks the same ring. At step i the rank computes, with the fused op's backward
fed the merged output and log-sum-exp, the block's dq (accumulated locally) and its
contribution to the dk, dv of the source's block, adds the partial sum that arrived from
r−1 for that same block (sent there one step earlier), and passes the sum to r+1, which
holds that block at step i+1. After step cp−1 each sum has collected all cp
contributions and one last hop takes it to its owner. The accumulators travel in fp32.

Messages per rank and layer (T tokens in the CP group, G KV heads per TP rank, head dim d):
forward (cp−1)·2·(T/cp)·G·d elements of K/V; backward the same again, plus cp·2·(T/cp)·G·d
of gradient accumulators (in fp32). See `comm_elements` in attention.py.
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


class _Exchange:
    """One step's message group to the next rank and from the previous one."""

    def __init__(self, send: Tensor, group: Group, recorder, kind: str, layer: str, step: int):
        self.send, self.recv = send, torch.empty_like(send)
        nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        self.works = ops.send_recv([(send, nxt)], [(self.recv, prv)], group)
        self.recorder, self.kind, self.layer, self.step = recorder, kind, layer, step
        self.posted = recorder.now() if recorder else 0.0

    def wait(self) -> Tensor:
        start = self.recorder.now() if self.recorder else 0.0
        for w in self.works:
            w.wait()
        if self.recorder:
            self.recorder.message(self.kind, self.layer, self.step, self.posted, start)
        return self.recv


def ring_forward(q: Tensor, k: Tensor, v: Tensor, group: Group, vis: Visibility, recorder=None,
                 layer: str = "") -> tuple[Tensor, Tensor]:
    """The forward ring: out [b, H, s, d] and lse [b, H, s] of this rank's queries against
    every rank's keys, in fp32 (fp64 for fp64 inputs)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    qh = to_heads(q)
    partial = Partial(qh.shape, wide_dtype(qh.dtype), qh.device)
    kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)]).contiguous()  # one message: [2, b, G, s, d]
    for step in range(group.size):
        exchange = _Exchange(kv, group, recorder, "kv", layer, step) if step < group.size - 1 else None
        start = recorder.now() if recorder else 0.0
        block = vis.ring_block((group.rank - step) % group.size)
        if block is not None:
            rows = (slice(None), slice(None), block.rows)
            partial.add(block.rows, *fused.forward(qh[rows], kv[0][:, :, block.cols], kv[1][:, :, block.cols],
                                                   block, scale))
        if recorder:
            recorder.compute("attn F", layer, step, start)
        if exchange is not None:
            kv = exchange.wait()
    return partial.result()


class RingAttention(torch.autograd.Function):
    """q [b, s, H, d], k and v [b, s, G, d] (after rotary) → [b, s, H·d]; `sinks` [H]: each
    head's sink logit, folded into the merged result (kernels.fold_sinks)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: Group, vis: Visibility, recorder=None,
                layer: str = "", sinks: Tensor | None = None) -> Tensor:
        out, lse = ring_forward(q, k, v, group, vis, recorder, layer)
        if sinks is not None:
            out, lse = fold_sinks(out, lse, sinks)
        result = from_heads(out).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        ctx.group, ctx.vis, ctx.recorder, ctx.layer = group, vis, recorder, layer
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, vis, recorder, layer = ctx.group, ctx.vis, ctx.recorder, ctx.layer
        scale = 1.0 / math.sqrt(q.shape[-1])
        qh, dout, outh = (to_heads(t.reshape(q.shape)) for t in (q, grad, out))
        dq = torch.zeros(qh.shape, dtype=lse.dtype, device=qh.device)
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)]).contiguous()
        arriving = None  # the partial dk, dv of the block held next, from rank r−1
        for step in range(group.size):
            exchange = _Exchange(kv, group, recorder, "kv", layer, step) if step < group.size - 1 else None
            start = recorder.now() if recorder else 0.0
            mine = torch.zeros(kv.shape, dtype=lse.dtype, device=qh.device)
            block = vis.ring_block((group.rank - step) % group.size)
            if block is not None:
                rows = (slice(None), slice(None), block.rows)
                b_dq, b_dk, b_dv = fused.backward(dout[rows], qh[rows], kv[0][:, :, block.cols],
                                                  kv[1][:, :, block.cols], outh[rows], lse[rows], block, scale)
                dq[rows] += b_dq
                mine[0][:, :, block.cols] += b_dk
                mine[1][:, :, block.cols] += b_dv
            if recorder:
                recorder.compute("attn B", layer, step, start)
            if arriving is not None:
                mine += arriving.wait()
            arriving = _Exchange(mine, group, recorder, "dkv", layer, step)
            if exchange is not None:
                kv = exchange.wait()
        dkv = arriving.wait()  # every rank's contribution to this rank's own K/V
        dk, dv = (t.transpose(1, 2).to(k.dtype) for t in dkv)
        dsinks = sinks_grad(dout, outh, lse, sinks).to(sinks.dtype) if sinks is not None else None
        return dq.transpose(1, 2).to(q.dtype), dk, dv, None, None, None, None, dsinks
