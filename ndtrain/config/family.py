"""The model keys of Hugging Face families' features (rotary scalings, sliding windows,
Gemma 2's norms and soft-capping): each key on its own, then against the model and the
layout."""

from __future__ import annotations

import re

from ndtrain.config.schema import Config, ConfigError, ModelConfig
from ndtrain.config.sections import positive
from ndtrain.model.args import ModelArgs


def check_family_keys(m: ModelConfig) -> None:
    """The keys of model/args.py's family features, each on its own."""
    from ndtrain.model.llama import ACTIVATIONS
    for key in ("sliding_window", "norm_offset", "embed_scale", "query_pre_attn_scalar", "attn_softcap",
                "logit_softcap", "moe_swiglu_limit", "rope_local_theta"):
        positive(f"model.{key}", getattr(m, key), zero_ok=key != "embed_scale")
    if m.mlp_act is not None and m.mlp_act not in ACTIVATIONS:
        raise ConfigError("model.mlp_act", m.mlp_act, f"choose one of {', '.join(ACTIVATIONS)}")
    if m.window_layers is not None and not re.fullmatch(r"\s*(\d+\s*(,\s*\d+\s*)*)?", m.window_layers):
        raise ConfigError("model.window_layers", m.window_layers, "expected layer indices separated by commas, "
                          "e.g. 0,2,4 (none: every layer)")


def check_family(cfg: Config, a: ModelArgs) -> None:
    """The family features against the model and the layout: a rotary scaling we can
    compute, windowed layers that exist, and what context parallelism cannot do."""
    from ndtrain.model.rope import LENGTH_DEPENDENT, scaling_of, scaling_problem
    problem = scaling_problem(a.rope_scaling, a.rope_dim)
    if problem:
        raise ConfigError("model.rope_scaling", a.rope_scaling, problem)
    outside = [i for i in a.window_layers or () if i >= a.n_layers]
    if outside:
        raise ConfigError("model.window_layers", cfg.model.window_layers, f"layer {outside[0]} is not one of the "
                          f"model's {a.n_layers}")
    if a.qk_norm_all and not a.qk_norm:
        raise ConfigError("model.qk_norm_all", True, "needs model.qk_norm = true (it says how wide the q/k norms are)")
    if not a.pre_norm and not a.sandwich_norm:
        raise ConfigError("model.pre_norm", False, "needs model.sandwich_norm = true (OLMo 2's norms after the "
                          "sublayers), else the blocks have no norm")
    tp = cfg.parallel.tp
    if tp > 1 and a.qk_norm_all and a.n_kv_heads % tp:
        raise ConfigError("model.qk_norm_all", True, f"with parallel.tp = {tp}: the key norm over all KV heads needs "
                          f"them split over tp, and tp does not divide model.n_kv_heads = {a.n_kv_heads} (a rank "
                          "would compute only the head it reads)")
    cp = cfg.parallel.cp
    if cp > 1 and a.attn_softcap:
        raise ConfigError("parallel.cp", cp, f"model.attn_softcap = {a.attn_softcap} (Gemma 2) caps attention "
                          "scores inside the kernel; context parallelism's attention kernels have no soft-capping "
                          "(use cp = 1)")
    rope = scaling_of(a.rope_scaling)
    if cp > 1 and rope["rope_type"] in LENGTH_DEPENDENT and cfg.train.seq_len > rope["original_max_position_embeddings"]:
        raise ConfigError("parallel.cp", cp, f"{rope['rope_type']} rotary scaling picks its frequencies from the "
                          "longest position of the whole sequence, which a context-parallel rank does not see; "
                          f"train.seq_len = {cfg.train.seq_len} exceeds the original context "
                          f"{rope['original_max_position_embeddings']} (use cp = 1 or a shorter train.seq_len)")
