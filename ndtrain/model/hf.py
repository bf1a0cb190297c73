"""Conversion between our models and Hugging Face causal LMs: names, configs, families.

Our rotary convention is HF's (half-split pairs), so weights map one to one by name: no
permutation of wq/wk is needed. Partial state dicts (one pipeline stage's) convert too.
Reading a config.json is model/hf_config.py's; this file maps tensors and writes configs.

Everything is a table. `BLOCK` maps our parameter names to HF's (a family uses the rows its
parameters need; Gemma 2 names its norms otherwise, `GEMMA_NORMS`); `FUSED` lists the HF
tensors that hold several of ours stacked by rows (Phi-3's `qkv_proj` is wq, wk, wv;
`gate_up_proj` is w1, w3): each of ours is a row range of it (`Part.rows`), which the slice
reader (checkpoint/slices.py) reads like any other piece.

Mixture of experts: our experts are stacked, `feed_forward.experts.w1` [E, F, D] (w3 the
same, w2 [E, D, F]); a HF checkpoint stores one tensor per expert
(`block_sparse_moe.experts.{j}.w1.weight` in Mixtral, `mlp.experts.{j}.gate_proj.weight` in
Qwen3-MoE), which is the piece [j] of ours (`Part.expert`).

gpt-oss stacks its experts too, transposed, with gate and up interleaved, and OpenAI's
checkpoints store them in MXFP4: `Part.layout` names the view of the HF tensor that is ours
and `Part.mxfp4` a quantized one (model/hf_gpt_oss.py).

Tied embeddings: HF checkpoints of tied models store the matrix once, as
`model.embed_tokens.weight`, so `to_hf_state_dict` leaves `lm_head.weight` out when the
embedding is there, and `from_hf_state_dict` fills `output.weight` from the embedding when
`lm_head.weight` is missing (or stored anyway: the embedding is the one copy).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from . import hf_deepseek
from . import hf_gpt_oss as gpt_oss
from .args import ModelArgs
from .hf_config import FAMILIES, Family, HFConfigError, args_from_hf_config, family_of_config  # noqa: F401
from .rope import scaling_of

# Names inside one block: ours -> HF's (both relative to the layer prefix).
BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",  # Qwen2
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # latent attention and shared experts (deepseek_v3, kimi_k2)
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
}
# Buffers a checkpoint carries: the router's selection bias (DeepSeek-V3's aux-loss-free balancing).
BUFFERS = {"feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias"}
GEMMA_NORMS = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "attention_post_norm.weight": "post_attention_layernorm.weight",
    "ffn_post_norm.weight": "post_feedforward_layernorm.weight",
}
FUSED = {  # Phi-3: HF tensor -> ours, stacked by rows in this order
    "self_attn.qkv_proj.weight": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
    "mlp.gate_up_proj.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
}
TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOP_BACK = {hf: ours for ours, hf in TOP.items()}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # a buffer older HF versions saved
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_HF_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")
_OURS_MOE = re.compile(r"layers\.(\d+)\.feed_forward\.(router\.weight|experts\.(w1|w2|w3))")
_EXPERT_STACKS = ("w1", "w3", "w2")  # ours, in the order of Family.expert_names
_EXPERT_OF = {hf: ours for f in FAMILIES.values() for hf, ours in zip(f.expert_names, _EXPERT_STACKS)}


@dataclass(frozen=True)
class Part:
    """Where a tensor of ours lives in a HF checkpoint: tensor `hf`, the piece [expert] of
    our stack when `expert` is set, and rows [rows[0], rows[1]) of the HF tensor when it
    is a fused one (None: all of it)."""

    hf: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    layout: str = ""  # gpt_oss: the view of the HF tensor that is ours (hf_gpt_oss.ours_from_hf)
    mxfp4: bool = False  # gpt_oss: `hf` is the MXFP4 *_blocks tensor (its *_scales beside it)


def our_buffer(name: str, args: ModelArgs) -> str | None:
    """A HF checkpoint's buffer -> the name of ours it fills (None: not a buffer we keep);
    a layer past the last is an MTP module's block."""
    m = _HF_LAYER.fullmatch(name)
    back = {hf: ours for ours, hf in BUFFERS.items()}
    if not m or m.group(2) not in back:
        return None
    layer = int(m.group(1))
    where = f"layers.{layer}" if layer < args.n_layers else f"mtp.{layer - args.n_layers}.block"
    return f"{where}.{back[m.group(2)]}"


