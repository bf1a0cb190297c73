"""A Llama-style decoder on one device: RMSNorm, rotary positions, grouped-query attention,
SwiGLU feed-forward, pre-norm residual blocks.

This file knows nothing of parallelism. Two choices keep it usable by the modules that do:
- Layers are keyed by their global index, and a `Transformer` may hold any subset of them,
  with or without the embedding and the head. A pipeline stage is simply a `Transformer`
  built with `layer_ids`, and its parameter names equal those of the full model.
- Attention reads its head counts from tensor shapes, never from the config, so a tensor
  parallel layer that keeps only some heads runs this same code. The attention core (rope,
  softmax attention, reshape) is its own child module, `core`, which selective recompute
  can wrap and context parallelism can replace.

Rotary convention: "half-split" (the two halves of each head's vector are the real and
imaginary parts), as in Hugging Face's Llama, so the HF converter needs no permutation.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .args import ModelArgs
from .dtypes import wide_dtype, widened
from .init import initial_value
from .lora import TokenRows, embedding, head_rows, linear
from .mla import LatentAttention
from .moe import MoE, RoutingLog
from .mtp import MTPModule
from .mtp import add_losses as add_mtp_losses
from .rope import Rotary, rope_tables  # noqa: F401 (rope_tables: re-exported)


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """x / rms(x) · weight; with `offset` (Gemma), · (offset + weight), all in fp32."""
    # fp32 statistics: the mean of squares overflows or loses precision in bf16/fp16.
    x32 = widened(x)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (offset + widened(weight))).to(x.dtype)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))  # a scale of 1

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def softcap(x: Tensor, cap: float) -> Tensor:
    """cap·tanh(x / cap): x kept within ±cap, nearly unchanged where |x| ≪ cap (Gemma 2)."""
    return torch.tanh(x / cap) * cap


# ---------------------------------------------------------------------------------------
# Rotary position embedding (the tables and their scalings: model/rope.py)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [b, s, heads, head_dim] by the angles of its positions; cos, sin:
    [s, head_dim//2] (every row at the same positions) or [b, s, head_dim//2].

    Pair i of a head is (x[i], x[i + head_dim//2]). Computed in fp32 (fp64 for fp64 x),
    returned in x's dtype.
    """
    x1, x2 = widened(x).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


# ---------------------------------------------------------------------------------------
# Key/value cache for generation


class KVCache:
    """Keys and values of past positions, per layer, for incremental decoding.

    Buffers [batch, max_len, n_kv_heads, head_dim] are allocated on a layer's first
    `update`, shaped like the keys it brings, so the cache needs no config and follows
    whatever heads the attention layer holds. `pos` is the number of positions already
    stored; the `Transformer` that owns the cache advances it after each forward.
    Use one cache per `Transformer` instance.

    Rows of different lengths (a batch of prompts, left-padded) keep the document id of
    every cached position (`doc_ids`): a query sees only the cached keys of its own
    document, so padding is never attended to.
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.pos = 0
        self.k: dict[str, Tensor] = {}
        self.v: dict[str, Tensor] = {}
        self.doc_ids: Tensor | None = None  # [batch, max_len], when the forward passes doc_ids

    def update(self, layer_key: str, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [b, s, kv_heads, head_dim] at positions pos..pos+s-1 and return the
        keys and values of positions 0..pos+s-1."""
        b, s, heads, head_dim = k.shape
        end = self._end(s)
        if layer_key not in self.k:  # v may be narrower (MLA's values; its latent and rotary key)
            self.k[layer_key] = torch.zeros((b, self.max_len, heads, head_dim), dtype=k.dtype, device=k.device)
            self.v[layer_key] = torch.zeros((b, self.max_len, *v.shape[2:]), dtype=v.dtype, device=v.device)
        self.k[layer_key][:, self.pos:end] = k
        self.v[layer_key][:, self.pos:end] = v
        return self.k[layer_key][:, :end], self.v[layer_key][:, :end]

    def store_doc_ids(self, doc_ids: Tensor) -> None:
        """The document ids [b, s] of the positions this forward adds (before its layers)."""
        b, s = doc_ids.shape
        end = self._end(s)
        if self.doc_ids is None:
            self.doc_ids = torch.zeros((b, self.max_len), dtype=doc_ids.dtype, device=doc_ids.device)
        self.doc_ids[:, self.pos:end] = doc_ids

    def _end(self, s: int) -> int:
        end = self.pos + s
        if end > self.max_len:
            raise ValueError(f"KVCache: {end} positions exceed max_len={self.max_len}")
        return end

    def advance(self, n: int) -> None:
        self.pos += n

    def reset(self) -> None:
        self.pos = 0
        self.doc_ids = None


