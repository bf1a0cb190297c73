"""Rotary position embeddings and their scalings.

Pair i of a head turns by the angle p·f_i at position p, with f_i = theta^(−2i/d) (the
`default` kind). A scaling changes the frequencies so that a model pretrained on a shorter
context reads a longer one. Hugging Face's config.json names each kind and its parameters
(`rope_scaling`, or `rope_parameters` since transformers 4.56); `ModelArgs.rope_scaling`
keeps that dict as JSON text, with the same names:

- linear: f_i / factor (position interpolation).
- llama3 (Llama 3.1 and later): pairs whose wavelength exceeds original/low_freq_factor
  turn factor times slower, those shorter than original/high_freq_factor are kept, and
  the ones between blend the two smoothly.
- yarn (Peng et al. 2023; Qwen2.5 long context): a ramp from the original frequencies
  (fast pairs, turning more than beta_fast times over the original context) to
  interpolated ones, f_i / factor (slow pairs, fewer than beta_slow turns); cos and sin
  are multiplied by the attention factor, 0.1·ln(factor) + 1 unless given (or a ratio of
  two such terms with mscale and mscale_all_dim).
- dynamic (NTK-aware): while the forward's longest position L stays within the original
  context, the default; beyond it theta becomes theta·(factor·L/original − (factor−1))^(d/(d−2)).
- longrope (Phi-3): per-pair divisors, `long_factor` when the forward's longest position is
  beyond the original context, `short_factor` otherwise; cos and sin multiplied by
  sqrt(1 + ln(factor)/ln(original)) unless an attention factor is given.

The frequencies are computed in fp32 with the operations in the order transformers uses, so
that angles far beyond the original context (p·f_i in the thousands of radians) round alike
and the logits agree to fp32 precision. dynamic and longrope depend on the forward's longest
position; `Rotary` chooses on the device, without a host sync. That length is the forward's
own: under context parallelism a rank sees only part of each sequence, so config.validate
refuses those two kinds there when a sequence can outgrow the original context.
"""

from __future__ import annotations

import json
import math

import torch
from torch import Tensor, nn

KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Kinds whose frequencies depend on the longest position of the forward.
LENGTH_DEPENDENT = ("dynamic", "longrope")
REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


def scaling_of(text: str) -> dict:
    """The scaling dict of `ModelArgs.rope_scaling` ({"rope_type": "default"} for "")."""
    return json.loads(text) if text else {"rope_type": "default"}