def hf_buffer(name: str, args: ModelArgs) -> str | None:
    """Our buffer -> its HF name (None: HF has no place for it)."""
    m = _OURS_MTP.fullmatch(name)
    if m and m.group(2).startswith("block."):
        name = f"layers.{args.n_layers + int(m.group(1))}.{m.group(2)[len('block.'):]}"
    m = _OURS_LAYER.fullmatch(name)
    return f"model.layers.{m.group(1)}.{BUFFERS[m.group(2)]}" if m and m.group(2) in BUFFERS else None


# ---------------------------------------------------------------------------------------
# Which family holds a model


def _gemma_traits(a: ModelArgs) -> bool:
    return bool(a.norm_offset or a.sandwich_norm or a.mlp_act != "silu" or a.embed_scale != 1.0
                or a.query_pre_attn_scalar or a.attn_softcap or a.logit_softcap)


def _gpt_oss_traits(a: ModelArgs) -> tuple:
    return a.attn_sinks, a.o_bias, a.moe_router_bias, a.moe_expert_bias, bool(a.moe_swiglu_limit)


def holds(family: Family, a: ModelArgs) -> str | None:
    """Why `family` cannot hold a model of these args (None: it can)."""
    if family.deepseek or a.is_mla:
        return hf_deepseek.holds(a) if family.deepseek else f"{family.model_type} has no latent attention"
    olmo2 = (a.qk_norm_all, a.pre_norm, a.sandwich_norm) == (True, False, True)
    if (family.model_type == "olmo2") != olmo2:
        return "q/k norms over all heads and norms only after the sublayers go together, in olmo2 only"
    if olmo2:
        if a.qkv_bias or a.is_moe or a.sliding_window or a.norm_offset or a.mlp_act != "silu" or \
                any(_gpt_oss_traits(a)) or a.attn_softcap or a.logit_softcap or a.embed_scale != 1.0:
            return "olmo2 has no biases, experts, window, Gemma norms or soft-capping"
        return None
    if family.model_type == "gpt_oss":
        if not (all(_gpt_oss_traits(a)) and a.qkv_bias and not a.qk_norm and not _gemma_traits(a) and a.is_moe
                and a.moe_every == 1 and a.moe_router == "topk_softmax" and not a.moe_shared_experts
                and not a.moe_capacity and a.moe_route_scale == 1.0 and not a.moe_norm_topk):
            return ("gpt_oss has attention sinks, q/k/v/o biases, and experts in every block with a biased top-k-then-"
                    "softmax router, biased experts and the clamped SwiGLU, all of them")
        return None
    if any(_gpt_oss_traits(a)):
        return "attention sinks, an output-projection bias, router and expert biases and the clamped SwiGLU are gpt_oss's"
    if a.rope_local_theta and family.model_type != "gemma3_text":
        return "a rotary base of their own for the windowed layers is Gemma 3's (gemma3_text)"
    if family.model_type == "gemma3_text" and a.rope_scaling and not a.rope_local_theta:
        return "gemma3_text's windowed layers rotate unscaled: they need a base of their own (rope_local_theta)"
    if family.gemma != _gemma_traits(a):
        return "Gemma's norms, gate, embedding scale and soft-capping go together, in gemma2 and gemma3_text only"
    if family.gemma and not (a.norm_offset == 1.0 and a.sandwich_norm and a.mlp_act == "gelu_tanh"
                             and math.isclose(a.embed_scale, a.dim ** 0.5)):
        return (f"{family.model_type} needs all of (1 + weight) norms, sandwich norms, the tanh GeLU and "
                "embeddings × √dim")
    if (a.qkv_bias, a.qk_norm, a.is_moe) != (family.qkv_bias, family.qk_norm, bool(family.moe)):
        return "q/k/v biases (qwen2), q/k norms (qwen3, qwen3_moe) and experts (mixtral, qwen3_moe) fix the family"
    if a.sliding_window and not family.window:
        return f"{family.model_type} has no sliding window"
    if a.sliding_window and a.window_layers is not None and family.window in ("all", "qwen_all"):
        return f"{family.model_type} has a window on every layer or on none"
    kind = scaling_of(a.rope_scaling)["rope_type"]
    if family.fused and kind not in ("default", "longrope"):
        return f"phi3 takes default or longrope rotary scaling, not {kind}"
    if family.model_type == "mixtral" and not (a.moe_norm_topk and a.moe_every == 1):
        return "mixtral renormalises the top-k weights and has experts in every block"
    if family.moe and not (a.moe_router == "softmax_topk" and a.moe_shared_experts == 0 and a.moe_capacity == 0
                           and a.moe_route_scale == 1.0):
        return "no Hugging Face family holds this mixture of experts (shared experts, capacity, a route scale)"
    return None


