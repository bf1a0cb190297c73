"""FP8 arithmetic: scales, quantizers and the scaled matmul, on any device.

An operand of a matmul is cut into *cells*, each with one scale s = amax(cell) / fmax (the
factor that takes an fp8 value back to its real value). Along each dimension a cell is
`WHOLE` (the whole dimension), `BLOCK` = 128 consecutive elements, or 1 element:

    tensorwise   (WHOLE, WHOLE)             one scale per tensor
    rowwise      (1, WHOLE)                 one per row, along the reduction dimension
    blockwise    (1, 128) and (128, 128)    DeepSeek-V3: 1×128 activation tiles, 128×128 weight blocks

Cells are laid on the *global* indices of a dimension (`Dim`), so a rank that holds a shard
of a tensor cuts it where one process would. A cell that spans shards takes its amax
reduced over the ranks holding them (`Dim.split.max_`, provided by parallel/fp8.py); this
module does no communication itself.

x → fp8: x / s, clamped to ±fmax (saturation, never inf or NaN), rounded to nearest even by
the cast. The division is computed in x's precision widened to fp32 (fp64 stays fp64), the
same elementwise operations on every device, so a CPU and a GPU produce the same bits.

`scaled_matmul(a, b)` computes a·bᵀ from two quantized operands whose cells along the
reduction dimension K coincide. K is cut into *runs* of constant cells; each run's product
is accumulated in fp32 (a partial sum of at most 128 products for blockwise: the promotion
DeepSeek-V3 makes every 128 elements), multiplied by its two scales and added in fp32.
Back ends (`backend`):
- "fp64": the run's products in fp64 from the fp8 values (exact: fp8·fp8 fits any float);
  the CPU layout proofs, where two layouts then differ only by fp64 summation order.
- "emulate": the same in fp32, the CPU emulation of blockwise (and a fallback everywhere).
- "scaled_mm": `torch._scaled_mm`. One run (tensorwise, rowwise) is one call with the
  scales; several runs (blockwise) are one call per run with unit scales and fp32 output,
  scaled and summed in fp32, which is the promotion DeepSeek-V3 describes. On CUDA it
  needs sm89+ and dimensions that are multiples of 16; otherwise "emulate" runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
WHOLE, BLOCK = 0, 128
AMAX_FLOOR = 1e-12  # an all-zero cell gets a tiny scale, never a division by zero


class MaxReducer(Protocol):
    def max_(self, t: Tensor) -> None:
        """In place: the elementwise maximum of `t` over the ranks that split a dimension."""


@dataclass(frozen=True)
class Dim:
    """One dimension of an operand as this rank holds it: `size` local elements, at global
    indices `offset + arange(size)` (or `index`, a CPU tensor, for a permuted one such as the
    tokens under context parallelism) of a dimension of `full` elements. `split`: the ranks
    holding the rest (None: all of it is here). `aligned`: every rank's share is made of
    whole 128-blocks, so a block never spans ranks (the same answer on every rank)."""

    size: int
    full: int
    offset: int = 0
    index: Tensor | None = field(default=None, compare=False)
    split: MaxReducer | None = field(default=None, compare=False)
    aligned: bool = False

    @staticmethod
    def whole(n: int) -> "Dim":
        return Dim(n, n)

    def global_index(self) -> Tensor:
        return self.index if self.index is not None else torch.arange(self.offset, self.offset + self.size)

    def cells(self, block: int) -> tuple[Tensor | None, int]:
        """(the cell of each local element, a CPU long tensor, or None where cell i is element
        i or the one cell is all of them; the number of cells)."""
        if block == WHOLE:
            return None, 1
        if block == 1:
            return None, self.size
        return self.global_index() // block, -(-self.full // block)

    def spans_ranks(self, block: int) -> bool:
        """Whether a cell of this size can hold elements of several ranks."""
        if self.split is None or block == 1:
            return False
        return block == WHOLE or not self.aligned

    def runs(self, block: int) -> list[tuple[int, int, int]]:
        """The local stretches [start, end) whose elements share one cell, with that cell."""
        if block == WHOLE or self.size == 0:
            return [(0, self.size, 0)]
        ids = self.cells(block)[0]
        if ids is None:
            return [(i, i + 1, i) for i in range(self.size)]
        cuts = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
        edges = [0, *cuts, self.size]
        return [(s, e, int(ids[s])) for s, e in zip(edges[:-1], edges[1:])]


@dataclass
class Quantized:
    """An operand in fp8: `data` [R, C], `scale` [cells along R, cells along C] (fp32), and
    the cell of each row and column (`rows`, `cols`: long tensors on data's device, or None
    where the scale's row i is row i, or its one row serves all)."""

    data: Tensor
    scale: Tensor
    rows: Tensor | None = None
    cols: Tensor | None = None

    def t(self) -> "Quantized":
        return Quantized(self.data.t(), self.scale.t(), self.cols, self.rows)

    def scales(self) -> Tensor:
        """The scale of every element, broadcastable to [R, C] (fp32)."""
        s = self.scale if self.rows is None else self.scale.index_select(0, self.rows)
        return s if self.cols is None else s.index_select(1, self.cols)

    def dequantized(self, dtype: torch.dtype = torch.float64) -> Tensor:
        return self.data.to(dtype) * self.scales().to(dtype)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


def _cell_max(a: Tensor, ids: Tensor | None, n: int, dim: int) -> Tensor:
    """The maximum of `a` (≥ 0) over the elements of each cell along `dim`."""
    if n == 1:
        return a.amax(dim, keepdim=True)
    if ids is None:
        return a
    shape = list(a.shape)
    shape[dim] = n
    index = ids.to(a.device).view([-1 if d == dim else 1 for d in range(a.dim())]).expand_as(a)
    return a.new_zeros(shape).scatter_reduce_(dim, index, a, "amax")


def amax_to_scale(amax: Tensor, fmt: torch.dtype, pow2: bool = False) -> Tensor:
    """amax / fmax in fp32 (floored, so a zero cell divides by a tiny number, not zero);
    `pow2` rounds it up to a power of two, so scaling is exact and still never overflows."""
    scale = amax.float().clamp_min(AMAX_FLOOR) / FMAX[fmt]
    if not pow2:
        return scale
    mantissa, exponent = torch.frexp(scale)  # scale = m·2^e, m in [0.5, 1): exact on every device
    return torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent.dtype))


