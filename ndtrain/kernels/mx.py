"""The micro-scaled formats of Blackwell GPUs, bit for bit, on any device: MXFP8 and NVFP4.

    MXFP8   E4M3 values in blocks of 32 along a matmul's reduction, each block with one
            power-of-two scale stored as E8M0 (an 8-bit exponent, 2^-127 .. 2^127). The scale
            is 2^ceil(log2(amax / 448)) (RCEIL, the rounding of NVIDIA's MXFP8 recipe and
            torchao's `mxfp8_rceil`): the largest value lands at or below 448, never saturates.
    NVFP4   E2M1 values (0, ±0.5, 1, 1.5, 2, 3, 4, 6) in blocks of 16, each block with an E4M3
            scale, and one fp32 scale per tensor (arXiv 2509.25149, Transformer Engine):
            outer = amax(tensor) / (6 · 448); block = E4M3(amax(block) / 6 / outer), saturated
            at 448; value = E2M1(x / (block · outer)), round to nearest even, or stochastic.

Blocks are cells of kernels/fp8.py (a `Dim`'s global indices cut every 32 or 16 elements), so
a shard cuts them where one process does; a block spans ranks only where a shard is not a
multiple of the block, and then (as NVFP4's per-tensor amax always) its amax is reduced over
them. An E2M1 value is held exactly in a float8_e4m3fn tensor (every E2M1 value is an E4M3
value); `pack_e2m1` packs two per byte as torch.float4_e2m1fn_x2 for the hardware.

The product (`scaled_matmul`): a value times its block scale is exact in fp32 (E4M3 · 2^k;
E2M1 · E4M3 has 6 significant bits), so the emulation dequantizes both operands exactly,
multiplies them in fp32 ("emulate") or fp64 ("fp64", the CPU proofs), and multiplies NVFP4's
result by the two per-tensor scales. A block-scaled tensor core sums the same exact products
in its own order. On CUDA sm100 the product is one `torch.nn.functional.scaled_mm` call
(`blackwell`), whose scales are laid in cuBLAS's swizzled 128×4 tiles; elsewhere on CUDA the
emulation runs and says so once. MXFP8 routed experts on sm100: kernels/mx_experts.py.
"""

from __future__ import annotations

import functools
import zlib

import torch
from torch import Tensor

from ndtrain.kernels.fp8 import (AMAX_FLOOR, E4M3, WHOLE, Dim, Quantized, amax_to_scale, cell_amax, row_major,
                                 warn_once)

MX_BLOCK, NV_BLOCK = 32, 16
E2M1_MAX, E4M3_MAX = 6.0, 448.0
E8M0_MIN, E8M0_MAX = 2.0 ** -127, 2.0 ** 127
BLACKWELL = (10, 0)


def e8m0_scale(amax: Tensor) -> Tensor:
    """RCEIL: 2^ceil(log2(amax / 448)) in fp32, within E8M0's range."""
    return amax_to_scale(amax, E4M3, pow2=True).clamp_(E8M0_MIN, E8M0_MAX)


