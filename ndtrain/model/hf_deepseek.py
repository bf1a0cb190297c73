"""DeepSeek-V3's config.json (model_type deepseek_v3; Kimi K2's kimi_k2 is the same
architecture and keys) ⇄ the `ModelArgs` fields of latent attention, group-limited sigmoid
routing, dense first blocks and multi-token prediction. model/hf_config.py calls these for
the two families; every other key is read as for any family.

What is refused, and why: `num_key_value_heads` other than the head count (latent
attention gives every head its own key and value; transformers' code would repeat them),
`scoring_func` other than sigmoid and `topk_method` other than noaux_tc (the V2 routers,
which transformers' deepseek_v3 does not run either), `moe_layer_freq` other than 1
(transformers ignores it: every block from first_k_dense_replace on has experts), and
`attention_bias` (no checkpoint has it; our latent attention has no biases).
"""

from __future__ import annotations

DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
                max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                rope_interleave=True, attention_bias=False, num_nextn_predict_layers=1, head_dim=None,
                scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
MODEL_TYPES = ("deepseek_v3", "kimi_k2")


def head_dim(c: dict, family, keys) -> int:
    """The query·key width. `keys`: model/hf_config.py's readers (get, count, positive, error),
    handed in so that this module does not import the one that imports it."""
    return keys.count(c, family, "qk_nope_head_dim") + keys.count(c, family, "qk_rope_head_dim")


def deepseek_args(c: dict, family, keys) -> dict:
    """The DeepSeek-V3 fields of `ModelArgs` (the rest: hf_config.args_from_hf_config);
    `keys` as in `head_dim`."""
    HFConfigError, _count, _get, _positive = keys.error, keys.count, keys.get, keys.positive
    heads = _count(c, family, "num_attention_heads")
    kv = _count(c, family, "num_key_value_heads", None) or heads
    if kv != heads:
        raise HFConfigError("num_key_value_heads", kv, f"must equal num_attention_heads = {heads} (latent attention "
                            "gives every head its own key and value)")
    for key, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        value = _get(c, family, key)
        if value != wanted:
            raise HFConfigError(key, value, f"only {wanted!r} is supported (DeepSeek-V3's; transformers' deepseek_v3 "
                                "runs nothing else)")
    mtp = c.get("num_nextn_predict_layers", c.get("num_mtp_layers", family.defaults["num_nextn_predict_layers"]))
    if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
        raise HFConfigError("num_nextn_predict_layers", mtp, "must be a non-negative integer")
    return dict(
        attention="mla",
        q_lora_rank=_count(c, family, "q_lora_rank", 0), kv_lora_rank=_count(c, family, "kv_lora_rank"),
        qk_nope_head_dim=_count(c, family, "qk_nope_head_dim"), qk_rope_head_dim=_count(c, family, "qk_rope_head_dim"),
        v_head_dim=_count(c, family, "v_head_dim"), rope_interleave=bool(_get(c, family, "rope_interleave")),
        moe_experts=_count(c, family, "n_routed_experts"), moe_top_k=_count(c, family, "num_experts_per_tok"),
        moe_ffn_dim=_count(c, family, "moe_intermediate_size"),
        moe_shared_experts=_count(c, family, "n_shared_experts", 0), moe_router="sigmoid",
        moe_norm_topk=bool(_get(c, family, "norm_topk_prob")),
        moe_route_scale=_positive(_get(c, family, "routed_scaling_factor"), "routed_scaling_factor"),
        moe_groups=_count(c, family, "n_group", 1), moe_topk_groups=_count(c, family, "topk_group", 1),
        first_k_dense=_first_k(c, family, keys), mtp_depth=mtp)


def _first_k(c: dict, family, keys) -> int:
    value = keys.get(c, family, "first_k_dense_replace")
    value = 0 if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise keys.error("first_k_dense_replace", value, "must be a non-negative integer")
    return value


def holds(a) -> str | None:
    """Why deepseek_v3 cannot hold a model of these args (None: it can)."""
    if not (a.is_mla and a.is_moe):
        return "deepseek_v3 has latent attention and experts"
    if a.moe_router != "sigmoid" or a.moe_capacity or a.moe_every != 1 or a.sliding_window:
        return "deepseek_v3 routes by sigmoid, dropless, with experts in every block after the dense ones, no window"
    return None


def deepseek_config(a) -> dict:
    """The deepseek_v3 keys of a config.json describing `a`."""
    return dict(num_key_value_heads=a.n_heads, head_dim=a.qk_rope_head_dim, q_lora_rank=a.q_lora_rank or None,
                kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                v_head_dim=a.v_head_dim, rope_interleave=a.rope_interleave, n_routed_experts=a.moe_experts,
                num_experts_per_tok=a.moe_top_k, moe_intermediate_size=a.expert_dim,
                n_shared_experts=a.moe_shared_experts, norm_topk_prob=a.moe_norm_topk,
                routed_scaling_factor=a.moe_route_scale, n_group=a.moe_groups, topk_group=a.moe_topk_groups,
                first_k_dense_replace=a.first_k_dense, num_nextn_predict_layers=a.mtp_depth, attention_bias=False)
