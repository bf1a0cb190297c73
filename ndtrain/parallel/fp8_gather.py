"""ZeRO-3's all-gather in fp8 (`train.fp8_all_gather`, tensorwise): the block linears'
weights travel in E4M3, one byte per value instead of bf16's two.

A tensorwise weight is quantized with one scale, amax(W) / 448, and its fp8 values are what
the forward and the input-gradient matmuls use (kernels/fp8_linear.py). A rank can
therefore quantize its own slice of W, provided it knows the whole W's amax, and the
gathered fp8 values are then exactly what one process would have quantized. Once per
step, after the optimizer has updated the slices (and once at the start), `refresh` does
this for every such weight:
1. Each rank computes the amax of each weight's part in its slices.
2. One all-reduce MAX of all these amaxes runs over the shard group, and over tp where
   tensor parallelism splits the weights. This is torchao's precomputed scales for FSDP.
3. Each rank writes its slices in fp8 (`FlatParam.shard_fp8`).

The unit's all-gathers then move the fp8 slices into the fp8 buffer `full`. Every weight
carries a view of that buffer with its scale (kernels/fp8_linear.PREQUANTIZED). The bf16
parameter object stays for autograd (gradients, hooks, names), but has no memory: nothing
reads it. The master weights, the bf16 slices, the gradients and their reduce-scatters are
as before.

Bytes: these weights' all-gathers carry half of bf16's; the amax all-reduce adds 4 bytes
per weight per step. The other parameters of a unit (norms; the root's embedding and head)
still gather in the compute dtype. `comm` in metrics.jsonl shows the sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ndtrain.comm import ops
from ndtrain.kernels.fp8 import E4M3, amax_to_scale, quantize_with
from ndtrain.kernels.fp8_linear import PREQUANTIZED, Prequantized
from ndtrain.mesh import Group


class Fp8AllGather:
    """The per-step scales and fp8 slices of the flats that gather in fp8 (`flat.fp8`)."""

    def __init__(self, flats: list, groups: list[Group]):
        """`flats`: FlatParams of one shard group whose parameters are fp8 weights; `groups`:
        where else the amax must be reduced (tp, when it splits them)."""
        self.flats, self.groups = flats, [g for g in groups if g.active]
        n = sum(len(f.params) for f in flats)
        device = flats[0].shard.device if flats else torch.device("cpu")
        self.scales = torch.ones(n, dtype=torch.float32, device=device)
        self.spans: list[tuple[object, nn.Parameter, int, int, int]] = []  # (flat, param, index, a, b)
        i = 0
        for f in flats:
            lo, hi = f.group.rank * f.shard_numel, (f.group.rank + 1) * f.shard_numel
            for p, view in zip(f.params, f.fp8_views, strict=True):
                r = f.range(p)
                a, b = max(r.start, lo) - lo, min(r.stop, hi) - lo
                self.spans.append((f, p, i, a, b))
                setattr(p, PREQUANTIZED, Prequantized(view, self.scales[i]))
                i += 1

    @torch.no_grad()
    def refresh(self) -> None:
        """Scales from the current slices (one all-reduce for all), then the fp8 slices."""
        if not self.flats:
            return
        amax = torch.zeros_like(self.scales)
        for f, _, i, a, b in self.spans:
            if a < b:
                amax[i] = f.shard[a:b].abs().max().float()
        ops.all_reduce(amax, self.flats[0].group, op=dist.ReduceOp.MAX)
        for g in self.groups:
            ops.all_reduce(amax, g, op=dist.ReduceOp.MAX)
        self.scales.copy_(amax_to_scale(amax, E4M3))
        for f in self.flats:
            f.shard_fp8.zero_()  # the padding
        for f, _, i, a, b in self.spans:
            if a < b:
                f.shard_fp8[a:b] = quantize_with(f.shard[a:b], self.scales[i], E4M3)
