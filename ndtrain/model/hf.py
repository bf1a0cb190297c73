"""Conversion between our models and Hugging Face causal LMs: names, configs, families.

Our rotary convention is HF's (half-split pairs), so weights map one to one by name: no
permutation of wq/wk is needed. Partial state dicts (one pipeline stage's) convert too.

Everything is a table. `NAMES` maps our parameter names to HF's (a family uses the rows its
parameters need); `FAMILIES` says what a `model_type` adds to the Llama block (q/k/v biases
for Qwen2, q/k norms and an explicit head_dim for Qwen3, routed experts for Mixtral and
Qwen3-MoE) and which config keys it refuses.

Mixture of experts: our experts are stacked, `feed_forward.experts.w1` [E, F, D] (w3 the
same, w2 [E, D, F]); a HF checkpoint stores one tensor per expert
(`block_sparse_moe.experts.{j}.w1.weight` in Mixtral, `mlp.experts.{j}.gate_proj.weight` in
Qwen3-MoE), which is the piece [j] of ours: `our_piece` says which, and the slice reader
(checkpoint/slices.py) assembles or cuts the stack like any other sharded tensor.

Tied embeddings: HF checkpoints of tied models store the matrix once, as
`model.embed_tokens.weight`, so `to_hf_state_dict` leaves `lm_head.weight` out when the
embedding is there, and `from_hf_state_dict` fills `output.weight` from the embedding when
`lm_head.weight` is missing (or stored anyway: the embedding is the one copy).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import Tensor

from .args import ModelArgs

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
}
TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_BACK = {hf: ours for ours, hf in BLOCK.items()}
_TOP_BACK = {hf: ours for ours, hf in TOP.items()}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # a buffer older HF versions saved


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False
    # config keys that must be false (or absent) for the weights to mean what ours do
    refused: tuple[str, ...] = ()
    # MoE: the block's module name and the names of gate, up and down in one expert
    moe: str = ""
    expert_names: tuple[str, str, str] = ()


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", refused=("attention_bias", "mlp_bias")),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, refused=("use_sliding_window",)),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, refused=("use_sliding_window", "attention_bias")),
    "mixtral": Family("mixtral", "MixtralForCausalLM", refused=("sliding_window",), moe="block_sparse_moe",
                      expert_names=("w1", "w3", "w2")),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True,
                        refused=("use_sliding_window", "attention_bias", "mlp_only_layers"), moe="mlp",
                        expert_names=("gate_proj", "up_proj", "down_proj")),
}
_EXPERT_STACKS = ("w1", "w3", "w2")  # ours, in the order of Family.expert_names


def family_of(args: ModelArgs) -> Family:
    """The HF family that holds a model of this shape."""
    if args.qk_norm and args.qkv_bias:
        raise ValueError("no Hugging Face family has both q/k/v biases and q/k norms")
    if args.is_moe:
        family = FAMILIES["qwen3_moe" if args.qk_norm else "mixtral"]
        plain = (args.moe_router == "softmax_topk" and args.moe_shared_experts == 0 and args.moe_capacity == 0
                 and args.moe_route_scale == 1.0)
        if args.qkv_bias or not plain or (family.moe == "block_sparse_moe" and (not args.moe_norm_topk
                                                                              or args.moe_every != 1)):
            raise ValueError("no Hugging Face family holds this mixture of experts (Mixtral: softmax router, "
                             "renormalised top-k, every block; Qwen3-MoE: q/k norms; neither has shared experts, "
                             "capacity or a route scale)")
        return family
    return FAMILIES["qwen3" if args.qk_norm else "qwen2" if args.qkv_bias else "llama"]


def hf_name(name: str) -> str:
    """Our parameter name -> the HF one."""
    if name in TOP:
        return TOP[name]
    m = _OURS_LAYER.fullmatch(name)
    if m and m.group(2) in BLOCK:
        return f"model.layers.{m.group(1)}.{BLOCK[m.group(2)]}"
    raise KeyError(f"no Hugging Face counterpart for parameter {name!r}")


_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_HF_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")
_OURS_MOE = re.compile(r"layers\.(\d+)\.feed_forward\.(router\.weight|experts\.(w1|w2|w3))")
_EXPERT_OF = {hf: ours for f in FAMILIES.values() for hf, ours in zip(f.expert_names, _EXPERT_STACKS)}


def our_piece(name: str) -> tuple[str, int | None] | None:
    """The HF parameter name -> (ours, the expert it is in our stack, or None); None for
    buffers HF saved that we rebuild."""
    m = _HF_EXPERT.fullmatch(name)
    if m and m.group(3) in _EXPERT_OF:
        return f"layers.{m.group(1)}.feed_forward.experts.{_EXPERT_OF[m.group(3)]}", int(m.group(2))
    m = _HF_ROUTER.fullmatch(name)
    if m:
        return f"layers.{m.group(1)}.feed_forward.router.weight", None
    ours = our_name(name)
    return None if ours is None else (ours, None)


def hf_names(name: str, args: ModelArgs) -> list[tuple[str, int | None]]:
    """Our parameter name -> the HF names holding it, with the expert each one is (an
    expert stack is E HF tensors, anything else one)."""
    m = _OURS_MOE.fullmatch(name)
    if not m:
        return [(hf_name(name), None)]
    family = family_of(args)
    block = f"model.layers.{m.group(1)}.{family.moe}"
    if m.group(3) is None:
        return [(f"{block}.gate.weight", None)]
    expert = family.expert_names[_EXPERT_STACKS.index(m.group(3))]
    return [(f"{block}.experts.{j}.{expert}.weight", j) for j in range(args.moe_experts)]


def our_name(name: str) -> str | None:
    """The HF parameter name -> ours (None for buffers HF saved that we rebuild)."""
    if _HF_IGNORED.fullmatch(name):
        return None
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = _HF_LAYER.fullmatch(name)
    if m and m.group(2) in _BLOCK_BACK:
        return f"layers.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}"
    raise KeyError(f"no ndtrain counterpart for Hugging Face parameter {name!r}")


def to_hf_state_dict(model_state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Our names -> HF names. The tensors are shared, not copied."""
    hf = {}
    for name, t in model_state.items():
        if name == "output.weight" and args.tie_embeddings and "tok_embeddings.weight" in model_state:
            continue
        hf[hf_name(name)] = t
    return hf


