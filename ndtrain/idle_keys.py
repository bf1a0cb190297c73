"""Keys that do nothing in the chosen layout.

A key the user set, in the config file or on the command line, that the chosen layout never
reads is almost always a mistake: its author believes a setting is active that is not
(`parallel.reshard_after_forward=false` without ZeRO-3, `parallel.sp=true` without tensor
parallelism). Each such key gets one warning line that names it and says what it would
need. The run goes on: the configuration is valid, only one key of it is idle.

Keys left at their default stay silent, and so does a key set explicitly to its default
value: it changes nothing either way, and a file that lists every key (configs/default.toml)
must not warn about half of them.
"""

from __future__ import annotations

from ndtrain.config import Config, is_prepared_folder

_DEFAULTS = Config()


def _value(cfg: Config, key: str):
    """The value as the user gave it (run.nproc = 0 in a file, which validation resolves to
    the process count), else as it is now."""
    section, name = key.split(".")
    return cfg.given[key] if key in cfg.given else getattr(getattr(cfg, section), name)


def _is_default(cfg: Config, key: str) -> bool:
    section, name = key.split(".")
    return _value(cfg, key) == getattr(getattr(_DEFAULTS, section), name)


def _is_moe(cfg: Config) -> bool:
    from ndtrain.model.args import PRESETS
    return cfg.model.preset in PRESETS and PRESETS[cfg.model.preset].is_moe


def _on_gpu(device: str) -> bool:
    if device == "cpu":
        return False
    import torch
    return torch.cuda.is_available()


def _rules(cfg: Config, world: int | None, command: str) -> list[tuple[str, bool, str]]:
    """(key, idle in this configuration, why): every key that some layout or command ignores."""
    p, t, d, r = cfg.parallel, cfg.train, cfg.data, cfg.run
    fp16, prepared = t.precision == "fp16", is_prepared_folder(d.path)
    scaling = ("loss_scale_init", "loss_scale_window", "loss_scale_min")
    rules = [
        ("parallel.reshard_after_forward", p.zero != 3, "only ZeRO-3 (parallel.zero=3) frees gathered parameters"),
        ("parallel.sp", p.tp == 1, "sequence parallelism needs tensor parallelism (parallel.tp > 1)"),
        ("parallel.cp_impl", p.cp == 1, "it picks context-parallel attention, which needs parallel.cp > 1"),
        ("parallel.bucket_mb", p.zero > 0, "ZeRO communicates per unit (a block, the root), not per bucket"),
        ("parallel.bucket_mb", p.zero == 0 and p.dp * p.cp == 1,
         "there is no data parallelism (parallel.dp = 1) whose gradients it would bucket"),
        ("parallel.dp_replicate", p.zero == 0 and r.fault_tolerance != "replicas",
         "without ZeRO every data-parallel rank holds everything; replicas only matter to HSDP (parallel.zero > 0) "
         "and to run.fault_tolerance = \"replicas\""),
        ("train.diloco_outer_lr", t.diloco_inner_steps == 0, "DiLoCo is off (train.diloco_inner_steps = 0)"),
        ("train.diloco_outer_momentum", t.diloco_inner_steps == 0, "DiLoCo is off (train.diloco_inner_steps = 0)"),
        ("train.reduce_fp32", t.precision not in ("bf16", "fp16"),
         f"gradients are reduced in the compute dtype, which is {t.precision} here, not bf16 or fp16"),
        ("train.loss_scaler", not fp16, "loss scaling is for train.precision = fp16 only"),
        ("train.allow_unscaled_fp16", not fp16 or t.loss_scaler,
         "it only permits train.precision = fp16 with train.loss_scaler = false"),
        *((f"train.{k}", not fp16 or not t.loss_scaler,
           "loss scaling is for train.precision = fp16 with train.loss_scaler = true only") for k in scaling),
        ("train.decay_fraction", t.schedule != "wsd", "only train.schedule = wsd decays over a fraction of the steps"),
        ("train.min_lr_ratio", t.schedule == "constant", "train.schedule = constant never decays"),
        ("train.eval_every", t.eval_batches == 0 and command != "rl", "train.eval_batches = 0 turns evaluation off"),
        ("train.moe_aux_loss", not _is_moe(cfg), f"model.preset = {cfg.model.preset!r} has no experts to balance"),
        ("data.vocab_size", bool(d.tokenizer) or prepared,
         "it sizes the BPE trained when there is no data.tokenizer and data.path is not a prepared folder"),
        *((f"data.{k}", prepared, "data.path is a prepared folder, read as it is")
          for k in ("tokenizer", "val_fraction", "text_key", "cache_dir")),
        ("run.threads", _on_gpu(r.device), "it sets CPU threads; this run computes on the GPU"),
        ("run.nproc", world is not None, "the launcher (torchrun or SLURM) decides the process count"),
    ]
    for key in ("pp_schedule", "pp_virtual", "pp_split"):
        rules.append((f"parallel.{key}", p.pp == 1, "needs pipeline parallelism (parallel.pp > 1)"))
    sft_keys = ["data.packing", "data.truncate", "sft.generate", "sft.max_new_tokens", "sft.score"]
    rules += [(key, command not in ("sft", "rl-warmup"), "only ndtrain sft reads it") for key in sft_keys]
    rules.append(("data.template", command not in ("sft", "rl-warmup", "dpo", "rl"), "only ndtrain sft and dpo read it"))
    rules.append(("data.on_bad_record", command == "train" and not d.sources and (prepared or d.path == "stdlib"),
                  "data.path is a prepared folder or the embedded corpus: no record is read that it could skip "
                  "(it applies where train prepares data.path or data.sources, and to sft, dpo and rl.data)"))
    rules += [(f"dpo.{k}", command != "dpo", "only ndtrain dpo reads it") for k in ("beta", "shuffle", "warmup_steps")]
    rules.append(("dpo.warmup_steps", command == "dpo" and "model.init_from" in cfg.explicit,
                  "model.init_from is set: there is no default warm-up"))
    rules += [(f"sft.{k}", cfg.sft.generate == 0, "sft.generate = 0 generates nothing") for k in ("max_new_tokens", "score")]
    rules.append(("data.text_key", command in ("sft", "rl-warmup", "dpo"), "SFT and DPO records are read whole "
                  "(messages, or prompt and completion / chosen and rejected)"))
    rules.append(("data.sources", command in ("sft", "rl", "rl-warmup", "dpo"), "only ndtrain train reads a mixture; "
                  "sft and dpo read data.path"))
    rules += _rl_rules(cfg, command)
    return rules