E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_e2m1(v: Tensor, u: Tensor | None = None) -> Tensor:
    """v (already scaled) on E2M1's grid, saturated at ±6: to nearest, ties to even (`u` None),
    or stochastically: up with probability (|v| − lower) / (upper − lower), given `u` uniform
    in [0, 1). The grid is evenly spaced within each binade: steps of 1/2 below 2, of 1 below
    4, of 2 up to 6, so a magnitude over its step is rounded as an integer (every operation
    exact: a division by a power of two), and an even multiple of the step is the code with
    mantissa bit 0 (0, 1, 2, 4), the tie's choice, which is torch.round's half-to-even."""
    a = v.abs().clamp_(max=E2M1_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(a.dtype)
    if u is None:
        out = torch.round(a / step) * step
    else:
        low = torch.floor(a / step) * step
        out = torch.where(u.to(a.dtype) * step < a - low, low + step, low)
    return torch.copysign(out, v)


def quantize_mx(x: Tensor, dims: tuple[Dim, Dim], blocks: tuple[int, int]) -> Quantized:
    """x [R, C] in MXFP8: E4M3 values, one E8M0 scale per block (RCEIL)."""
    amax, rows, cols = cell_amax(x, dims, blocks)
    scale = e8m0_scale(amax)
    q = Quantized(x.new_empty(0, dtype=E4M3), scale, rows, cols, _local(dims, blocks), "mxfp8")
    wide = x if x.dtype == torch.float64 else x.float()
    q.data = (wide / q.scales().to(wide.dtype)).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q


def quantize_nv(x: Tensor, dims: tuple[Dim, Dim], blocks: tuple[int, int], u: Tensor | None = None) -> Quantized:
    """x [R, C] in NVFP4: E2M1 values (held in E4M3), E4M3 block scales, an fp32 tensor scale;
    stochastic rounding where `u` (uniform [0, 1), x's shape) is given."""
    tensor_amax = cell_amax(x, dims, (WHOLE, WHOLE))[0].float().clamp_min(AMAX_FLOOR)
    outer = torch.div(tensor_amax, torch.full((), E2M1_MAX * E4M3_MAX, device=x.device)).reshape(())
    amax, rows, cols = cell_amax(x, dims, blocks)
    block = torch.div(torch.div(amax.float(), torch.full((), E2M1_MAX, device=x.device)), outer)
    scale = block.clamp_(max=E4M3_MAX).to(E4M3).float()
    q = Quantized(x.new_empty(0, dtype=E4M3), scale, rows, cols, _local(dims, blocks), "nvfp4", outer)
    wide = x if x.dtype == torch.float64 else x.float()
    denom = q.scales().to(wide.dtype) * outer.to(wide.dtype)
    v = torch.where(denom > 0, wide / torch.where(denom > 0, denom, 1), 0)  # a block whose scale underflows E4M3: 0
    q.data = round_e2m1(v, u).to(E4M3)
    return q


def _local(dims: tuple[Dim, Dim], blocks: tuple[int, int]) -> tuple:
    return dims[0].whole_cells(blocks[0]), dims[1].whole_cells(blocks[1])


# -- Stochastic rounding's random numbers ---------------------------------------------------

_M = 0xFFFFFFFF


def _mix(h: Tensor) -> Tensor:
    """A 32-bit integer hash (hash-prospector's two-multiply finaliser) in int64 arithmetic
    that never overflows, so every device computes the same bits."""
    h = h ^ (h >> 16)
    h = (h * 0x21F0AAAD) & _M
    h = h ^ (h >> 15)
    h = (h * 0x735A2D97) & _M
    return h ^ (h >> 15)


def stream_key(*parts) -> int:
    """A 32-bit key from the names and numbers that identify a stream of random numbers."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def uniform(key: int, first_token: int, tokens: Dim, features: Dim, device: torch.device) -> Tensor:
    """[tokens, features] uniform numbers in [0, 1) (24 bits each, fp32), each a function of
    `key`, its token's global index (`first_token` + the token's index in its micro-batch) and
    its feature's global index only: the same number wherever a layout puts the element."""
    t = tokens.global_index(device) + first_token
    f = features.global_index(device)
    h = _mix(((t * features.full)[:, None] + f[None, :]) & _M ^ (key & _M))  # the element's index, 32 bits
    return (h >> 8).float() * 2.0 ** -24


# -- The random Hadamard transform ----------------------------------------------------------

