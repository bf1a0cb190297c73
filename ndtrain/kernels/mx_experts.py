"""Routed experts in MXFP8 on CUDA sm100: each of the three products one `torch._scaled_grouped_mm`.

torch 2.13 takes MXFP8 (E4M3 operands, float8_e8m0fnu scales) in its grouped product through
its MSLK kernel (CUDA sm100 only, a build with USE_MSLK), in two forms:

    forward      y  = x·Wᵀ   2-D × 3-D   mat_a x [T', K] row-major, rows grouped by expert
                                         (`offs`: each expert's end row); mat_b [G, K, N]
                                         column-major (each expert's W [N, K] as stored)
    input grad   dx = dy·W   2-D × 3-D   mat_a dy [T', N]; mat_b [G, N, K] column-major
                                         (each expert's W quantized along N, its reduction)
    weight grad  dW = dyᵀ·x  2-D × 2-D   mat_a dyᵀ [N, T'] row-major, mat_b x [T', K]
                                         column-major: the tokens, grouped, are the
                                         reduction; out [G, N, K]

Every operand is in 1×32 blocks along its product's reduction, as the per-group loop
(kernels/fp8_linear.Fp8Experts) quantizes it, with the scales in the blocked layout of cuBLAS's
block scaling (`mx._swizzle`: [rows, cols] padded to 128 × 4, each 128×4 tile laid as 32 rows
of [4 row groups × 4 columns]). What the kernel reads (its offsets; torch's checks and meta
kernel give only the 3-D operand's scale size, [G, round_up(rows, 128)·round_up(K/32, 4)]):

  - a 3-D operand's scales: each expert's [N, K/32] blocked on its own, stacked;
  - a 2-D operand grouped along its rows (forward, input gradient): each expert's rows'
    scales blocked on their own (padded to 128 rows), one after another;
  - a 2-D operand grouped along the reduction (weight gradient): each expert's
    [rows, its tokens / 32] blocked on its own (padded to 4 columns, i.e. 128 tokens), one
    after another, an expert's count of scale columns taken as its tokens // 32.

So the tokens are padded: each group of rows (one expert's tokens from one source micro-batch,
`segments_of`) with zero rows to a multiple of 32 (`Padded`). The weight gradient's blocks of
32 tokens then start at each group's first row, as the loop (one process) cuts them, never
hold two groups' tokens, and an expert's token count is whole blocks, as the kernel counts
them. A padded block has the amax of the group's last rows, so the scales and values equal the
loop's. The forward and input gradient take the same padded rows (their blocks run along K
and N: padding changes nothing there; torch's own tests of this kernel use groups in
multiples of 32). The output keeps bf16, the only one the kernel writes.

NVFP4 stays on the per-group loop: torch 2.13's `_scaled_grouped_mm` takes E4M3 operands
only (its meta kernel refuses float4_e2m1fn_x2), and `F.scaled_grouped_mm`
(`_scaled_grouped_mm_v2`) has no meta kernel in torch 2.13, so no call of it can be checked
without a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ndtrain.kernels import fp8 as kernels
from ndtrain.kernels import mx
from ndtrain.kernels.fp8 import Dim, row_major

E8M0 = torch.float8_e8m0fnu
PAD = mx.MX_BLOCK  # each group of rows padded to whole blocks along the tokens
SM100 = (10, 0)  # where torch's own tests run its grouped MXFP8 kernel (IS_SM100)


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.lru_cache(maxsize=1)
def grouped_built() -> bool:
    """Whether this torch has the MXFP8 grouped kernel (built with MSLK, the flag torch's own
    tests look for in `torch.__config__.show()`)."""
    show = torch.__config__.show()
    return "USE_MSLK" in show and "USE_MSLK=OFF" not in show and "USE_MSLK=0" not in show


def why_not(x: Tensor, w: Tensor, plan) -> str | None:
    """None where a micro-scaled expert product runs as one `_scaled_grouped_mm` per matmul
    (CUDA sm100, MXFP8, bf16, whole weights, K and N multiples of 32); else why not, or ""
    off CUDA or with a back end forced (nothing to warn)."""
    if not x.is_cuda or plan.backend is not None or x.shape[0] == 0:
        return ""
    lead = "routed experts run one product per expert and source: "
    if plan.recipe.kind != "mxfp8":
        return (lead + "torch 2.13's grouped block-scaled product (_scaled_grouped_mm) takes E4M3 operands only, "
                "not NVFP4's float4_e2m1fn_x2")
    cap = kernels.device_capability(x.device)  # looked up here, so the fake-tensor checks can patch it
    _, n, k = w.shape
    if cap != SM100:
        return lead + f"MXFP8 _scaled_grouped_mm needs sm100, this GPU is sm{cap[0]}{cap[1]}"
    if not grouped_built():
        return lead + "this torch was built without its MXFP8 grouped kernel (USE_MSLK)"
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return lead + f"MXFP8 _scaled_grouped_mm writes bf16, these experts run in {x.dtype} ({w.dtype} weights)"
    if k % mx.MX_BLOCK or n % mx.MX_BLOCK:
        return lead + f"MXFP8 _scaled_grouped_mm needs K and N multiples of 32 (K={k}, N={n})"
    if plan.k.size != plan.k.full or plan.n.size != plan.n.full:
        return lead + "MXFP8 _scaled_grouped_mm takes whole expert weights, this rank holds a shard"
    return None


@dataclass(frozen=True)
class Padded:
    """The rows of `segments_of`'s groups, each padded with zero rows to a multiple of 32:
    `groups` (expert, start, rows, start once padded), `experts` (start, rows once padded) of
    each expert, `rows` in all."""

    groups: tuple[tuple[int, int, int, int], ...]
    experts: tuple[tuple[int, int], ...]
    rows: int

    @staticmethod
    def of(segments: list[tuple[int, int, int]], experts: int) -> "Padded":
        groups, sizes, at = [], [0] * experts, 0
        for g, a, b in segments:
            groups.append((g, a, b - a, at))
            at += _up(b - a, PAD)
            sizes[g] += _up(b - a, PAD)
        starts = [sum(sizes[:g]) for g in range(experts)]
        return Padded(tuple(groups), tuple(zip(starts, sizes)), at)

    def pad(self, t: Tensor) -> Tensor:
        """t [rows, C] as the padded rows (narrow and cat: what fake CUDA tensors take)."""
        parts = []
        for _, a, n, _ in self.groups:
            if n:
                parts.append(t.narrow(0, a, n))
            if _up(n, PAD) - n:
                parts.append(t.new_zeros(_up(n, PAD) - n, t.shape[1]))
        return torch.cat(parts)

    def unpad(self, t: Tensor) -> Tensor:
        return torch.cat([t.narrow(0, p, n) for _, _, n, p in self.groups if n])

    def offs(self, device: torch.device) -> Tensor:
        """Each expert's end row, padded (int32): the grouped product's `offs`."""
        return torch.tensor([s + n for s, n in self.experts], dtype=torch.int32, device=device)

    def nonempty(self, device: torch.device) -> Tensor:
        return torch.tensor([n > 0 for _, n in self.experts], device=device)


@dataclass
class GroupedCall:
    """The arguments of one `torch._scaled_grouped_mm` (what the CPU checks read back)."""

    mat_a: Tensor
    mat_b: Tensor
    scale_a: Tensor
    scale_b: Tensor
    offs: Tensor

    def run(self) -> Tensor:
        return torch._scaled_grouped_mm(self.mat_a, self.mat_b, self.scale_a, self.scale_b, offs=self.offs,
                                        out_dtype=torch.bfloat16)


def _blocked(scale: Tensor) -> Tensor:
    return mx._swizzle(scale.float()).to(E8M0)


def _blocked_rows(scale: Tensor, spans: tuple[tuple[int, int], ...]) -> Tensor:
    """scale [R, C] with its rows grouped (start, rows): each group's rows blocked on their
    own, one after another: [Σ round_up(rows, 128), round_up(C, 4)]. One `_swizzle` of the
    groups each padded to 128 rows (its tiles never span two groups)."""
    parts = []
    for s, n in spans:
        if n:
            parts.append(scale.narrow(0, s, n))
        if _up(n, 128) - n:
            parts.append(scale.new_zeros(_up(n, 128) - n, scale.shape[1]))
    return _blocked(torch.cat(parts)).view(-1, _up(scale.shape[1], 4))


def _blocked_cols(scale: Tensor, spans: tuple[tuple[int, int], ...]) -> Tensor:
    """scale [R, C] with its columns grouped (start, columns): each group's [R, columns]
    blocked on its own, one after another: [round_up(R, 128), Σ round_up(columns, 4)]."""
    parts = [_blocked(scale.narrow(1, s, n)) for s, n in spans if n]
    return torch.cat(parts).view(_up(scale.shape[0], 128), -1)


def _blocked_experts(scale: Tensor, experts: int) -> Tensor:
    """scale [G·R, C], each expert's [R, C] blocked on its own: [G, round_up(R, 128)·round_up(C, 4)]."""
    r, c = scale.shape[0] // experts, scale.shape[1]
    per = scale.view(experts, r, c)
    if r % 128:
        per = torch.cat([per, per.new_zeros(experts, -r % 128, c)], 1)
    return _blocked(per.reshape(-1, c)).view(experts, -1)


