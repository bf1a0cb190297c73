"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3, 2412.19437).

Keys and values come from one small latent per token instead of per-head projections:

    x ─► wq_a ─► q_a_norm ─► wq_b ─► per head [q_nope | q_rope]      (or one wq: no q_lora_rank)
    x ─► wkv_a ─► [latent (kv_lora_rank) | k_rope (qk_rope_head_dim, one for all heads)]
         latent ─► kv_a_norm ─► wkv_b ─► per head [k_nope | v]
    q = [q_nope | rot(q_rope)], k = [k_nope | rot(k_rope) for every head], v
    softmax(q·kᵀ · scale) · v ─► wo

Only the rotary part rotates, so it is rotated here, before the cache, and the attention
core (model/llama.py `AttentionCore` with rotate=False, or context parallelism's) gets q and
k rotated already. The value width is narrower than the query·key width (nope + rope;
DeepSeek-V3: 128 against 192), and the fused attention ops take one head width for q, k and
v (torch's flash ops, on the CPU and on CUDA, require it; without them SDPA falls back to
its math path, which keeps the s × s probabilities): V is zero-padded to the query·key
width before the core and the output's padding columns (zeros) dropped after it, so the
same fused op runs as for any other model, here, under context parallelism (whose back
ends also move K and V as one message) and in generation, at the price of V's bytes and the
AV product grown by qk/v (1.5× for DeepSeek-V3). Under YaRN with `mscale_all_dim` the softmax scale is multiplied by mscale²
(as DeepSeek's and Hugging Face's code do), folded into q.

Generation caches what the keys and values are made from, not the keys and values: the
normed latent and the rotated k_rope, (kv_lora_rank + qk_rope_head_dim) numbers per token and
layer instead of n_heads·(qk + v) (DeepSeek-V3: 576 instead of 40 960). Each step expands the
cached latents through wkv_b again (the "naive" form; absorbing wkv_b into the query and the
output would save that work and is not done here).

Tensor parallelism (parallel/tensor.py) splits the heads: wq_b (or wq), wkv_b by output rows
and wo by input columns; the down-projections wq_a, wkv_a and their norms stay whole on every
rank (their gradients are partial sums over tp, completed once per step).

`rope_interleave` (DeepSeek's checkpoints): the rotary pairs of a head are (x0, x1),
(x2, x3), ...; the rotation writes them out as [evens | odds], as Hugging Face's does, so q
and k share one layout and the weights map without a permutation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .args import ModelArgs
from .dtypes import widened
from .lora import linear
from .rope import scaling_of

# DeepSeek's latent norms use this epsilon whatever rms_norm_eps says (transformers too).
LATENT_NORM_EPS = 1e-6


def rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [b, s, heads, d] by the angles of their positions,
    written out as [first of each pair | second of each pair]; cos, sin [s or b, s, d/2]. In
    fp32 (fp64 for fp64 x), returned in x's dtype."""
    w = widened(x)
    x1, x2 = w[..., 0::2], w[..., 1::2]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def softmax_scale(args: ModelArgs) -> float:
    """What multiplies 1/√(qk width): mscale² under YaRN with mscale_all_dim, else 1."""
    p = scaling_of(args.rope_scaling)
    all_dim = p.get("mscale_all_dim")
    if p["rope_type"] == "default" or not all_dim or p.get("factor", 1.0) <= 1.0:
        return 1.0
    m = 0.1 * all_dim * math.log(p["factor"]) + 1.0
    return m * m


class LatentView:
    """What the attention core sees of the cache: the keys and values this layer expanded
    from the cached latents (`update` hands them back), and the cache's document ids."""

    def __init__(self, k: Tensor, v: Tensor, doc_ids: Tensor | None):
        self.full, self.doc_ids = (k, v), doc_ids

    def update(self, layer_key, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.full


class LatentAttention(nn.Module):
    """Multi-head latent attention (the module docstring). Head counts come from tensor
    shapes, so a tensor-parallel rank holding some heads runs this same code."""

    def __init__(self, args: ModelArgs, core: nn.Module, norm: type, rotate_half_split):
        """`core`: the attention core (model/llama.py `AttentionCore` with rotate=False);
        `norm`: the RMSNorm class; `rotate_half_split`: llama.apply_rope (passed in, so this
        module does not import the decoder that holds it)."""
        super().__init__()
        RMSNorm, self.apply_rope = norm, rotate_half_split
        heads, qk = args.n_heads, args.head_dim
        self.nope, self.rope, self.v_dim, self.rank = (args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim,
                                                       args.kv_lora_rank)
        self.interleave = args.rope_interleave
        if args.q_lora_rank:
            self.wq_a = linear(args, "wq_a", args.dim, args.q_lora_rank)
            self.q_a_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = linear(args, "wq_b", args.q_lora_rank, heads * qk)
        else:
            self.wq = linear(args, "wq", args.dim, heads * qk)
        self.wkv_a = linear(args, "wkv_a", args.dim, self.rank + self.rope)
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.wkv_b = linear(args, "wkv_b", self.rank, heads * (self.nope + self.v_dim))
        self.wo = linear(args, "wo", heads * self.v_dim, args.dim)
        self.q_scale = softmax_scale(args)
        self.core = core

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return rotate_interleaved(x, cos, sin) if self.interleave else self.apply_rope(x, cos, sin)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache=None, layer_key: str | None = None,
                doc_ids: Tensor | None = None) -> Tensor:
        b, s, _ = x.shape
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q_nope, q_rope = q.view(b, s, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        q = torch.cat((q_nope, self._rotate(q_rope, cos, sin)), dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        latent, k_rope = self.kv_a_norm(latent).unsqueeze(2), self._rotate(k_rope.unsqueeze(2), cos, sin)
        if cache is not None:  # the cache keeps [latent] and [rotated k_rope] per position
            latent, k_rope = cache.update(layer_key, latent, k_rope)
        kv = self.wkv_b(latent.squeeze(2))
        k_nope, v = kv.view(b, kv.shape[1], -1, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        qk = self.nope + self.rope
        if self.v_dim < qk:
            v = F.pad(v, (0, qk - self.v_dim))
        view = LatentView(k, v, cache.doc_ids) if cache is not None else None
        out = self.core(q, k, v, cos, sin, view, layer_key, doc_ids=doc_ids)
        if self.v_dim < qk:
            out = out.view(b, s, -1, qk)[..., :self.v_dim].reshape(b, s, -1)
        return self.wo(out)
