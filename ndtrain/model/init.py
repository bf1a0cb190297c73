"""Initial weights as a function of (seed, parameter name, global element index).

Every element of a parameter's initial value is drawn from a counter-based generator
(Philox2x32-10, Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3") keyed by
the seed and the parameter's global name: the pair of elements 2j, 2j + 1 of the flattened
full tensor takes the two outputs of Philox(counter j) through Box–Muller (cos for 2j, sin
for 2j + 1). A rank therefore computes any element it keeps without drawing the others:
its tensor-parallel chunk, its experts, its ZeRO slice cost work proportional to their
size, on the device that keeps them, and equal one process's values bit for bit.

The integer arithmetic is exact on every device: 32-bit words live in int64 tensors and the
32×32 → 64-bit products of Philox are split into 16-bit halves, so no intermediate exceeds
2^49. Box–Muller runs in fp64 and is rounded to fp32 once; the CPU and CUDA libm may differ
in the last fp64 bit, so a CPU run and a GPU run agree to fp32 rounding, and runs on one
kind of device agree bit for bit.

The distribution is what it always was: normal, mean 0, the parameter's std (no truncation;
|z| < 6.7 because the uniform that feeds the logarithm is at least 2^-32); norm weights
start at a scale of 1, biases and attention sinks (gpt-oss) at 0.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .args import ModelArgs
from .lora import a_std

_MASK32 = 0xFFFFFFFF
_MUL = 0xD256D193  # Philox2x32's multiplier
_BUMP = 0x9E3779B9  # the key's increment per round (the golden ratio)
_MUL_LO, _MUL_HI = _MUL & 0xFFFF, _MUL >> 16
ROUNDS = 10
_CHUNK = 1 << 14  # pairs (or elements) per pass on the CPU: the temporaries stay in cache
# The most the generator holds beyond the values it returns, on the CPU (its int64 and fp64
# temporaries for one pass: about 72 bytes per pair; tests/test_init.py measures it).
WORKSPACE_BYTES = 128 * _CHUNK


def philox2x32(c0: Tensor, c1: Tensor, key: int) -> tuple[Tensor, Tensor]:
    """The two 32-bit output words of Philox2x32-10 for the counters (c0, c1) (32-bit words in
    int64 tensors, consumed) under the 32-bit `key`, as int64 tensors."""
    hi, t = torch.empty_like(c0), torch.empty_like(c0)
    for r in range(ROUNDS):
        k = (key + r * _BUMP) & _MASK32
        torch.mul(c0, _MUL_HI, out=hi)  # < 2^48
        torch.mul(c0, _MUL_LO, out=t)  # < 2^48
        t.add_((hi & 0xFFFF).bitwise_left_shift_(16))  # the product's low 48 bits, < 2^49
        hi.bitwise_right_shift_(16).add_(t >> 32)  # the product's high word
        hi.bitwise_xor_(c1).bitwise_xor_(k)
        old0, old1 = c0, c1
        c0, c1 = hi, t.bitwise_and_(_MASK32)
        hi, t = old0, old1
    return c0, c1


def _radius_angle(counter: Tensor, key: int) -> tuple[Tensor, Tensor]:
    w0, w1 = philox2x32(counter & _MASK32, counter >> 32, key)  # counter: int64 ≥ 0
    radius = w0.double().add_(1).mul_(2.0 ** -32).log_().mul_(-2).sqrt_()  # u in (0, 1]
    angle = w1.double().mul_(2 * math.pi * 2.0 ** -32)
    return radius, angle


def normal_range(key: int, start: int, n: int, device: torch.device | str = "cpu", out: Tensor | None = None) -> Tensor:
    """Standard normal values (fp32) of elements start .. start + n − 1 of the stream `key`
    (written into `out`, n fp32 elements, if given)."""
    out = torch.empty(n, dtype=torch.float32, device=device) if out is None else out
    first, last = start // 2, (start + n + 1) // 2  # the pairs that hold them
    chunk = _CHUNK if torch.device(device).type == "cpu" else 1 << 24
    for a in range(first, last, chunk):
        b = min(last, a + chunk)
        radius, angle = _radius_angle(torch.arange(a, b, device=device), key)
        pairs = torch.stack((radius * angle.cos(), radius * angle.sin()), 1).flatten().float()
        lo, hi = max(start, 2 * a), min(start + n, 2 * b)
        out[lo - start:hi - start] = pairs[lo - 2 * a:hi - 2 * a]
    return out


def normal_at(key: int, index: Tensor) -> Tensor:
    """Standard normal values (fp32) of the elements `index` (int64) of the stream `key`: the
    same values `normal_range` gives them."""
    out = torch.empty(index.shape, dtype=torch.float32, device=index.device)
    flat, dst = index.reshape(-1), out.view(-1)
    chunk = _CHUNK if index.device.type == "cpu" else 1 << 24
    for a in range(0, flat.numel(), chunk):
        part = flat[a:a + chunk]
        radius, angle = _radius_angle(part >> 1, key)
        dst[a:a + chunk] = torch.where((part & 1).bool(), angle.sin(), angle.cos()).mul_(radius).float()
    return out


@dataclass(frozen=True)
class Region:
    """Which part of a full tensor a rank's tensor holds: `shape` elements from `offset` on
    (per dimension). Elements beyond the full shape are padding (zeros)."""

    full: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @staticmethod
    def whole(shape: Sequence[int]) -> "Region":
        shape = tuple(shape)
        return Region(shape, (0,) * len(shape), shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def contiguous_start(self) -> int | None:
        """The global flat index of the first element if the region's in-range elements are
        one run of the full tensor (in order, followed only by padding), else None."""
        dims = len(self.full)
        k = next((d for d in range(dims) if self.shape[d] != 1), dims)
        if any(self.shape[d] != self.full[d] or self.offset[d] for d in range(k + 1, dims)):
            return None
        return sum(o * s for o, s in zip(self.offset, _strides(self.full)))

    def global_index(self, lo: int, hi: int, device: torch.device | str) -> Tensor:
        """The global flat index of the region's flat elements lo .. hi − 1 (−1: padding)."""
        j = torch.arange(lo, hi, device=device)
        index = torch.zeros_like(j)
        valid = torch.ones_like(j, dtype=torch.bool)
        for size, off, full, stride in zip(reversed(self.shape), reversed(self.offset), reversed(self.full),
                                           reversed(_strides(self.full))):
            coord = j % size + off
            j = j // size
            valid &= coord < full
            index += coord * stride
        return torch.where(valid, index, -1)

    def valid_run(self) -> int:
        """For a contiguous region: how many of its flat elements lie inside the full tensor."""
        d = next((d for d in range(len(self.full)) if self.shape[d] != 1), len(self.full))
        if d == len(self.full):
            return 1
        inner = math.prod(self.full[d + 1:])
        return max(0, min(self.shape[d], self.full[d] - self.offset[d])) * inner