def cell_amax(x: Tensor, dims: tuple[Dim, Dim], blocks: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """(amax of |x| per cell, reduced over the ranks a cell spans; row cells; column cells)."""
    (rows, nr), (cols, nc) = dims[0].cells(blocks[0]), dims[1].cells(blocks[1])
    a = x.detach().abs()
    a = a if a.dtype == torch.float64 else a.float()
    amax = _cell_max(_cell_max(a, cols, nc, 1), rows, nr, 0)
    for d, block in zip(dims, blocks):
        if d.spans_ranks(block):
            d.split.max_(amax)
    return amax, rows, cols


def quantize(x: Tensor, dims: tuple[Dim, Dim], blocks: tuple[int, int], fmt: torch.dtype = E4M3,
             pow2: bool = False) -> Quantized:
    """x [R, C] in fp8 with one scale per cell (module docstring)."""
    amax, rows, cols = cell_amax(x, dims, blocks)
    scale = amax_to_scale(amax, fmt, pow2)
    on = (lambda ids: None if ids is None else ids.to(x.device))  # noqa: E731
    q = Quantized(x.new_empty(0, dtype=fmt), scale, on(rows), on(cols))
    wide = x if x.dtype == torch.float64 else x.float()
    fmax = FMAX[fmt]
    q.data = (wide / q.scales().to(wide.dtype)).clamp_(-fmax, fmax).to(fmt)
    return q


def quantize_with(x: Tensor, scale: Tensor, fmt: torch.dtype = E4M3) -> Tensor:
    """x in fp8 under one given scale (a 0-d fp32 tensor): a shard of a tensor whose amax
    was reduced elsewhere (the fp8 all-gather of ZeRO-3)."""
    wide = x if x.dtype == torch.float64 else x.float()
    return (wide / scale.to(wide.dtype)).clamp_(-FMAX[fmt], FMAX[fmt]).to(fmt)


# ---------------------------------------------------------------------------------------
# The scaled matmul


def _cuda_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def choose_backend(device: torch.device, dtype: torch.dtype, runs: int) -> str:
    """fp64 operands: the exact emulation (CPU proofs). CUDA sm89+: `_scaled_mm`. CPU:
    `_scaled_mm` for one run (tensorwise, rowwise), the fp32 emulation for several."""
    if dtype == torch.float64:
        return "fp64"
    if device.type == "cuda":
        return "scaled_mm" if _cuda_fp8(device) else "emulate"
    return "scaled_mm" if runs == 1 else "emulate"


def _run_scales(q: Quantized, cell: int) -> Tensor:
    """The scales of a run (one cell along K) for every row of q, [R] fp32."""
    s = q.scale[:, cell]
    if q.rows is not None:
        return s.index_select(0, q.rows)
    return s.expand(q.data.shape[0]) if s.numel() == 1 else s


def _mm_fits(a: Tensor, b: Tensor) -> bool:
    """cuBLAS fp8 needs every dimension a multiple of 16 (the CPU kernel takes any)."""
    return not a.is_cuda or (a.shape[0] % 16 == 0 and a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0)


def _scaled_mm(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a [M, k] · b [N, k]ᵀ with scales (0-d: tensorwise; [M, 1] and [1, N]: rowwise). The
    second operand goes in column-major, as cuBLAS wants it."""
    return torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def _one_run_scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> Tensor | None:
    """A single-run product in one `_scaled_mm` call, or None where this torch/device cannot:
    on CUDA, rowwise scaling writes bf16 only, and e5m2 operands need tensorwise scales."""
    tensorwise = a.scale.numel() == 1 and b.scale.numel() == 1
    if tensorwise:
        return _scaled_mm(a.data, b.data, a.scale.reshape(()), b.scale.reshape(()), out_dtype)
    e4m3 = a.data.dtype == E4M3 and b.data.dtype == E4M3
    if a.data.is_cuda and (out_dtype != torch.bfloat16 or not e4m3):
        return None
    sa, sb = _run_scales(a, 0)[:, None].contiguous(), _run_scales(b, 0)[None, :].contiguous()
    return _scaled_mm(a.data, b.data, sa, sb, out_dtype)


def scaled_matmul(a: Quantized, b: Quantized, runs: list[tuple[int, int, int]], out_dtype: torch.dtype,
                  backend: str | None = None) -> Tensor:
    """a·bᵀ [M, N] from a [M, K] and b [N, K] quantized with the same cells along K, whose
    local runs are `runs` (start, end, cell: Dim.runs); in `out_dtype`. Accumulation in fp32 (fp64 for "fp64")."""
    backend = backend or choose_backend(a.data.device, out_dtype, len(runs))
    if backend == "scaled_mm" and not _mm_fits(a.data, b.data):
        backend = "emulate"
    if backend == "scaled_mm" and len(runs) == 1:
        out = _one_run_scaled_mm(a, b, out_dtype)
        if out is not None:
            return out
    acc = torch.float64 if backend == "fp64" else torch.float32
    out = torch.zeros(a.data.shape[0], b.data.shape[0], dtype=acc, device=a.data.device)
    one = torch.ones((), device=a.data.device)
    for start, end, cell in runs:
        if end == start:
            continue
        pa, pb = a.data[:, start:end], b.data[:, start:end]
        if backend == "scaled_mm":
            part = _scaled_mm(pa, pb, one, one, torch.float32)
        else:
            part = pa.to(acc) @ pb.to(acc).t()
        out.addcmul_(part, _run_scales(a, cell).to(acc)[:, None] * _run_scales(b, cell).to(acc)[None, :])
    return out.to(out_dtype)
