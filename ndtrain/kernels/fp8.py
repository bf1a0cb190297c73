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
Every back end (`choose`, below) multiplies the same fp8 values by the same scales:
- "fp64": the run's products in fp64 from the fp8 values (exact: fp8·fp8 fits any float);
  the CPU layout proofs, where two layouts then differ only by fp64 summation order.
- "emulate": the same in fp32, the CPU's blockwise, and on CUDA the last resort.
- "scaled_mm": one `torch._scaled_mm` call with the scales: tensorwise (sm89+), rowwise
  (sm90+) and, on sm90, blockwise with torch's 1×128 · 128×128 and 1×128 · 1×128 scalings.
- "scaled_mm_runs": one `_scaled_mm` per 128-run with unit scales and fp32 output, scaled and
  summed in fp32: blockwise where a shard cuts the 128-blocks, or on sm89.
A CUDA product that runs anything but one `_scaled_mm` warns once per reason.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
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
    whole runs of this many elements at multiples of it (0: unknown), so a block that divides
    it never spans ranks (the same answer on every rank)."""

    size: int
    full: int
    offset: int = 0
    index: Tensor | None = field(default=None, compare=False)
    split: MaxReducer | None = field(default=None, compare=False)
    aligned: int = 0

    @staticmethod
    def whole(n: int) -> "Dim":
        return Dim(n, n)

    def global_index(self, device: torch.device | None = None) -> Tensor:
        if self.index is not None:
            return self.index.to(device) if device is not None else self.index
        return torch.arange(self.offset, self.offset + self.size, device=device)

    def cells(self, block: int, device: torch.device | None = None) -> tuple[Tensor | None, int]:
        """(the cell of each local element, a long tensor on `device` (CPU by default), or
        None where cell i is element i or the one cell is all of them; the number of cells)."""
        if block == WHOLE:
            return None, 1
        if block == 1:
            return None, self.size
        return self.global_index(device) // block, -(-self.full // block)

    def whole_cells(self, block: int) -> slice | None:
        """The cells this rank holds, as a slice of the dimension's cells, where its elements
        are whole cells in order (no permutation, every cell entirely here); else None. From
        Python ints only, so a compiled step has nothing to read back."""
        if block == WHOLE:
            return slice(0, 1) if self.size == self.full else None
        if block == 1:
            return slice(0, self.size) if self.index is None else None
        if self.index is not None or self.offset % block or (self.size % block and self.offset + self.size != self.full):
            return None
        return slice(self.offset // block, -(-(self.offset + self.size) // block))

    def alone(self) -> "Dim":
        """This dimension with no ranks to reduce over, its runs of 128 read (for the fake-tensor
        prediction of the back ends, which can neither communicate nor read an index back)."""
        out = replace(self, split=None)
        if self.index is not None:
            object.__setattr__(out, "_runs", (BLOCK, self.runs(BLOCK)))
        return out

    def spans_ranks(self, block: int) -> bool:
        """Whether a cell of this size can hold elements of several ranks."""
        if self.split is None or block == 1:
            return False
        return block == WHOLE or not self.aligned or self.aligned % block != 0

    def runs(self, block: int) -> list[tuple[int, int, int]]:
        """The local stretches [start, end) whose elements share one cell, with that cell.
        Computed from Python ints where the indices are contiguous (no device read-back, so
        torch.compile keeps one graph); a permuted dimension (context parallelism's tokens)
        reads its index tensor once and keeps the answer."""
        if block == WHOLE or self.size == 0:
            return [(0, self.size, 0)]
        if block == 1:
            return [(i, i + 1, i) for i in range(self.size)]
        if self.index is None:
            out, start = [], 0
            while start < self.size:
                cell = (self.offset + start) // block
                end = min(self.size, (cell + 1) * block - self.offset)
                out.append((start, end, cell))
                start = end
            return out
        cached = self.__dict__.get("_runs")
        if cached is None or cached[0] != block:
            ids = self.index // block
            cuts = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
            edges = [0, *cuts, self.size]
            cached = (block, [(s, e, int(ids[s])) for s, e in zip(edges[:-1], edges[1:])])
            object.__setattr__(self, "_runs", cached)
        return cached[1]


@dataclass
class Quantized:
    """An operand in fp8: `data` [R, C], `scale` [cells along R, cells along C] (fp32), and
    the cell of each row and column (`rows`, `cols`: long tensors on data's device, or None
    where the scale's row i is row i, or its one row serves all). `local`: for rows and
    columns, the slice of the scale's cells that this rank's elements fill whole and in order
    (Dim.whole_cells), or None; what a native blockwise `_scaled_mm` needs to take the scale
    as it is."""

    data: Tensor
    scale: Tensor
    rows: Tensor | None = None
    cols: Tensor | None = None
    local: tuple[slice | None, slice | None] = (None, None)
    # The micro-scaled formats (kernels/mx.py): "mxfp8" (E8M0 block scales) or "nvfp4" (E2M1
    # values held exactly in E4M3, E4M3 block scales, and `outer`, the per-tensor fp32 scale).
    kind: str = "fp8"
    outer: Tensor | None = None

    def t(self) -> "Quantized":
        return Quantized(self.data.t(), self.scale.t(), self.cols, self.rows, self.local[::-1], self.kind, self.outer)

    def scales(self) -> Tensor:
        """The scale of every element, broadcastable to [R, C] (fp32)."""
        s = self.scale if self.rows is None else self.scale.index_select(0, self.rows)
        return s if self.cols is None else s.index_select(1, self.cols)

    def dequantized(self, dtype: torch.dtype = torch.float64) -> Tensor:
        out = self.data.to(dtype) * self.scales().to(dtype)
        return out if self.outer is None else out * self.outer.to(dtype)

    def nbytes(self) -> int:
        """Bytes of the hardware format: fp8 values and fp32 scales; MXFP8's scales are one
        byte (E8M0); NVFP4's values half a byte (E2M1), its scales one (E4M3), plus 4."""
        if self.kind == "fp8":
            return self.data.numel() * self.data.element_size() + self.scale.numel() * 4
        values = self.data.numel() // 2 if self.kind == "nvfp4" else self.data.numel()
        return values + self.scale.numel() + (4 if self.outer is not None else 0)


def _cell_max(a: Tensor, ids: Tensor | None, n: int, dim: int, whole: slice | None, block: int) -> Tensor:
    """The maximum of `a` (≥ 0) over the elements of each cell along `dim`; 0 for a cell
    with no element here. Whole cells in order take a reshape (what compiles and runs fast);
    others a scatter by cell index."""
    if n == 1:
        return a.amax(dim, keepdim=True)
    if ids is None:
        return a
    shape = list(a.shape)
    shape[dim] = n
    if whole is not None and a.shape[dim] % block == 0:
        local = a.unflatten(dim, (a.shape[dim] // block, block)).amax(dim + 1)
        pad = [0, 0] * (a.dim() - 1 - dim) + [whole.start, n - whole.stop]  # the other ranks' cells: 0
        return torch.nn.functional.pad(local, pad) if any(pad) else local
    index = ids.view([-1 if d == dim else 1 for d in range(a.dim())]).expand_as(a)
    return a.new_zeros(shape).scatter_reduce_(dim, index, a, "amax")


def row_major(t: Tensor) -> Tensor:
    """`t.contiguous()`, by `clone`. The fake-tensor checks of the CUDA calls
    (tests/test_cuda_meta_fp8.py) run on CPU-only torch, where a fake CUDA tensor can be
    cloned, narrowed and unsqueezed but not copied into nor indexed with []: the code they
    run uses those forms."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def column_major(t: Tensor) -> Tensor:
    """A 2-D `t` laid column-major: its transpose contiguous, transposed back."""
    return row_major(t.t()).t()


def amax_to_scale(amax: Tensor, fmt: torch.dtype, pow2: bool = False) -> Tensor:
    """amax / fmax in fp32 (floored, so a zero cell divides by a tiny number, not zero);
    `pow2` rounds it up to a power of two, so scaling is exact and still never overflows.
    fmax is a tensor on amax's device, not a Python number: CUDA divides by a host scalar as a
    multiplication by its reciprocal, one ulp off the CPU's division (seen on an H200: the
    scales, then 8 fp8 values of 16,384, differed from the CPU's)."""
    fmax = torch.full((), FMAX[fmt], dtype=torch.float32, device=amax.device)
    scale = torch.div(amax.float().clamp_min(AMAX_FLOOR), fmax)
    if not pow2:
        return scale
    mantissa, exponent = torch.frexp(scale)  # scale = m·2^e, m in [0.5, 1): exact on every device
    return torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent.dtype))


def cell_amax(x: Tensor, dims: tuple[Dim, Dim], blocks: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """(amax of |x| per cell, reduced over the ranks a cell spans; row cells; column cells)."""
    (rows, nr), (cols, nc) = dims[0].cells(blocks[0], x.device), dims[1].cells(blocks[1], x.device)
    a = x.detach().abs()
    a = a if a.dtype == torch.float64 else a.float()
    a = _cell_max(a, cols, nc, 1, dims[1].whole_cells(blocks[1]), blocks[1])
    amax = _cell_max(a, rows, nr, 0, dims[0].whole_cells(blocks[0]), blocks[0])
    for d, block in zip(dims, blocks):
        if d.spans_ranks(block):
            d.split.max_(amax)
    return amax, rows, cols


def quantize(x: Tensor, dims: tuple[Dim, Dim], blocks: tuple[int, int], fmt: torch.dtype = E4M3,
             pow2: bool = False) -> Quantized:
    """x [R, C] in fp8 with one scale per cell (module docstring)."""
    amax, rows, cols = cell_amax(x, dims, blocks)
    scale = amax_to_scale(amax, fmt, pow2)
    local = (dims[0].whole_cells(blocks[0]), dims[1].whole_cells(blocks[1]))
    q = Quantized(x.new_empty(0, dtype=fmt), scale, rows, cols, local)
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
#
# Back ends ("backend"), and where each runs:
#   "fp64"            fp64 products of the fp8 values, accumulated in fp64 (the CPU proofs)
#   "emulate"         the same in fp32: the CPU's blockwise; on CUDA only where no fp8 kernel can
#   "scaled_mm"       one torch._scaled_mm call with the scales (tensorwise, rowwise, and on
#                     sm90 blockwise 1×128·128×128 or 1×128·1×128)
#   "scaled_mm_runs"  one _scaled_mm per 128-run with unit scales and fp32 output, scaled and
#                     summed in fp32: blockwise (or rowwise) where the one-call kernel can't
# A CUDA product that does not get "scaled_mm" warns once per reason (warn_fallback).

SCALED_MM_SM = {"tensorwise": (8, 9), "rowwise": (9, 0), "blockwise": (9, 0)}  # torch's fp8 kernels per scaling
_WARNED: set[str] = set()


def _cpu_takes_rowwise() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes a scale per row (torch 2.13's does; 2.11's
    CPU kernel is tensorwise only and fails an internal assert). Asked once, at import: a
    compiled graph cannot trace the try."""
    a = torch.zeros(16, 16, dtype=E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


CPU_ROWWISE = _cpu_takes_rowwise()


def device_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability: the one place the fp8 code asks (the fake-tensor
    checks on a CPU patch it)."""
    return torch.cuda.get_device_capability(device)


def scaling_of(a: Quantized, b: Quantized, runs: list) -> str:
    """Which of torch's scalings a product's operands need: one scale each, one run of cells
    along K (a scale per row), or several (blockwise)."""
    if a.scale.numel() == 1 and b.scale.numel() == 1:
        return "tensorwise"
    return "rowwise" if len(runs) == 1 else "blockwise"


@dataclass(frozen=True)
class Choice:
    backend: str
    why: str | None = None  # why a CUDA product runs slower than one fp8 call (warned once)


def _native_blockwise(a: Quantized, b: Quantized, runs: list, out_dtype: torch.dtype) -> str | None:
    """None where torch's one-call blockwise `_scaled_mm` takes this product (sm90: 1×128 ·
    128×128 or 1×128 · 1×128, measured on an H200, docs/benchmarks-gpu.md); else why not."""
    if any(e - s != BLOCK for s, e, _ in runs):
        return ("not every 128-run of the reduction is whole: a block is cut by a shard (tensor- or context-parallel) "
                "or the length is not a multiple of 128")
    if any(c != runs[0][2] + i for i, (_, _, c) in enumerate(runs)):
        return "the reduction's 128-blocks are not in order on this rank (context parallelism's zigzag tokens)"
    if a.rows is not None or a.local[1] is None or b.local[1] is None:
        return "the operands' 128-cells are not whole and in order on this rank"
    if b.rows is not None and (b.local[0] is None or b.data.shape[0] % BLOCK):
        return "the 128×128 weight blocks are cut by a shard along the product's output"
    if out_dtype != torch.bfloat16:
        return "torch's blockwise _scaled_mm was measured with bf16 output only"
    return None


def choose(a: Quantized, b: Quantized, runs: list, out_dtype: torch.dtype, backend: str | None = None) -> Choice:
    """The back end of a·bᵀ (see above). `backend` forces one ("fp64", "emulate"; "scaled_mm"
    still runs per 128-run where one call cannot). On the CPU: `_scaled_mm` for tensorwise and
    rowwise (its CPU kernel; the emulation where this torch's takes no rowwise scales), the
    emulation for blockwise (the CPU kernel has no block scales)."""
    if backend in ("fp64", "emulate"):
        return Choice(backend)
    if backend is None and out_dtype == torch.float64:
        return Choice("fp64")
    kind, device = scaling_of(a, b, runs), a.data.device
    if device.type != "cuda":
        if kind == "blockwise" or (kind == "rowwise" and not CPU_ROWWISE):
            return Choice("scaled_mm_runs" if backend == "scaled_mm" else "emulate")
        return Choice("scaled_mm")
    cap = device_capability(device)
    k, n = a.data.shape[1], b.data.shape[0]
    if cap < SCALED_MM_SM["tensorwise"]:
        return Choice("emulate", f"sm{cap[0]}{cap[1]} has no fp8 tensor cores")
    if k % 16 or n % 16:
        return Choice("emulate", f"cuBLAS fp8 needs K and N multiples of 16 (K={k}, N={n})")
    if kind == "tensorwise":
        return Choice("scaled_mm")
    if cap < SCALED_MM_SM[kind]:
        why = f"{kind} _scaled_mm needs sm90, this GPU is sm{cap[0]}{cap[1]}"
    elif kind == "rowwise":
        e4m3 = a.data.dtype == E4M3 and b.data.dtype == E4M3
        why = None if out_dtype == torch.bfloat16 and e4m3 else "rowwise _scaled_mm writes bf16 from E4M3 only"
    else:
        why = _native_blockwise(a, b, runs, out_dtype)
    if why is None:
        return Choice("scaled_mm")
    if any((e - s) % 16 for s, e, _ in runs):
        return Choice("emulate", why + "; and a run is not a multiple of 16 wide, so no fp8 kernel takes it")
    return Choice("scaled_mm_runs", why)


def warn_once(why: str, text: str | None = None, topic: str = "fp8") -> None:
    """`text` (default: `why`) as one warning line about `topic`, the first time `why` comes
    up: a slower kernel than the fast path is never silent."""
    if why in _WARNED:
        return
    _WARNED.add(why)
    warnings.warn(f"ndtrain: {topic} {text or why}", RuntimeWarning, stacklevel=3)


def warn_fallback(choice: Choice, a: Quantized, b: Quantized, kind: str) -> None:
    """One line, once per reason: a CUDA product that runs slower than one fp8 call."""
    if choice.why is None:
        return
    m, k, n = a.data.shape[0], a.data.shape[1], b.data.shape[0]
    how = {"emulate": "the fp32 emulation (fp8 values widened to fp32, one matmul per 128-run)",
           "scaled_mm_runs": "one _scaled_mm per 128-run with unit scales, scaled and summed in fp32"}[choice.backend]
    warn_once(choice.why, f"{kind} product [{m}×{k}]·[{k}×{n}] runs {how}: {choice.why}")


def _run_scales(q: Quantized, cell: int) -> Tensor:
    """The scales of a run (one cell along K) for every row of q, [R] fp32."""
    s = q.scale.select(1, cell)
    if q.rows is not None:
        return s.index_select(0, q.rows)
    return s.expand(q.data.shape[0]) if s.numel() == 1 else s


def _scaled_mm(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a [M, k] · b [N, k]ᵀ: a goes in row-major, b column-major (cuBLAS's TN form)."""
    return torch._scaled_mm(row_major(a), column_major(b.t()), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def _one_call(a: Quantized, b: Quantized, runs: list, out_dtype: torch.dtype) -> Tensor:
    """The product in one `_scaled_mm`, with the scales laid as torch's kernels take them:
    tensorwise 0-d; rowwise [M, 1] and [1, N]; blockwise scale_a [M, K/128] column-major and
    scale_b [K/128, N/128] column-major (b in 128×128 blocks) or [K/128, N] row-major (b in
    1×128 tiles)."""
    if a.scale.numel() == 1 and b.scale.numel() == 1:
        return _scaled_mm(a.data, b.data, a.scale.reshape(()), b.scale.reshape(()), out_dtype)
    if len(runs) == 1:
        sa, sb = row_major(_run_scales(a, runs[0][2]).unsqueeze(1)), row_major(_run_scales(b, runs[0][2]).unsqueeze(0))
        return _scaled_mm(a.data, b.data, sa, sb, out_dtype)
    first, cells = runs[0][2], len(runs)
    sa = column_major(a.scale.narrow(1, first, cells))
    sb = b.scale.narrow(1, first, cells)
    if b.rows is None:  # b in 1×128 tiles: [K/128, N] row-major
        sb = row_major(sb.t())
    else:  # b in 128×128 blocks: [K/128, N/128] column-major
        n = b.local[0]
        sb = column_major(sb.narrow(0, n.start, n.stop - n.start).t())
    return _scaled_mm(a.data, b.data, sa, sb, out_dtype)


def scaled_matmul(a: Quantized, b: Quantized, runs: list[tuple[int, int, int]], out_dtype: torch.dtype,
                  backend: str | None = None, used: dict[str, str] | None = None, key: str = "") -> Tensor:
    """a·bᵀ [M, N] from a [M, K] and b [N, K] quantized with the same cells along K, whose
    local runs are `runs` (start, end, cell: Dim.runs); in `out_dtype`. Accumulation in fp32
    (fp64 for "fp64"). `used[key]` records the back end that ran."""
    choice = choose(a, b, runs, out_dtype, backend)
    if not torch.compiler.is_compiling():  # a traced graph may not touch Python state (predict_backends does)
        warn_fallback(choice, a, b, scaling_of(a, b, runs))
        if used is not None:
            used[key] = choice.backend
    if choice.backend == "scaled_mm":
        return _one_call(a, b, runs, out_dtype)
    acc = torch.float64 if choice.backend == "fp64" else torch.float32
    out = torch.zeros(a.data.shape[0], b.data.shape[0], dtype=acc, device=a.data.device)
    one = torch.ones((), device=a.data.device)
    for start, end, cell in runs:
        if end == start:
            continue
        pa, pb = a.data.narrow(1, start, end - start), b.data.narrow(1, start, end - start)
        if choice.backend == "scaled_mm_runs":
            part = _scaled_mm(pa, pb, one, one, torch.float32)
        else:
            part = pa.to(acc) @ pb.to(acc).t()
        out.addcmul_(part, _run_scales(a, cell).to(acc).unsqueeze(1) * _run_scales(b, cell).to(acc).unsqueeze(0))
    # a copy even in the accumulator's dtype: returned from an autograd.Function's forward,
    # `out` itself (an intermediate, `.to` a no-op) got a zero gradient under torch 2.11's
    # torch.compile (the backward traced with zeros for dy); 2.13 is right either way
    return out.to(out_dtype, copy=True)