def from_hf_state_dict(hf_state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """HF names -> ours. The tensors are shared, not copied."""
    ours = {}
    for name, t in hf_state.items():
        mine = our_name(name)
        if mine is not None:
            ours[mine] = t
    if args.tie_embeddings and "tok_embeddings.weight" in ours:
        ours["output.weight"] = ours["tok_embeddings.weight"]
    return ours


def hf_config(args: ModelArgs) -> dict:
    """Keyword arguments for the family's `transformers` config class (`LlamaConfig`,
    `Qwen2Config`, `Qwen3Config`) describing the same model."""
    family = family_of(args)
    out = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=args.max_seq_len,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
    )
    out.update({key: False for key in family.refused})
    if family.model_type == "mixtral":
        out.update(intermediate_size=args.expert_dim, num_local_experts=args.moe_experts,
                   num_experts_per_tok=args.moe_top_k, sliding_window=None)
    elif family.model_type == "qwen3_moe":
        out.update(moe_intermediate_size=args.expert_dim, num_experts=args.moe_experts,
                   num_experts_per_tok=args.moe_top_k, norm_topk_prob=args.moe_norm_topk,
                   decoder_sparse_step=args.moe_every, mlp_only_layers=[])
    return out


def hf_config_json(args: ModelArgs, dtype: str) -> dict:
    """config.json of an exported model: the config, its family and dtype."""
    family = family_of(args)
    return {"architectures": [family.architecture], "model_type": family.model_type,
            "torch_dtype": dtype, **hf_config(args)}


def args_from_hf_config(config) -> ModelArgs:
    """The `ModelArgs` of a `transformers` config (or its dict) of a supported family. Only
    default (unscaled) rotary embeddings are supported."""
    c = config if isinstance(config, dict) else config.to_dict()
    family = FAMILIES.get(c.get("model_type", "llama"))
    if family is None:
        raise ValueError(f"model_type {c.get('model_type')!r} is not supported; known: {', '.join(FAMILIES)}")
    for key in family.refused:
        if c.get(key):
            raise ValueError(f"{family.model_type} with {key} = {c[key]!r} is not supported")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (SwiGLU needs silu)")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported")
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    return ModelArgs(
        dim=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        ffn_dim=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_seq_len=c["max_position_embeddings"],
        rope_theta=float(theta),
        norm_eps=c["rms_norm_eps"],
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        head_dim=c.get("head_dim") or None,
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        **_moe_args(family, c),
    )


def _moe_args(family: Family, c: dict) -> dict:
    """The MoE fields of `ModelArgs` from a Mixtral or Qwen3-MoE config."""
    if family.model_type == "mixtral":
        return dict(moe_experts=c["num_local_experts"], moe_top_k=c["num_experts_per_tok"],
                    moe_ffn_dim=c["intermediate_size"], moe_norm_topk=True)
    if family.model_type == "qwen3_moe":
        return dict(moe_experts=c.get("num_experts") or c["num_local_experts"], moe_top_k=c["num_experts_per_tok"],
                    moe_ffn_dim=c["moe_intermediate_size"], moe_norm_topk=bool(c.get("norm_topk_prob")),
                    moe_every=c.get("decoder_sparse_step") or 1)
    return {}