# ---------------------------------------------------------------------------------------
# Decoder block


class AttentionCore(nn.Module):
    """Everything between the projections: rotary, cache, softmax attention, head merge.

    q [b, s, heads, head_dim], k and v [b, s, kv_heads, head_dim] -> [b, s, heads·head_dim].
    `doc_ids` [b, s] (packed sequences, or rows of a generated batch with their padding): a
    token attends only to earlier tokens of its own document. `window` > 0: only to itself
    and the window − 1 tokens before it. `softcap` > 0: the scores are capped,
    cap·tanh(score / cap), before the softmax (Gemma 2), which SDPA cannot do, so that
    attention is computed here in plain torch; so are `sinks` [heads] (gpt-oss: a logit per
    head in the softmax's denominator), which training runs on the fused ops instead
    (parallel/context/sinks.py swaps this core). `documents` (ModelArgs.doc_attention): how
    documents are kept apart without a cache, "mask" (a boolean [b, 1, s, s] mask for SDPA)
    or "flex" (`flex_documents`: no s × s mask). It holds no parameters; recompute wraps it,
    context parallelism replaces it. `rotate=False`: q and k arrive rotated (latent
    attention rotates only part of each head, before its cache: model/mla.py).
    """

    def __init__(self, window: int = 0, softcap: float = 0.0, documents: str = "mask", rotate: bool = True):
        super().__init__()
        self.window, self.softcap, self.documents, self.rotate = window, softcap, documents, rotate

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                cache: KVCache | None = None, layer_key: str | None = None,
                doc_ids: Tensor | None = None, sinks: Tensor | None = None) -> Tensor:
        b, s = q.shape[:2]
        if self.rotate:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer_key, k, v)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # sdpa wants [b, heads, s, head_dim]
        plain = self.softcap or sinks is not None  # what SDPA cannot do: computed in plain torch
        if self.documents == "flex" and doc_ids is not None and cache is None and not plain:
            out = flex_documents(q, k, v, doc_ids, self.window, compiled=q.device.type == "cuda")
            return out.transpose(1, 2).reshape(b, s, -1)
        cached_docs = cache.doc_ids[:, :k.shape[2]] if cache is not None and doc_ids is not None else None
        mask = visible_keys(s, k.shape[2], doc_ids, cached_docs, self.window, q.device)
        if plain:
            out = plain_attention(q, k, v, mask, self.softcap, sinks)
        else:
            gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
            causal = mask is None and s == k.shape[2] and s > 1
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **gqa)
        return out.transpose(1, 2).reshape(b, s, -1)