def _strides(shape: Sequence[int]) -> list[int]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return out[::-1]


def init_std(name: str, args: ModelArgs) -> float:
    """Standard deviation of a weight's initial values (norm weights start at 1 instead).
    The projections that write into the residual stream are scaled down by depth, so the
    residual's variance does not grow with the number of layers (GPT-2)."""
    if name.endswith(".lora.a"):
        return a_std(name, args)
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        return 0.02 / math.sqrt(2 * args.n_layers)
    return 0.02


def stream_key(name: str, seed: int) -> int:
    return zlib.crc32(f"{seed}/{name}".encode())


def initial_values(name: str, region: Region, args: ModelArgs, seed: int, lo: int = 0, hi: int | None = None,
                   device: torch.device | str = "cpu") -> Tensor:
    """Flat elements lo .. hi − 1 (default: all) of the part `region` of parameter `name`'s
    initial value (fp32, on `device`): a function of the seed, the name and each element's
    global index only, so every layout, stage and shard agrees with one process."""
    hi = region.numel if hi is None else hi
    zero_b = name.endswith(".lora.b") and args.lora_init == "zero_b"  # an adapter that starts at no change
    zero_b = zero_b or name.endswith(".lora.rows")  # trained token rows: added to the base rows, from 0
    # a norm's scale of 1 (Gemma: 1 − offset); biases (experts' `w1_bias`...) and attention sinks at 0
    if name.endswith(("norm.weight", "bias", ".sinks")) or zero_b:
        fill = 1.0 - args.norm_offset if name.endswith("norm.weight") else 0.0
        out = torch.full((hi - lo,), fill, device=device)
        if region.contiguous_start() is None or region.valid_run() < hi:
            out[region.global_index(lo, hi, device) < 0] = 0.0  # padding
        return out
    if (args.tie_embeddings and name == "output.weight") or name == "mtp_embeddings.weight":
        name = "tok_embeddings.weight"  # a separate head of a tied model, MTP's copy: the embedding's values
    key, std = stream_key(name, seed), init_std(name, args)
    start = region.contiguous_start()
    out = torch.zeros(hi - lo, device=device)
    if start is None:  # element by element, a pass at a time
        step = _CHUNK if torch.device(device).type == "cpu" else 1 << 24
        for a in range(lo, hi, step):
            index = region.global_index(a, min(hi, a + step), device)
            out[a - lo:a - lo + index.numel()] = normal_at(key, index.clamp_min(0)).mul_(std).masked_fill_(index < 0, 0)
        return out
    valid = min(hi, region.valid_run())
    if valid > lo:
        normal_range(key, start + lo, valid - lo, device, out=out[:valid - lo]).mul_(std)
    return out


def initial_value(name: str, shape: Sequence[int], args: ModelArgs, seed: int,
                  device: torch.device | str = "cpu") -> Tensor:
    """The full initial value of parameter `name` (fp32)."""
    return initial_values(name, Region.whole(shape), args, seed, device=device).view(tuple(shape))