def _weights(w: Tensor, blocks: tuple[int, int], plan):
    """Every expert's weight [N, K] in MXFP8 at once, as [G·N, K]: blocks of 32 along N
    never span two experts (N a multiple of 32), so each expert's are the loop's."""
    g, n, k = w.shape
    return mx.quantize_mx(w.reshape(g * n, k), (Dim.whole(g * n), plan.k), blocks)


def forward_call(x: Tensor, w: Tensor, layout: Padded, plan) -> GroupedCall:
    """y = x·Wᵀ: x's padded rows [T', K] and each expert's W, in 1×32 blocks along K."""
    g, n, k = w.shape
    xq = mx.quantize_mx(layout.pad(x), (Dim.whole(layout.rows), plan.k), plan.recipe.x)
    wq = _weights(w, plan.recipe.w, plan)
    return GroupedCall(xq.data, wq.data.view(g, n, k).transpose(-2, -1), _blocked_rows(xq.scale, layout.experts),
                       _blocked_experts(wq.scale, g), layout.offs(x.device))


def input_grad_call(dy: Tensor, w: Tensor, layout: Padded, plan) -> GroupedCall:
    """dx = dy·W: dy's padded rows [T', N] in 1×32 blocks along N, each expert's W in 32×1
    blocks (along N, the reduction), laid [G, N, K] column-major."""
    g, n, k = w.shape
    r = plan.recipe
    dyq = mx.quantize_mx(layout.pad(dy), (Dim.whole(layout.rows), plan.n), r.dy)
    wq = _weights(w, r.w_dgrad, plan)  # data [G·N, K], scale [G·N/32, K]
    b = row_major(wq.data.view(g, n, k).transpose(-2, -1)).transpose(-2, -1)
    scale_b = wq.scale.view(g, n // mx.MX_BLOCK, k).transpose(-2, -1).reshape(g * k, n // mx.MX_BLOCK)
    return GroupedCall(dyq.data, b, _blocked_rows(dyq.scale, layout.experts), _blocked_experts(scale_b, g),
                       layout.offs(dy.device))


def weight_grad_call(dy: Tensor, x: Tensor, layout: Padded, plan) -> GroupedCall:
    """dW = dyᵀ·x per expert: dy and x padded, in 32×1 blocks along the tokens (each group's
    blocks from its first row); the tokens grouped by expert are the reduction."""
    r, rows = plan.recipe, Dim.whole(layout.rows)
    dyq = mx.quantize_mx(layout.pad(dy), (rows, plan.n), r.dy_wgrad)  # data [T', N], scale [T'/32, N]
    xq = mx.quantize_mx(layout.pad(x), (rows, plan.k), r.x_wgrad)
    spans = tuple((s // mx.MX_BLOCK, n // mx.MX_BLOCK) for s, n in layout.experts)
    return GroupedCall(row_major(dyq.data.t()), row_major(xq.data.t()).t(), _blocked_cols(dyq.scale.t(), spans),
                       _blocked_cols(xq.scale.t(), spans), layout.offs(dy.device))


def forward(x: Tensor, w: Tensor, layout: Padded, plan) -> Tensor:
    return layout.unpad(forward_call(x, w, layout, plan).run())


def input_grad(dy: Tensor, w: Tensor, layout: Padded, plan) -> Tensor:
    return layout.unpad(input_grad_call(dy, w, layout, plan).run())


def weight_grad(dy: Tensor, x: Tensor, layout: Padded, plan) -> Tensor:
    """[G, N, K] bf16; an expert without rows gets zeros (the kernel skips its group and
    leaves its output as allocated)."""
    out = weight_grad_call(dy, x, layout, plan).run()
    return torch.where(layout.nonempty(out.device).view(-1, 1, 1), out, out.new_zeros(()))