@functools.lru_cache(maxsize=16)
def hadamard(n: int, key: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The n×n random Hadamard matrix H·diag(signs) / sqrt(n) (orthonormal: its transpose
    undoes it), signs from `key`. Entries ±1/4 for n = 16: exact in every float."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    bits = _mix(torch.full((n,), key & _M, dtype=torch.int64) ^ torch.arange(n)) & 1
    signs = 1.0 - 2.0 * bits.double()
    return (h * signs[None, :] / n ** 0.5).to(dtype=dtype, device=device)


def transform_tokens(x: Tensor, h: Tensor) -> Tensor:
    """x [T, C] with each run of n = len(h) consecutive tokens (rows) multiplied by h, the last
    run padded with zero rows: [ceil(T / n)·n, C]. For dW = dyᵀ·x over tokens, (H·dy)ᵀ(H·x)
    = dyᵀ·x, since HᵀH = I, while quantization sees each run spread evenly."""
    n, (t, c) = h.shape[0], x.shape
    pad = -t % n
    if pad:
        x = torch.cat([x, x.new_zeros(pad, c)])
    return torch.einsum("ij,gjc->gic", h.to(x.dtype), x.view(-1, n, c)).reshape(-1, c)


# -- The product ------------------------------------------------------------------------------

def scaled_matmul(a: Quantized, b: Quantized, out_dtype: torch.dtype, backend: str | None = None,
                  used: dict[str, str] | None = None, key: str = "") -> Tensor:
    """a·bᵀ [M, N] from a [M, K] and b [N, K] in one micro-scaled format with the same blocks
    along K (module docstring); `used[key]` records the back end that ran."""
    device = a.data.device
    if backend is None:
        backend = "fp64" if out_dtype == torch.float64 else "emulate"
        if device.type == "cuda" and blackwell_ok(a, b, device):
            backend = "scaled_mm"
    if not torch.compiler.is_compiling() and used is not None:
        used[key] = backend
    if backend == "scaled_mm":
        return blackwell(a, b, out_dtype)
    acc = torch.float64 if backend == "fp64" else torch.float32
    out = (a.data.to(acc) * a.scales().to(acc)) @ (b.data.to(acc) * b.scales().to(acc)).t()  # exact operands
    if a.outer is not None:
        out = out * (a.outer.to(acc) * b.outer.to(acc))
    return out.to(out_dtype)


def blackwell_ok(a: Quantized, b: Quantized, device: torch.device) -> bool:
    """Whether sm100's block-scaled `scaled_mm` takes this product: 1×32 (MXFP8) or 1×16 (NVFP4)
    blocks along K on both operands, whole and in order on this rank, K a multiple of 32
    and N of 16; else the fp32 emulation runs, with one warning per reason."""
    from ndtrain.kernels import fp8 as kernels
    cap = kernels.device_capability(device)
    k, n = a.data.shape[1], b.data.shape[0]
    block = MX_BLOCK if a.kind == "mxfp8" else NV_BLOCK
    why = None
    if cap < BLACKWELL:
        why = f"{a.kind} needs sm100's block-scaled tensor cores, this GPU is sm{cap[0]}{cap[1]}"
    elif a.rows is not None or b.rows is not None or a.local[1] is None or b.local[1] is None:
        why = f"{a.kind} on sm100 takes 1×{block} blocks along K, whole and in order on this rank (2-D weight blocks or a shard-cut block are emulated)"
    elif k % 32 or n % 16:
        why = f"{a.kind} on sm100 needs K a multiple of 32 and N of 16 (K={k}, N={n})"
    if why is None:
        return True
    warn_once(why, f"{why}: the product runs the fp32 emulation", topic=a.kind)
    return False


def _swizzle(scale: Tensor) -> Tensor:
    """Block scales [R, C] in cuBLAS's layout for block-scaled operands: padded to R a multiple
    of 128 and C of 4, then each 128×4 tile laid as 32 rows of [4 row-groups × 4 columns]."""
    r, c = scale.shape
    padded = torch.nn.functional.pad(scale, (0, -c % 4, 0, -r % 128))
    rt, ct = padded.shape[0] // 128, padded.shape[1] // 4
    tiles = padded.view(rt, 4, 32, ct, 4).permute(0, 3, 2, 1, 4)
    return row_major(tiles).flatten()


def pack_e2m1(data: Tensor) -> Tensor:
    """E2M1 values (held in E4M3) [R, C] as torch.float4_e2m1fn_x2 [R, C/2]: each value's 4-bit
    code (sign, 2 exponent bits, 1 mantissa bit), the even column in the low nibble."""
    v = data.float()
    mag = v.abs()
    code = torch.bucketize(mag, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=v.device), right=False)
    code = code + 8 * (torch.signbit(v) & (mag > 0)).long()
    pairs = code.view(v.shape[0], -1, 2)
    low, high = pairs.select(2, 0), pairs.select(2, 1)
    return (low | (high << 4)).to(torch.uint8).view(torch.float4_e2m1fn_x2)


def blackwell(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> Tensor:
    """One sm100 `torch.nn.functional.scaled_mm`: MXFP8 with E4M3 values and swizzled
    float8_e8m0fnu scales (BlockWise1x32); NVFP4 with float4_e2m1fn_x2 values, swizzled
    float8_e4m3fn scales (BlockWise1x16), and the two tensor scales multiplied after."""
    from torch.nn.functional import ScalingType, SwizzleType
    F = torch.nn.functional
    swz = SwizzleType.SWIZZLE_32_4_4
    if a.kind == "mxfp8":
        sa, sb = (_swizzle(q.scale.to(torch.float8_e8m0fnu)) for q in (a, b))
        return F.scaled_mm(row_major(a.data), row_major(b.data).t(), sa, ScalingType.BlockWise1x32, sb,
                           ScalingType.BlockWise1x32, swizzle_a=swz, swizzle_b=swz, output_dtype=out_dtype)
    sa, sb = (_swizzle(q.scale.to(E4M3)) for q in (a, b))
    out = F.scaled_mm(pack_e2m1(a.data), pack_e2m1(b.data).t(), sa, ScalingType.BlockWise1x16, sb,
                      ScalingType.BlockWise1x16, swizzle_a=swz, swizzle_b=swz, output_dtype=torch.float32)
    return (out * (a.outer * b.outer)).to(out_dtype)