def family_of(args: ModelArgs, prefer: str | None = None) -> Family:
    """The HF family that holds a model of this shape: `prefer` (the model_type it came
    from) when that family can, else the simplest one that can."""
    if args.qk_norm and args.qkv_bias:
        raise ValueError("no Hugging Face family has both q/k/v biases and q/k norms")
    if prefer in FAMILIES and holds(FAMILIES[prefer], args) is None:
        return FAMILIES[prefer]
    order = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text", "olmo2", "gpt_oss",
             "deepseek_v3")
    reasons = []
    for name in order:
        reason = holds(FAMILIES[name], args)
        if reason is None:
            return FAMILIES[name]
        reasons.append(reason)
    raise ValueError("no Hugging Face family holds this model: " + min(reasons, key=len))


# ---------------------------------------------------------------------------------------
# Names


def _block_names(family: Family | None) -> dict[str, str]:
    post_norms = family is not None and (family.gemma or family.model_type == "olmo2")  # OLMo 2: Gemma's names
    return {**BLOCK, **GEMMA_NORMS} if post_norms else BLOCK


# Multi-token prediction (deepseek_v3): module d is checkpoint layer n_layers + d, holding its
# norms and projection, a decoder block under the usual names, and copies of the shared
# embedding and head (written as copies, read as nothing: ours are shared).
MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
       "norm.weight": "shared_head.norm.weight"}
MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
_OURS_MTP = re.compile(r"mtp\.(\d+)\.(.+)")


def hf_parts(name: str, args: ModelArgs, family: Family | None = None) -> list[Part]:
    """Our parameter name -> where it lives in the family's checkpoint (an expert stack is
    E HF tensors, a fused projection part of one, anything else one whole tensor)."""
    family = family or family_of(args)
    m = _OURS_MTP.fullmatch(name)
    if m:
        layer = args.n_layers + int(m.group(1))
        if m.group(2) in MTP:
            return [Part(f"model.layers.{layer}.{MTP[m.group(2)]}")]
        if m.group(2).startswith("block."):
            return hf_parts(f"layers.{layer}.{m.group(2)[len('block.'):]}", args, family)
    if name in TOP:
        return [Part(TOP[name])]
    m = _OURS_LAYER.fullmatch(name)
    if m and family.model_type == "gpt_oss" and m.group(2) in gpt_oss.NAMES:
        hf, layout = gpt_oss.NAMES[m.group(2)]
        return [Part(f"model.layers.{m.group(1)}.{hf}", layout=layout)]
    m = _OURS_MOE.fullmatch(name)
    if m:
        block = f"model.layers.{m.group(1)}.{family.moe}"
        if m.group(3) is None:
            return [Part(f"{block}.gate.weight")]
        expert = family.expert_names[_EXPERT_STACKS.index(m.group(3))]
        return [Part(f"{block}.experts.{j}.{expert}.weight", j) for j in range(args.moe_experts)]
    m = _OURS_LAYER.fullmatch(name)
    if m and family.fused:
        for hf, ours in FUSED.items():
            if m.group(2) in ours:
                return [Part(f"model.layers.{m.group(1)}.{hf}", None, _rows(ours, m.group(2), args))]
    names = _block_names(family)
    if m and m.group(2) in names:
        return [Part(f"model.layers.{m.group(1)}.{names[m.group(2)]}")]
    raise KeyError(f"no Hugging Face counterpart for parameter {name!r}")