def scaling_problem(text: str, head_dim: int) -> str | None:
    """Why `text` is not a scaling we can compute (None: it is)."""
    try:
        params = scaling_of(text)
    except json.JSONDecodeError as e:
        return f"is not JSON ({e})"
    if not isinstance(params, dict):
        return "must be a JSON object such as {\"rope_type\": \"linear\", \"factor\": 2.0}"
    kind = params.get("rope_type")
    if kind not in KINDS:
        return f"rope_type {kind!r} is not supported; known: {', '.join(KINDS)}"
    missing = [k for k in REQUIRED[kind] if params.get(k) is None]
    if missing:
        return f"rope_type {kind!r} needs {', '.join(missing)}"
    if kind == "longrope" and any(len(params[k]) != head_dim // 2 for k in ("short_factor", "long_factor")):
        return f"longrope's short_factor and long_factor need head_dim/2 = {head_dim // 2} numbers each"
    if kind in ("linear", "dynamic", "llama3", "yarn") and not params["factor"] >= 1.0:
        return f"factor must be >= 1, not {params['factor']}"
    return None


def _exponents(head_dim: int, device=None) -> Tensor:
    """2i/d for each pair i, fp32."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim


def default_freqs(theta: float, head_dim: int, device=None) -> Tensor:
    return 1.0 / (theta ** _exponents(head_dim, device))


def _llama3(theta: float, d: int, p: dict, device) -> Tensor:
    freqs = default_freqs(theta, d, device)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    context = p["original_max_position_embeddings"]
    wavelength = 2 * math.pi / freqs
    slow = torch.where(wavelength > context / low, freqs / factor, freqs)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * slow / factor + smooth * slow
    between = ~(wavelength < context / high) * ~(wavelength > context / low)
    return torch.where(between, blended, slow)


def _mscale(factor: float, scale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def yarn_attention_factor(p: dict, max_len: int) -> float:
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = p.get("factor") or max_len / p["original_max_position_embeddings"]
    if p.get("mscale") and p.get("mscale_all_dim"):
        return _mscale(factor, p["mscale"]) / _mscale(factor, p["mscale_all_dim"])
    return _mscale(factor)


def _yarn(theta: float, d: int, p: dict, max_len: int, device) -> Tensor:
    context = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_len / context
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def pair_turning(turns: float) -> float:
        """The (fractional) pair index that turns `turns` times over the original context."""
        return d * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(fast), pair_turning(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    wavelengths = theta ** (torch.arange(0, d, 2, device=device).float() / d)
    original, interpolated = 1.0 / wavelengths, 1.0 / (factor * wavelengths)
    keep = 1 - ramp  # the share of the original frequency
    return interpolated * (1 - keep) + original * keep


def longrope_attention_factor(p: dict, max_len: int) -> float:
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    context = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_len / context
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(context))


def _longrope(theta: float, d: int, p: dict, long: bool, device) -> Tensor:
    divisors = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
    return 1.0 / (divisors * theta ** _exponents(d, device))


def frequencies(args, device=None, long: bool = False) -> tuple[Tensor, float]:
    """(f_i [head_dim/2] fp32, the factor cos and sin are multiplied by) of a model whose
    frequencies do not depend on the forward (for longrope: the short ones, or the long
    ones with `long`; for dynamic: those within the original context)."""
    p, theta, d = scaling_of(args.rope_scaling), args.rope_theta, args.rope_dim
    kind = p["rope_type"]
    if kind == "linear":
        return default_freqs(theta, d, device) / p["factor"], 1.0
    if kind == "llama3":
        return _llama3(theta, d, p, device), 1.0
    if kind == "yarn":
        return _yarn(theta, d, p, args.max_seq_len, device), yarn_attention_factor(p, args.max_seq_len)
    if kind == "longrope":
        return _longrope(theta, d, p, long, device), longrope_attention_factor(p, args.max_seq_len)
    return default_freqs(theta, d, device), 1.0


def position_limit(args) -> int | None:
    """How many positions the model's rotary encodes: `max_seq_len` (Hugging Face's
    max_position_embeddings), except for yarn with a factor, whose reach is factor × the
    original context when that is longer (Qwen2.5 states max_position_embeddings equal to
    the original context and a factor of 4), and dynamic, which has no end (beyond the
    original context its angles come from the positions, as in transformers): None."""
    p = scaling_of(args.rope_scaling)
    if p["rope_type"] == "dynamic":
        return None
    if p["rope_type"] == "yarn" and p.get("factor"):
        return max(args.max_seq_len, int(p["factor"] * p["original_max_position_embeddings"]))
    return args.max_seq_len


def _tables(freqs: Tensor, attention_factor: float, n: int) -> tuple[Tensor, Tensor]:
    angles = torch.outer(torch.arange(n, dtype=torch.float32, device=freqs.device), freqs)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the default angles, each [max_seq_len, head_dim//2], fp32."""
    return _tables(default_freqs(theta, head_dim), 1.0, max_seq_len)


class Rotary(nn.Module):
    """cos and sin [..., head_dim/2] (fp32) of the angles at given positions, for a model's
    rotary scaling. Positions index tables of `position_limit` rows (two sets for
    longrope); dynamic computes the angles beyond the original context from the positions,
    at any length."""

    def __init__(self, args, device=None):
        super().__init__()
        self.args = args
        self.scaling = scaling_of(args.rope_scaling)
        self.kind = self.scaling["rope_type"]
        self.reset(device)

    def reset(self, device=None) -> None:
        """(Re)build the tables in fp32, where they are or on `device`."""
        a = self.args
        if device is None:
            device = self.cos.device if hasattr(self, "cos") else None
        rows = position_limit(a) or a.max_seq_len
        cos, sin = _tables(*frequencies(a, device), rows)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        if self.kind == "longrope":
            cos, sin = _tables(*frequencies(a, device, long=True), rows)
            self.register_buffer("cos_long", cos, persistent=False)
            self.register_buffer("sin_long", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # `.to(bfloat16)` would round the tables; rebuild them in fp32 instead.
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32 and self.cos.device.type != "meta":
            self.reset()
        return self

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if self.kind == "dynamic":  # rows past the table are beyond the original context: computed below
            rows = positions.clamp_max(self.cos.shape[0] - 1)
            cos, sin = self.cos[rows], self.sin[rows]
        else:
            cos, sin = self.cos[positions], self.sin[positions]
        if self.kind not in LENGTH_DEPENDENT:
            return cos, sin
        context = self.scaling["original_max_position_embeddings"]
        longest = positions.max() + 1
        if self.kind == "longrope":
            beyond = longest > context
            return (torch.where(beyond, self.cos_long[positions], cos),
                    torch.where(beyond, self.sin_long[positions], sin))
        angles = positions[..., None].float() * self._dynamic_freqs(longest, context)
        beyond = longest > context
        return torch.where(beyond, angles.cos(), cos), torch.where(beyond, angles.sin(), sin)

    def _dynamic_freqs(self, longest: Tensor, context: int) -> Tensor:
        d, factor = self.args.rope_dim, self.scaling["factor"]
        length = torch.maximum(longest, torch.tensor(context, dtype=longest.dtype, device=longest.device))
        theta = self.args.rope_theta * ((factor * length / context) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (theta ** _exponents(d, longest.device))