def _rl_rules(cfg: Config, command: str) -> list[tuple[str, bool, str]]:
    from dataclasses import fields

    from ndtrain.config import RLConfig
    r = cfg.rl
    if command == "rl-warmup":  # ndtrain sft, as the default RL job's warm-up: it reads the task's rl keys
        return []
    rules = [(f"rl.{f.name}", command != "rl", "only ndtrain rl reads it") for f in fields(RLConfig)]
    if command != "rl":
        return rules
    ratio = "reinforce has no importance ratio to clip"
    rules += [
        *((f"data.{k}", True, "ndtrain rl draws its prompts from rl.task or rl.data") for k in
          ("path", "vocab_size", "text_key", "packing", "truncate")),
        *((f"data.{k}", not r.data, "ndtrain rl draws its prompts from rl.task (rl.data is not set)") for k in
          ("val_fraction", "on_bad_record")),
        *((f"rl.{k}", bool(r.data), "rl.data gives the prompts") for k in ("task", "size")),
        ("rl.clip_low", r.loss == "reinforce", ratio), ("rl.clip_high", r.loss == "reinforce", ratio),
        ("rl.max_refills", r.loss != "dapo", "dynamic sampling (refilling groups) is dapo's"),
        ("rl.reverse_answer", r.task != "addition" or bool(r.data), "it writes addition's answers backwards"),
        ("rl.format_reward", r.reward not in ("builtin", "exact", "math"),
         "it adds to a checked reward; rl.reward is your function"),
        *((f"rl.{k}", "model.init_from" in cfg.explicit, "model.init_from is set: there is no default warm-up")
          for k in ("warmup_steps", "warmup_examples", "warmup_target", "warmup_check_every")),
        ("rl.warmup_check_every", "model.init_from" not in cfg.explicit and r.warmup_target == 0,
         "rl.warmup_target = 0: the warm-up runs all rl.warmup_steps, unchecked"),
        ("rl.pass_k", r.eval_prompts == 0, "rl.eval_prompts = 0 evaluates nothing"),
    ]
    return rules


def idle_keys(cfg: Config, world: int | None = None, command: str = "train") -> list[str]:
    """One line per key set explicitly (`cfg.explicit`), not to its default, that has no
    effect on this validated configuration of `command`. `world`: the launcher's process
    count, if any."""
    lines, seen = [], set()
    for key, idle, why in _rules(cfg, world, command):
        if idle and key in cfg.explicit and key not in seen and not _is_default(cfg, key):
            seen.add(key)
            value = _value(cfg, key)
            lines.append(f"{key} = {value!r} has no effect here: {why}")
    return lines
