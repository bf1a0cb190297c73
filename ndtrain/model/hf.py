"""Conversion between our state dicts and Hugging Face `LlamaForCausalLM` ones.

Our rotary convention is HF's (half-split pairs), so weights map one to one by name: no
permutation of wq/wk is needed. Partial state dicts (one pipeline stage's) convert too.

Tied embeddings: HF checkpoints of tied models store the matrix once, as
`model.embed_tokens.weight`, so `to_hf_state_dict` leaves `lm_head.weight` out when the
embedding is there, and `from_hf_state_dict` fills `output.weight` from the embedding when
`lm_head.weight` is missing.
"""

from __future__ import annotations

import re

from torch import Tensor

from .args import ModelArgs

# Names inside one block: ours -> HF's (both relative to the layer prefix).
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_BACK = {hf: ours for ours, hf in _BLOCK.items()}
_TOP_BACK = {hf: ours for ours, hf in _TOP.items()}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # a buffer older HF versions saved


def _rename(name: str, top: dict, block: dict, layer_re: re.Pattern, layer_prefix: str) -> str:
    if name in top:
        return top[name]
    m = layer_re.fullmatch(name)
    if m and m.group(2) in block:
        return f"{layer_prefix}{m.group(1)}.{block[m.group(2)]}"
    raise KeyError(f"no Hugging Face Llama counterpart for parameter {name!r}")


def to_hf_state_dict(model_state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Our names -> `LlamaForCausalLM` names. The tensors are shared, not copied."""
    hf = {}
    for name, t in model_state.items():
        if name == "output.weight" and args.tie_embeddings and "tok_embeddings.weight" in model_state:
            continue
        hf[_rename(name, _TOP, _BLOCK, _OURS_LAYER, "model.layers.")] = t
    return hf


def from_hf_state_dict(hf_state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """`LlamaForCausalLM` names -> ours. The tensors are shared, not copied."""
    ours = {}
    for name, t in hf_state.items():
        if _HF_IGNORED.fullmatch(name):
            continue
        ours[_rename(name, _TOP_BACK, _BLOCK_BACK, _HF_LAYER, "layers.")] = t
    if args.tie_embeddings and "tok_embeddings.weight" in ours and "output.weight" not in ours:
        ours["output.weight"] = ours["tok_embeddings.weight"]
    return ours


def hf_config(args: ModelArgs) -> dict:
    """Keyword arguments for `transformers.LlamaConfig` describing the same model."""
    return dict(
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
        attention_bias=False,
        mlp_bias=False,
    )


def args_from_hf_config(config) -> ModelArgs:
    """The `ModelArgs` of a `transformers.LlamaConfig` (or its dict). Only default
    (unscaled) rotary embeddings are supported."""
    c = config if isinstance(config, dict) else config.to_dict()
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported")
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    args = ModelArgs(
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
    )
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim != args.head_dim:
        raise ValueError(f"head_dim {head_dim} != hidden_size / num_attention_heads = {args.head_dim}")
    return args