def _rows(stacked: tuple[str, ...], ours: str, args: ModelArgs) -> tuple[int, int]:
    """The rows of a fused HF tensor that our `ours` (one of `stacked`) fills."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    sizes = {"attention.wq.weight": q, "attention.wk.weight": kv, "attention.wv.weight": kv,
             "feed_forward.w1.weight": args.ffn_dim, "feed_forward.w3.weight": args.ffn_dim}
    start = sum(sizes[n] for n in stacked[:stacked.index(ours)])
    return start, start + sizes[ours]


def hf_names(name: str, args: ModelArgs, family: Family | None = None) -> list[tuple[str, int | None]]:
    """Our parameter name -> the HF names holding it, with the expert each one is."""
    return [(p.hf, p.expert) for p in hf_parts(name, args, family)]


def hf_name(name: str, family: Family | None = None) -> str:
    """Our parameter name -> the HF one (a whole tensor: not an expert, not fused)."""
    if name in TOP:
        return TOP[name]
    m = _OURS_LAYER.fullmatch(name)
    names = _block_names(family)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    raise KeyError(f"no Hugging Face counterpart for parameter {name!r}")


def our_parts(name: str, args: ModelArgs, family: Family | None = None) -> list[tuple[str, Part]]:
    """A HF tensor name -> [(our parameter, where it is in that tensor)]; [] for buffers HF
    saved that we rebuild. Raises KeyError for a name no family of ours has."""
    m = _HF_LAYER.fullmatch(name)
    if m and args.n_layers <= int(m.group(1)) < args.n_layers + args.mtp_depth:  # a multi-token prediction module's
        d = int(m.group(1)) - args.n_layers
        if m.group(2) in MTP_COPIES:
            return []
        back = {hf: ours for ours, hf in MTP.items()}
        if m.group(2) in back:
            return [(f"mtp.{d}.{back[m.group(2)]}", Part(name))]
        inner = f"layers.{m.group(1)}."
        return [(f"mtp.{d}.block.{ours[len(inner):]}", part) for ours, part in _our_parts(name, args, family)]
    return _our_parts(name, args, family)


def _our_parts(name: str, args: ModelArgs, family: Family | None = None) -> list[tuple[str, Part]]:
    if _HF_IGNORED.fullmatch(name):
        return []
    family = family or family_of(args)
    m = _HF_LAYER.fullmatch(name)
    if m and family.model_type == "gpt_oss":
        inner, quantized = m.group(2), False
        if inner.endswith(("_blocks", "_scales")) and inner[:-7] in gpt_oss.QUANTIZED:
            if inner.endswith("_scales"):
                return []  # read with its blocks
            inner, quantized = inner[:-7], True
        if inner in gpt_oss.BACK:
            return [(f"layers.{m.group(1)}.{ours}", Part(name, layout=layout, mxfp4=quantized))
                    for ours, layout in gpt_oss.BACK[inner]]
    m = _HF_EXPERT.fullmatch(name)
    if m and m.group(3) in _EXPERT_OF:
        return [(f"layers.{m.group(1)}.feed_forward.experts.{_EXPERT_OF[m.group(3)]}", Part(name, int(m.group(2))))]
    m = _HF_ROUTER.fullmatch(name)
    if m:
        return [(f"layers.{m.group(1)}.feed_forward.router.weight", Part(name))]
    if name in _TOP_BACK:
        return [(_TOP_BACK[name], Part(name))]
    m = _HF_LAYER.fullmatch(name)
    if m and m.group(2) in FUSED:
        stacked = FUSED[m.group(2)]
        return [(f"layers.{m.group(1)}.{ours}", Part(name, None, _rows(stacked, ours, args))) for ours in stacked]
    back = {hf: ours for ours, hf in _block_names(family).items()}
    if m and m.group(2) in back:
        return [(f"layers.{m.group(1)}.{back[m.group(2)]}", Part(name))]
    raise KeyError(f"no ndtrain counterpart for Hugging Face parameter {name!r}")


def to_hf_state_dict(model_state: dict[str, Tensor], args: ModelArgs, family: Family | None = None) -> dict[str, Tensor]:
    """Our names -> HF names. The tensors are shared, not copied (a fused one is a copy)."""
    family = family or family_of(args)
    hf: dict[str, Tensor] = {}
    fused: dict[str, list[tuple[int, Tensor]]] = {}
    views: dict[str, dict[str, Tensor]] = {}
    for name, t in model_state.items():
        if name == "output.weight" and args.tie_embeddings and "tok_embeddings.weight" in model_state:
            continue
        (part,) = hf_parts(name, args, family)
        if part.layout:
            views.setdefault(part.hf, {})[part.layout] = t
        elif part.rows is None:
            hf[part.hf] = t
        else:
            fused.setdefault(part.hf, []).append((part.rows[0], t))
    for name, pieces in fused.items():
        hf[name] = torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])])
    for name, pieces in views.items():
        hf[name] = gpt_oss.hf_from_ours(pieces)
    return hf


def from_hf_state_dict(hf_state: dict[str, Tensor], args: ModelArgs, family: Family | None = None) -> dict[str, Tensor]:
    """HF names -> ours. The tensors are shared, not copied (a fused one's rows are views)."""
    ours = {}
    for name, t in hf_state.items():
        for mine, part in our_parts(name, args, family):
            if part.layout or part.mxfp4:
                whole = gpt_oss.dequantize_mxfp4(t, hf_state[name[:-len("_blocks")] + "_scales"]) if part.mxfp4 else t
                ours[mine] = gpt_oss.ours_from_hf(part.layout, whole)
                continue
            ours[mine] = t if part.rows is None else t[part.rows[0]:part.rows[1]]
    if args.tie_embeddings and "tok_embeddings.weight" in ours:
        ours["output.weight"] = ours["tok_embeddings.weight"]
    return ours


# ---------------------------------------------------------------------------------------
# config.json of an exported model


def hf_config(args: ModelArgs, family: Family | None = None) -> dict:
    """Keyword arguments for the family's `transformers` config class (`LlamaConfig`,
    `Qwen2Config`, ...) describing the same model."""
    family = family or family_of(args)
    rope = scaling_of(args.rope_scaling)
    max_len = args.max_seq_len
    if rope["rope_type"] == "dynamic":  # transformers' max_position_embeddings is where it starts
        max_len = rope["original_max_position_embeddings"]
        rope = {k: v for k, v in rope.items() if k != "original_max_position_embeddings"}
    out = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=max_len,
        rope_theta=args.rope_theta,
        rope_scaling=rope if rope["rope_type"] != "default" else None,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
    )
    out.update({key: False for key in family.refused if key != "use_bidirectional_attention"})
    if family.fused and rope["rope_type"] == "longrope":
        out["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    out.update(_window_config(args, family))
    if family.gemma:
        out.pop("hidden_act")
        scalar = args.query_pre_attn_scalar or args.head_dim
        out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,
                   attn_logit_softcapping=args.attn_softcap or None, final_logit_softcapping=args.logit_softcap or None)
    if family.model_type == "gemma3_text":  # one rotary per layer type
        full = {**(out.pop("rope_scaling") or {"rope_type": "default"}), "rope_theta": out.pop("rope_theta")}
        local = {"rope_type": "default", "rope_theta": args.rope_local_theta or args.rope_theta}
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    if family.model_type == "mixtral":
        out.update(intermediate_size=args.expert_dim, num_local_experts=args.moe_experts,
                   num_experts_per_tok=args.moe_top_k)
    elif family.deepseek:
        out.update(hf_deepseek.deepseek_config(args), moe_intermediate_size=args.expert_dim)
    elif family.model_type == "qwen3_moe":
        out.update(moe_intermediate_size=args.expert_dim, num_experts=args.moe_experts,
                   num_experts_per_tok=args.moe_top_k, norm_topk_prob=args.moe_norm_topk,
                   decoder_sparse_step=args.moe_every, mlp_only_layers=[])
    elif family.model_type == "gpt_oss":
        out.update(intermediate_size=args.expert_dim, num_local_experts=args.moe_experts,
                   num_experts_per_tok=args.moe_top_k, swiglu_limit=args.moe_swiglu_limit, swiglu_alpha=1.702,
                   attention_bias=True)
    return out