def flex_documents(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor, window: int = 0,
                   compiled: bool = False) -> Tensor:
    """Causal attention inside each document of `doc_ids` [b, s] (and the `window`, 0: none)
    on `flex_attention`: q [b, H, s, d], k and v [b, G, s, d] → [b, H, s, d], what SDPA
    computes with `visible_keys`' mask, without an s × s mask. The kernel evaluates the rule
    (row, query, key) → visible itself; the block mask says which 128 × 128 tiles hold a
    visible pair ([b, 1, s/128] counts, [b, 1, s/128, s/128] indices). `compiled` (CUDA):
    the block mask is built by a compiled kernel and the attention runs compiled, as flex
    needs to be fused (uncompiled it materialises the scores); inside a region that is being
    compiled already (train.compile), flex_attention is traced into it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def visible(row, head, query, key):
        seen = (key <= query) & (doc_ids[row, query] == doc_ids[row, key])
        return seen & (query - key < window) if window else seen

    b, s = doc_ids.shape
    blocks = create_block_mask(visible, b, None, s, s, device=q.device, _compile=compiled)
    attend = _compiled_flex_attention() if compiled and not torch.compiler.is_compiling() else flex_attention
    return attend(q, k, v, block_mask=blocks, enable_gqa=q.shape[1] != k.shape[1])


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once per process (a kernel cache, not a setting)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def visible_keys(s: int, s_kv: int, doc_ids: Tensor | None, cached_docs: Tensor | None, window: int,
                 device) -> Tensor | None:
    """[b or 1, 1, s, s_kv] boolean for s queries in the last s of s_kv slots (the earlier
    ones cached): query i (slot s_kv − s + i) sees key j when j is not after it, both are in
    one document (`doc_ids` [b, s] of the queries; `cached_docs` [b, s_kv] of every slot,
    the new ones included, when a cache holds the earlier ones), and j is among the `window`
    slots ending at i (0: no window). None when that is the plain causal square, or every
    key (one new token, no documents, no window that cuts). The diagonal is always visible,
    so no row is ever fully masked."""
    cuts = 0 < window < s_kv
    if doc_ids is None and not cuts and (s == s_kv or s == 1):
        return None
    slots = torch.arange(s_kv, device=device)
    query_slots = slots[s_kv - s:, None]
    mask = slots[None, :] <= query_slots
    if cuts:
        mask = mask & (slots[None, :] > query_slots - window)
    if doc_ids is None:
        return mask[None, None]
    keys = cached_docs if cached_docs is not None else doc_ids
    return ((doc_ids[:, :, None] == keys[:, None, :]) & mask)[:, None]


def plain_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, cap: float = 0.0,
                    sinks: Tensor | None = None) -> Tensor:
    """softmax(scores, masked) · v, softmax in fp32 (fp64 for fp64); q [b, H, s, d], k, v [b, G, s_kv, d]
    (query head h reads key head h // (H/G), as SDPA's enable_gqa); mask as `visible_keys`
    gives it, None meaning causal (or every key for one query). scores = q·kᵀ/√d, capped to
    cap·tanh(scores / cap) when `cap` > 0 (Gemma 2). `sinks` [H] (gpt-oss): one more logit
    per head in the softmax's denominator, with no value: each row's weights sum to
    1 − its sink's share, so a head may attend to nothing."""
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if cap:
        scores = softcap(scores, cap)
    s, s_kv = scores.shape[-2:]
    if mask is None and s > 1:
        mask = torch.ones(s, s_kv, dtype=torch.bool, device=q.device).tril(s_kv - s)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=wide_dtype(q.dtype)).to(q.dtype), v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=wide_dtype(q.dtype))[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def document_mask(doc_ids: Tensor) -> Tensor:
    """[b, 1, s, s] boolean: query i may see key j when j <= i and both are in one document."""
    s = doc_ids.shape[-1]
    return visible_keys(s, s, doc_ids, None, 0, doc_ids.device)


class Attention(nn.Module):
    """Grouped-query attention. Families differ in optional pieces: biases on the q, k, v
    projections (Qwen2), an RMSNorm of each query and key head, shared by all heads, before
    the rotary (Qwen3), a sliding window (Mistral, some Qwen2 layers, every other Gemma 2
    layer), soft-capped scores and a query scale of its own (Gemma 2). That scale,
    query_pre_attn_scalar^-1/2 instead of head_dim^-1/2, is folded into q before the core,
    so every attention core (SDPA, context parallelism's kernels) keeps its 1/√head_dim."""

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.head_dim = args.head_dim
        scalar = args.query_pre_attn_scalar
        self.q_scale = math.sqrt(args.head_dim / scalar) if scalar and scalar != args.head_dim else 1.0
        kv_dim = args.n_kv_heads * args.head_dim
        self.wq = linear(args, "wq", args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = linear(args, "wk", args.dim, kv_dim, bias=args.qkv_bias)
        self.wv = linear(args, "wv", args.dim, kv_dim, bias=args.qkv_bias)
        self.wo = linear(args, "wo", args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        # gpt-oss: a logit per query head that takes part in the softmax (plain_attention)
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if args.attn_sinks else None
        # per head (Qwen3, Gemma 3), or over all heads of q and of k (OLMo 2: `qk_norm_all`)
        q_width, k_width = (args.n_heads * args.head_dim, kv_dim) if args.qk_norm_all else (args.head_dim,) * 2
        self.q_norm = RMSNorm(q_width, args.norm_eps, args.norm_offset) if args.qk_norm else None
        self.k_norm = RMSNorm(k_width, args.norm_eps, args.norm_offset) if args.qk_norm else None
        self.norm_all = args.qk_norm_all
        self.core = AttentionCore(args.window_of(layer), args.attn_softcap, args.doc_attention)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None,
                layer_key: str | None = None, doc_ids: Tensor | None = None) -> Tensor:
        b, s, _ = x.shape
        q, k = self.wq(x), self.wk(x)
        if self.norm_all:  # OLMo 2: over every head at once, before the split into heads
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads: a tensor-parallel shard holds fewer heads than the config says.
        q, k = q.view(b, s, -1, self.head_dim), k.view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and not self.norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return self.wo(self.core(q, k, v, cos, sin, cache, layer_key, doc_ids=doc_ids, sinks=self.sinks))


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); GeGLU (Gemma) with the tanh GeLU in place of silu."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.act = ACTIVATIONS[args.mlp_act]
        self.w1 = linear(args, "w1", args.dim, args.ffn_dim)  # gate
        self.w3 = linear(args, "w3", args.dim, args.ffn_dim)  # up
        self.w2 = linear(args, "w2", args.ffn_dim, args.dim)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block; its feed-forward is a SwiGLU MLP, or a mixture of experts
    (model/moe.py) in the layers `args.is_moe_layer` names. With `sandwich_norm` (Gemma 2)
    each branch's output is normed again before it joins the residual stream; without
    `pre_norm` (OLMo 2) that is the only norm."""

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        # One module for both residual branches: it holds no state, and a layout that
        # splits the residual stream can swap it for a dropout that draws the same mask.
        self.dropout = nn.Dropout(args.dropout)
        norm = functools.partial(RMSNorm, args.dim, args.norm_eps, args.norm_offset)
        # without pre_norm (OLMo 2) the sublayers read the residual stream itself
        self.attention_norm = norm() if args.pre_norm else nn.Identity()
        if args.is_mla:  # model/mla.py
            core = AttentionCore(args.window_of(layer), args.attn_softcap, args.doc_attention, rotate=False)
            self.attention = LatentAttention(args, core, RMSNorm, apply_rope)
        else:
            self.attention = Attention(args, layer)
        self.ffn_norm = norm() if args.pre_norm else nn.Identity()
        self.feed_forward = MoE(args) if args.is_moe_layer(layer) else FeedForward(args)
        if args.sandwich_norm:
            self.attention_post_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
            self.ffn_post_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None,
                layer_key: str | None = None, doc_ids: Tensor | None = None,
                routing: RoutingLog | None = None) -> Tensor:
        a = self.attention(self.attention_norm(x), cos, sin, cache, layer_key, doc_ids=doc_ids)
        if hasattr(self, "attention_post_norm"):
            a = self.attention_post_norm(a)
        x = x + self.dropout(a)
        h = self.ffn_norm(x)
        if isinstance(self.feed_forward, MoE):
            m = self.feed_forward(h, routing, layer_key)
        else:
            m = self.feed_forward(h)
        if hasattr(self, "ffn_post_norm"):
            m = self.ffn_post_norm(m)
        return x + self.dropout(m)


# ---------------------------------------------------------------------------------------
# The model


class OutputHead(nn.Linear):
    """The output projection, its logits soft-capped when `softcap` > 0 (Gemma 2)."""

    def __init__(self, dim: int, vocab_size: int, softcap: float = 0.0, lora: TokenRows | None = None):
        super().__init__(dim, vocab_size, bias=False)
        self.softcap, self.lora = softcap, lora  # lora: trained token rows (model/lora.py)

    def forward(self, x: Tensor) -> Tensor:
        logits = super().forward(x)
        if self.lora is not None:
            logits = self.lora.head(x, logits)
        return softcap(logits, self.softcap) if self.softcap else logits


class Transformer(nn.Module):
    """The decoder, or the part of it a pipeline stage holds.

    embed: tokens [b, s] in; else hidden states [b, s, dim] in.
    head: logits [b, s, vocab] out; else hidden states out.
    layer_ids: the global indices of the blocks held (default: all).
    """

    def __init__(self, args: ModelArgs, layer_ids: Sequence[int] | None = None,
                 embed: bool = True, head: bool = True):
        super().__init__()
        self.args = args
        layer_ids = sorted(range(args.n_layers) if layer_ids is None else layer_ids)
        in_range = all(0 <= i < args.n_layers for i in layer_ids)
        if not in_range or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"layer_ids {layer_ids} must be distinct and in 0..{args.n_layers - 1}")

        self.tok_embeddings = embedding(args) if embed else None
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in layer_ids})
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset) if head else None
        self.output = OutputHead(args.dim, args.vocab_size, args.logit_softcap,
                                 head_rows(args, self.tok_embeddings)) if head else None
        if args.tie_embeddings and embed and head:
            self.output.weight = self.tok_embeddings.weight
        self.rotary = Rotary(args)
        # multi-token prediction: with the head (model/mtp.py); a chunk with the head and not
        # the embedding (a pipeline's last stage) holds a copy of the embedding for it (the
        # tied head itself when there is one), summed with the first stage's (pipeline/stage.py)
        self.mtp = nn.ModuleDict({str(d): MTPModule(args, Block(args, args.n_layers - 1), RMSNorm)
                                  for d in range(args.mtp_depth)}) if head and args.mtp_depth else None
        self.mtp_embeddings = nn.Embedding(args.vocab_size, args.dim) if self.mtp is not None and not embed else None
        if self.mtp_embeddings is not None and args.tie_embeddings:
            self.mtp_embeddings.weight = self.output.weight
        if args.rope_local_theta:  # Gemma 3: the windowed layers' own base, no scaling
            self.rotary_local = Rotary(args.with_(rope_theta=args.rope_local_theta, rope_scaling=""))

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """Recompute the rotary tables in fp32, where they live or on `device` (a model
        built on the meta device, a cast)."""
        self.rotary.reset(device)
        if hasattr(self, "rotary_local"):
            self.rotary_local.reset(device)

    def forward(self, x: Tensor, positions: Tensor | None = None,
                cache: KVCache | None = None, doc_ids: Tensor | None = None,
                routing: RoutingLog | None = None, last: bool = False, head_fn=None) -> Tensor:
        """x: tokens [b, s] (or hidden states without the embedding). positions: [s] or
        [b, s], the RoPE position of each token (default 0..s-1, after the cache);
        a packed row restarts them at each document. doc_ids: [b, s], see AttentionCore; with
        a cache, the documents of the new positions (KVCache keeps those of the old).
        routing: a training step's log, which the MoE blocks fill with their load-balancing
        loss and routing statistics (model/moe.py); None (evaluation, generation): nothing
        is recorded. last: the output at the last position only ([b, 1, ...]: what sampling
        reads, without the logits of a whole prompt). head_fn: instead of the logits, what
        `head_fn(features, head)` returns from the final features and the output head
        (model/loss.chunked_nll: the loss without the whole logits)."""
        s = x.shape[1]
        if positions is None:
            start = cache.pos if cache is not None else 0
            positions = torch.arange(start, start + s, device=x.device)
        cos, sin = self.rotary(positions)
        local = self.rotary_local(positions) if hasattr(self, "rotary_local") else (cos, sin)

        if cache is not None and doc_ids is not None:
            cache.store_doc_ids(doc_ids)
        h = self.embed(x) if self.tok_embeddings is not None else x
        for key, layer in self.layers.items():
            rope = local if self.args.window_of(int(key)) else (cos, sin)
            h = layer(h, *rope, cache, key, doc_ids=doc_ids, routing=routing)
        if cache is not None:
            cache.advance(s)
        if last:
            h = h[:, -1:]
        if self.output is not None:
            x, h = h, self.norm(h)
            if self.mtp is not None and routing is not None and routing.mtp is not None and not last:
                # h⁰: the final norm's output; under tensor parallelism before the head's region
                # entry (parallel/tensor_mtp.py)
                h0 = self.norm.normed(x) if hasattr(self.norm, "normed") else h
                add_mtp_losses(self, h0, cos, sin, doc_ids, routing)  # model/mtp.py
            h = self.output(h) if head_fn is None else head_fn(h, self.output)
        return h

    def embed(self, x: Tensor) -> Tensor:
        """The input embedding of tokens x (multi-token prediction's too: the copy on a
        pipeline's last stage where the chunk has none)."""
        h = (self.tok_embeddings if self.tok_embeddings is not None else self.mtp_embeddings)(x)
        if self.args.embed_scale != 1.0:  # Gemma: × √dim, rounded to the activations' dtype
            h = h * torch.tensor(self.args.embed_scale, dtype=h.dtype)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic initialisation (model/init.py). Also rebuilds the rotary
        tables and zeroes the routers' bias, so a model built on the meta device and
        materialised with `to_empty` works."""
        for name, p in self.named_parameters():
            p.copy_(initial_value(name, p.shape, self.args, seed, device=p.device))
        for module in self.modules():
            if isinstance(module, MoE):
                module.router.expert_bias.zero_()
        self.reset_rope()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied one once
