"""Validation of the task sections: the sft, rl and dpo keys on their own (`validate` checks
them for every command), and `check_rl_job` and `check_dpo_job`, what `ndtrain rl` and
`ndtrain dpo` need of a validated config."""

from __future__ import annotations

import re

from ndtrain.config.schema import Config, ConfigError, DPOConfig, RLConfig, SFTConfig
from ndtrain.config.sections import positive
from ndtrain.model.args import PRESETS

RL_TASKS = ("addition", "reverse", "sort", "countdown")
RL_LOSSES = ("reinforce", "grpo", "dr_grpo", "dapo")
RL_SIZES = {"addition": (1, 9), "reverse": (2, 30), "sort": (2, 20), "countdown": (2, 6)}
_SCORE = re.compile(r"^(exact|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")


def check_sft(s: SFTConfig) -> None:
    positive("sft.generate", s.generate, zero_ok=True)
    positive("sft.max_new_tokens", s.max_new_tokens)
    if not _SCORE.match(s.score):
        raise ConfigError("sft.score", s.score, "choose exact, or MODULE:FUNCTION (a function of prompt, "
                          "completion and reference that returns a number)")


OFF_POLICY = ("tis", "decoupled")


def check_rl(r: RLConfig) -> None:
    """The rl keys on their own; `check_rl_job` adds what only `ndtrain rl` needs."""
    if r.task not in RL_TASKS:
        raise ConfigError("rl.task", r.task, f"choose one of {', '.join(RL_TASKS)}")
    lo, hi = RL_SIZES[r.task]
    if not lo <= r.size <= hi:
        raise ConfigError("rl.size", r.size, f"must be in [{lo}, {hi}] for rl.task = {r.task}")
    if r.loss not in RL_LOSSES:
        raise ConfigError("rl.loss", r.loss, f"choose one of {', '.join(RL_LOSSES)}")
    if r.reward not in ("builtin", "math") and not _SCORE.match(r.reward):
        raise ConfigError("rl.reward", r.reward, "choose builtin, exact, math, or MODULE:FUNCTION (a function of "
                          "prompt, completion and answer that returns a number)")
    for key in ("group_size", "max_new_tokens", "ppo_epochs", "logprob_tol"):
        positive(f"rl.{key}", getattr(r, key))
    for key in ("top_k", "kl_coef", "max_refills", "overlong_buffer", "eval_prompts", "pass_k", "warmup_steps",
                "format_reward", "temperature", "generate_tp"):
        positive(f"rl.{key}", getattr(r, key), zero_ok=True)
    positive("rl.warmup_examples", r.warmup_examples)
    for key in ("generate_ranks", "max_staleness"):
        positive(f"rl.{key}", getattr(r, key), zero_ok=True)
    positive("rl.exchange_timeout_s", r.exchange_timeout_s)
    if r.async_weights not in ("fixed", "newest"):
        raise ConfigError("rl.async_weights", r.async_weights, "choose fixed or newest")
    if r.off_policy not in OFF_POLICY:
        raise ConfigError("rl.off_policy", r.off_policy, f"choose one of {', '.join(OFF_POLICY)}")
    if r.tis_cap < 1.0:
        raise ConfigError("rl.tis_cap", r.tis_cap, "must be >= 1 (a cap below 1 would shrink even fresh tokens' weight)")
    if not 0.0 <= r.long_tail <= 1.0:
        raise ConfigError("rl.long_tail", r.long_tail, "must be in [0, 1] (the share of prompts that may run to "
                          "rl.max_new_tokens; 0 = every prompt)")
    positive("rl.partial_tokens", r.partial_tokens)
    if r.partial_rollout not in ("finish", "continue"):
        raise ConfigError("rl.partial_rollout", r.partial_rollout, "choose finish or continue")
    if r.partial_rollout == "continue" and not r.generate_ranks:
        raise ConfigError("rl.partial_rollout", r.partial_rollout, "needs rl.generate_ranks >= 1: generation on the "
                          "training ranks is never interrupted by a weight update")
    if r.max_staleness and not r.generate_ranks:
        raise ConfigError("rl.max_staleness", r.max_staleness, "needs rl.generate_ranks >= 1: generation on the "
                          "training ranks is synchronous (staleness 0)")
    positive("rl.warmup_check_every", r.warmup_check_every)
    if not 0.0 <= r.warmup_target <= 1.0:
        raise ConfigError("rl.warmup_target", r.warmup_target, "must be in [0, 1] (a held-out pass@1; 0 = train all "
                          "rl.warmup_steps)")
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError("rl.top_p", r.top_p, "must be in (0, 1]")
    if not 0.0 <= r.clip_low < 1.0:
        raise ConfigError("rl.clip_low", r.clip_low, "must be in [0, 1): the ratio is clipped to [1 - clip_low, "
                          "1 + clip_high]")
    positive("rl.clip_high", r.clip_high, zero_ok=True)
    if r.overlong_buffer is not None and r.overlong_buffer >= r.max_new_tokens:
        raise ConfigError("rl.overlong_buffer", r.overlong_buffer,
                          f"must be less than rl.max_new_tokens = {r.max_new_tokens}")