def _window_config(args: ModelArgs, family: Family) -> dict:
    window = args.sliding_window or None
    layers = range(args.n_layers) if args.window_layers is None else args.window_layers
    types = ["sliding_attention" if window and i in layers else "full_attention" for i in range(args.n_layers)]
    if family.window == "all":
        return {"sliding_window": window}
    if family.window == "qwen_all":
        return {"use_sliding_window": bool(window), "sliding_window": window}
    if family.window == "qwen":
        first = min(layers, default=args.n_layers) if window else args.n_layers
        return {"use_sliding_window": bool(window), "sliding_window": window, "max_window_layers": first,
                "layer_types": types}
    if family.window in ("alternating", "gemma3"):
        return {"sliding_window": window, "layer_types": types}
    return {}


def hf_config_json(args: ModelArgs, dtype: str, base: dict | None = None) -> dict:
    """config.json of an exported model: the config, its family and dtype. `base` (the
    config.json the model came from) keeps its family and the keys we do not own (token
    ids and the like)."""
    base = dict(base or {})
    family = family_of(args, base.get("model_type"))
    # quantization_config: the weights are written as they are held (gpt-oss's MXFP4 experts dequantized)
    for key in ("rope_parameters", "rope_scaling", "layer_types", "torch_dtype", "dtype", "architectures",
                "quantization_config"):
        base.pop(key, None)
    return {**base, "architectures": [family.architecture], "model_type": family.model_type,
            "torch_dtype": dtype, **hf_config(args, family)}


def source_dtype(config: dict) -> str | None:
    """The dtype a config.json names (`torch_dtype`, or `dtype` in transformers 5)."""
    value = config.get("torch_dtype") or config.get("dtype")
    return value if isinstance(value, str) else None

