"""The keys of DeepSeek-V3's features (model/args.py): multi-head latent attention, group-
limited routing, dense first blocks, multi-token prediction; each against the model's shape
(`shape_problem`'s rules, named by their config key) and what the layouts cannot do with it."""

from __future__ import annotations

from ndtrain.config.schema import Config, ConfigError
from ndtrain.model.args import ModelArgs, shape_problem

KEYS = ("attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "rope_interleave", "moe_groups", "moe_topk_groups", "first_k_dense", "mtp_depth")


def check_deepseek(cfg: Config, a: ModelArgs) -> None:
    problem = shape_problem(a)
    if problem and problem[0] in KEYS + (("head_dim", "n_kv_heads") if a.is_mla else ()) + (
            ("moe_top_k",) if a.moe_groups > 1 else ()):
        key, value, rule = problem
        raise ConfigError(f"model.{key}", value, rule)
    if a.mtp_depth:
        check_mtp(cfg, a)
    if not a.is_mla:
        mla = [k for k in KEYS[1:7] if getattr(cfg.model, k) not in (None, 0, False)]
        if mla:
            raise ConfigError(f"model.{mla[0]}", getattr(cfg.model, mla[0]), "is a key of latent attention: needs "
                              "model.attention = 'mla'")
        return


def check_mtp(cfg: Config, a: ModelArgs) -> None:
    """Multi-token prediction (model/mtp.py) runs on every layout."""
    if not 0 < cfg.train.mtp_weight < float("inf"):
        raise ConfigError("train.mtp_weight", cfg.train.mtp_weight, "must be > 0 with model.mtp_depth > 0 (0 would "
                          "leave the MTP modules untrained; use model.mtp_depth = 0)")
    if a.mtp_depth >= cfg.train.seq_len:
        raise ConfigError("model.mtp_depth", a.mtp_depth, f"must be less than train.seq_len = {cfg.train.seq_len}")