def refuse_mtp(cfg: Config, command: str) -> None:
    """Multi-token prediction (model/mtp.py) trains on pretraining's and SFT's token loss."""
    depth = cfg.model.mtp_depth if cfg.model.mtp_depth is not None else PRESETS[cfg.model.preset].mtp_depth
    if depth:
        raise ConfigError("model.mtp_depth", depth, f"multi-token prediction trains on the token loss of pretraining "
                          f"and SFT, not {command}'s objective; use 0")


def check_rl_job(cfg: Config) -> None:
    """What `ndtrain rl` needs of a validated config: whole groups on every data-parallel
    rank, groups that can disagree, an update rule that fits the batch."""
    r, t, p = cfg.rl, cfg.train, cfg.parallel
    refuse_mtp(cfg, "ndtrain rl")
    if r.generate_ranks and r.exchange_timeout_s >= cfg.run.collective_timeout_s:
        raise ConfigError("rl.exchange_timeout_s", r.exchange_timeout_s, "must be below run.collective_timeout_s = "
                          f"{cfg.run.collective_timeout_s:g}: the other training ranks wait for rank 0's rollout in a "
                          "collective, which would time out first, without naming the generator")
    if r.loss != "reinforce" and r.group_size < 2:
        raise ConfigError("rl.group_size", r.group_size, f"rl.loss = {r.loss} normalises rewards within a group of "
                          "completions of one prompt: it needs at least 2 (or rl.loss = reinforce)")
    if t.global_batch % (r.group_size * p.dp):
        raise ConfigError("train.global_batch", t.global_batch,
                          f"must be divisible by rl.group_size × dp = {r.group_size} × {p.dp} = {r.group_size * p.dp} "
                          "(each data-parallel rank trains on whole groups)")
    if r.loss != "reinforce" and r.temperature == 0:
        raise ConfigError("rl.temperature", 0.0, "greedy sampling gives a group the same completion every time: "
                          "its rewards never differ, so there is nothing to learn; use a temperature > 0")
    if r.loss == "reinforce" and r.ppo_epochs > 1:
        raise ConfigError("rl.ppo_epochs", r.ppo_epochs, "reinforce has no importance ratio, so it cannot reuse a "
                          "batch; use grpo, dr_grpo or dapo for several updates per rollout")
    a = cfg.model_args()
    if a.dropout > 0:
        raise ConfigError("model.dropout", a.dropout, "RL compares the sampler's log-probabilities (no dropout) with "
                          "the training forward's and trains on their ratio: with dropout they disagree; use 0")
    if a.is_moe and a.moe_capacity > 0:
        raise ConfigError("model.moe_capacity", a.moe_capacity, "dropping tokens over an expert's capacity depends "
                          "on the tokens of each forward, which differ between sampling (one token at a time) and "
                          "the update: their log-probabilities would disagree; use 0 (dropless)")
    if r.generate_tp and (p.world % r.generate_tp or r.generate_tp > p.world):
        raise ConfigError("rl.generate_tp", r.generate_tp, f"must divide the {p.world} processes (consecutive ranks "
                          "generate together; the groups of them generate data-parallel)")
    g = r.generate_tp
    if g > 1 and (a.n_heads % g or (a.n_kv_heads % g and g % a.n_kv_heads) or a.ffn_dim % g):
        raise ConfigError("rl.generate_tp", g, f"tensor parallelism of generation splits the heads "
                          f"({a.n_heads}, {a.n_kv_heads} key/value) and the MLP ({a.ffn_dim}): each must be divisible by "
                          "it (key/value heads may instead divide it)")


def check_dpo(d: DPOConfig) -> None:
    if not d.beta > 0:
        raise ConfigError("dpo.beta", d.beta, "must be > 0 (the loss is −log σ(β · margin); β = 0 learns nothing)")
    positive("dpo.warmup_steps", d.warmup_steps, zero_ok=True)


def check_dpo_job(cfg: Config) -> None:
    """What `ndtrain dpo` needs of a validated config: each pair's loss is a function of its
    whole answers' summed log-probabilities, so a row may not be cut over ranks."""
    refuse_mtp(cfg, "ndtrain dpo")
    if cfg.parallel.cp > 1:
        raise ConfigError("parallel.cp", cfg.parallel.cp, "ndtrain dpo needs each pair's whole row on one rank (its "
                          "loss is a function of both answers' summed log-probabilities); use dp, zero, tp or pp")
