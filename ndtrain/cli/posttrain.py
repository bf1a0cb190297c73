"""`ndtrain sft`, `ndtrain rl` and `ndtrain dpo`, and the runs their default jobs start from:
the default pretraining run (sft), the SFT warm-up on the task (rl) and on the pairs' answers
(dpo), each trained once through the CLI itself (`ndtrain.cli.main`) when none is found."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from ndtrain.launch import warn
from ndtrain.cli.run import (Stopped, check_fits, check_resume, choose_run_dir, layout_words, model_words,
                             run_task, warn_before_start, with_nproc)


def cmd_sft(args, make_task=None) -> int:
    """`ndtrain sft`; `make_task(cfg, data)` replaces the SFT task (the RL warm-up's)."""
    from ndtrain.checkpoint.sources import resolve_init_from
    from ndtrain.config.lora import check_lora_tokens
    from ndtrain.config import SFT_DEFAULTS, ConfigError, load_config, validate
    from ndtrain.config.faults import check_pretraining_only
    from ndtrain.data.sft import ShortSequence, prepare_sft
    from ndtrain.launch import external_world
    from ndtrain.train import sft

    cfg = with_nproc(load_config(args.config, args.overrides, defaults=SFT_DEFAULTS), args)
    check_pretraining_only(cfg, "sft")
    world = external_world()
    if cfg.model.init_from == "scratch":  # random weights; "" means the default pretraining run
        cfg.model.init_from = ""
    elif not cfg.model.init_from and not args.show_example:
        validate(cfg, world=world)
        if cfg.data.path != "stdlib-functions" and make_task is None:  # the user's data on the demo base
            warn([f"model.init_from is not set, so {cfg.data.path} fine-tunes the default {cfg.model.preset} model "
                  "pretrained on the standard library (trained first if runs/ has none), not a model of yours: "
                  "set model.init_from=run:DIR or hf:DIR (scratch: random weights)"])
        cfg.model.init_from = f"run:{default_pretraining_run(cfg, world)}"
    resolve_init_from(cfg)  # the model and tokenizer of model.init_from
    validate(cfg, world=world)
    check_fits(cfg, world)
    warn_before_start(cfg, world, "sft" if make_task is None else "rl-warmup")
    sft.load_score(cfg.sft.score)  # a bad scoring function fails here, not after training
    d, t = cfg.data, cfg.train
    template = sft.make_template(cfg, progress=cfg.run.progress)
    if cfg.model.vocab_size is not None and template.vocab_size > cfg.model.vocab_size:
        cfg.model.vocab_size = template.vocab_size  # the template's special tokens: rows added on loading
    check_lora_tokens(cfg, template.added_ids)
    try:
        data = prepare_sft(d.path, template, t.seq_len, d.truncate, d.val_fraction, d.on_bad_record, d.cache_dir)
    except ShortSequence as e:
        raise ConfigError("train.seq_len", t.seq_len, f"is smaller than the shortest example ({e.shortest} positions, "
                          f"{e.key}): packing would have to cut or drop every example") from None
    if args.show_example:
        print(sft.show_example(data), flush=True)
        return 0
    sft.check_score(cfg.sft.score, data)  # a scoring function that raises or returns no number fails here
    run_dir = choose_run_dir(cfg, "sft")
    resumed = check_resume(cfg, run_dir)
    banner = [f"ndtrain sft: {model_words(cfg)} from {cfg.model.init_from or 'random weights'}, "
              f"{layout_words(cfg)}, {t.steps} steps, packing {d.packing} → {run_dir}"
              + (f" (resuming {resumed.name})" if resumed else ""), data.describe()]
    return run_task(cfg, world, run_dir, sft.sft_worker, (cfg.to_dict(), str(run_dir), data, make_task),
                    ("ndtrain.train.sft", "ndtrain.train.trainer"), banner, sft.describe_summary, args.argv)


def cmd_rl(args) -> int:
    from ndtrain import supervisor
    from ndtrain.checkpoint.sources import resolve_init_from
    from ndtrain.config import RL_DEFAULTS, ConfigError, check_rl_job, load_config, validate
    from ndtrain.config.faults import check_pretraining_only
    from ndtrain.launch import external_world, launch_local, warn
    from ndtrain.train.rl import job
    from ndtrain.train.sft import make_template

    cfg = with_nproc(load_config(args.config, args.overrides, defaults=RL_DEFAULTS), args)
    check_pretraining_only(cfg, "rl")
    world = external_world()
    scratch = cfg.model.init_from == "scratch"  # random weights, the task's character tokenizer
    if scratch:
        cfg.model.init_from = ""
    validate(cfg, world=world)  # every key's own rules, the job's and the reward's, before anything runs
    check_rl_job(cfg)
    skipped = job.check_reward(cfg)  # rl.data is read here: a bad file stops the command before anything is written
    if skipped:
        warn([f"rl.data: skipped {len(skipped):,} bad records (data.on_bad_record=skip), first: {skipped[0]}"])
    if not cfg.rl.data:
        check_row_length(cfg, job.row_length(cfg, rounded=False))
        if not cfg.model.init_from:  # random weights or the default warm-up: the preset's context, before any warm-up
            check_context(cfg, job.row_length(cfg, rounded=False))
    if scratch and not cfg.data.tokenizer and not cfg.rl.data:
        cfg.data.tokenizer = str(job.char_tokenizer_file(cfg.data.cache_dir))
    elif not scratch and not cfg.model.init_from:
        if cfg.rl.data:
            raise ConfigError("model.init_from", "", "rl.data has no default warm-up: fine-tune on its training split "
                              f"first (ndtrain sft data.path={cfg.rl.data}), then set model.init_from=run:DIR")
        cfg.model.init_from = f"run:{default_warmup(cfg, world)}"
    resolve_init_from(cfg)  # the model and tokenizer of model.init_from
    template = make_template(cfg, progress=cfg.run.progress)
    need = job.row_length(cfg, rounded=False, template=template)
    if cfg.rl.data:
        check_row_length(cfg, need)
    check_context(cfg, need)
    if "train.seq_len" not in cfg.explicit:
        cfg.train.seq_len = -(-need // 8) * 8
    validate(cfg, world=world)
    check_rl_job(cfg)  # again: model.init_from's shape (an MoE source) is known now
    check_fits(cfg, world, "train.seq_len" if "train.seq_len" in cfg.explicit else "rl.max_new_tokens",
               cfg.train.global_batch // cfg.parallel.dp)
    warn_before_start(cfg, world, "rl")
    if cfg.model.vocab_size is not None and template.vocab_size > cfg.model.vocab_size:
        cfg.model.vocab_size = template.vocab_size  # the template's special tokens: rows added on loading
    p, r = cfg.parallel, cfg.rl
    if args.evaluate:
        if world is not None:
            result = job.rl_worker(cfg.to_dict(), "", template, True)
            signum = supervisor.control().stop_signal
        else:
            results = launch_local(p.world, job.rl_worker, cfg.to_dict(), "", template, True)
            result, signum = results[0], results.stop_signal
        if result.get("interrupted"):
            name = signal.Signals(signum or signal.SIGTERM)
            print(f"ndtrain: stopped by {name.name} during the evaluation (nothing to save)", file=sys.stderr)
            return 0 if world is not None else 128 + int(name)
        if result:
            print(job.describe_eval(f"{cfg.model.init_from} on {r.data or r.task}", result), flush=True)
        return 0
    run_dir = choose_run_dir(cfg, "rl")
    resumed = check_resume(cfg, run_dir)
    asked = f"{r.data} (rl.reward {r.reward})" if r.data else f"{r.task} (size {r.size})"
    banner = (f"ndtrain rl: {r.loss} on {asked}, {model_words(cfg)} from "
              f"{cfg.model.init_from or 'random weights'}, {layout_words(cfg)}, {cfg.train.steps} updates of "
              f"{cfg.train.global_batch // r.group_size} prompts × {r.group_size} completions"
              + (f", sampled asynchronously by {r.generate_ranks} generator process(es) beside them (staleness "
                 f"{r.max_staleness}, {r.async_weights} weights)" if r.generate_ranks else "") + f" → {run_dir}"
              + (f" (resuming {resumed.name})" if resumed else ""))
    return run_task(cfg, world, run_dir, job.rl_worker, (cfg.to_dict(), str(run_dir), template),
                    ("ndtrain.train.rl.job", "ndtrain.train.trainer"), [banner], job.describe_summary, args.argv)


def check_row_length(cfg, need: int) -> None:
    """An explicit train.seq_len must hold the longest prompt and rl.max_new_tokens."""
    from ndtrain.config import ConfigError
    if "train.seq_len" in cfg.explicit and cfg.train.seq_len < need:
        raise ConfigError("train.seq_len", cfg.train.seq_len, f"must hold the task's longest prompt and "
                          f"rl.max_new_tokens = {cfg.rl.max_new_tokens} new tokens: at least {need} (leave it "
                          "unset to get that)")


def check_context(cfg, need: int) -> None:
    """The longest prompt and rl.max_new_tokens (`need` positions, rounded up to 8 for the
    rows) within the model's context: model.max_seq_len (model.init_from's), else the
    preset's. An explicit train.seq_len is checked against it by the layout rules instead."""
    from ndtrain.config import ConfigError
    from ndtrain.model.args import PRESETS
    if "train.seq_len" in cfg.explicit:
        return
    m, n = cfg.model, cfg.rl.max_new_tokens
    context = m.max_seq_len or PRESETS[m.preset].max_seq_len
    rows = -(-need // 8) * 8
    if rows <= context:
        return
    longest, limit = need - n, context // 8 * 8 - (need - n)
    whose = ("the max_seq_len of model.init_from" if m.init_from else "model.max_seq_len" if m.max_seq_len
             else f"the max_seq_len of model.preset = {m.preset!r}")
    room = f"use at most {limit:,}" if limit > 0 else "the longest prompt alone leaves no room"
    raise ConfigError("rl.max_new_tokens", n, f"with the longest prompt ({longest:,} tokens) a completion needs "
                      f"{rows:,} positions, more than the model's context of {context:,} ({whose}): {room}"
                      + ("" if m.init_from else " (or set a larger model.max_seq_len)"))


def default_warmup(cfg, world) -> Path:
    """The default RL job's starting point: its SFT warm-up (`ndtrain sft` on problems of the
    task), run now unless a finished one is cached."""
    from ndtrain.config import ConfigError
    from ndtrain.train.rl import job
    if cfg.rl.warmup_steps == 0:
        raise ConfigError("rl.warmup_steps", 0, "no warm-up and no model.init_from: set model.init_from=run:DIR, "
                          "or model.init_from=scratch for random weights")
    folder = job.warmup_folder(cfg)
    return _cached_warmup(cfg, world, "rl", folder, f"on {cfg.rl.task} ({cfg.rl.warmup_steps} steps",
                          lambda: job.write_warmup_data(cfg, folder), job.warmup_overrides(cfg, folder),
                          job.Warmup, job.describe_warmup)


def _cached_warmup(cfg, world, command: str, folder: Path, what: str, write_data, overrides: list[str],
                   make_task=None, describe=None) -> Path:
    """`folder`/run, the SFT warm-up a default job starts from: cached, or trained now through
    `ndtrain sft` (with `make_task`'s task, if given) on the data `write_data()` writes."""
    from ndtrain.cli.parser import parse
    from ndtrain.config import ConfigError
    from ndtrain.train.rl.job import finished
    run = folder / "run"
    if finished(run):
        print(f"ndtrain {command}: starting from the cached SFT warm-up {run}", flush=True)
        return run
    if world is not None:
        raise ConfigError("model.init_from", "", f"the default SFT warm-up is not cached yet; under torchrun, run "
                          f"`ndtrain {command}` locally once first or set model.init_from=run:DIR")
    print(f"ndtrain {command}: SFT warm-up {what}, once; cached in {folder})", flush=True)
    write_data()
    nproc = ["--nproc", str(cfg.run.nproc)] if cfg.run.nproc else []
    code = cmd_sft(parse(["sft", *nproc, *overrides]), make_task)
    if code > 128:  # stopped by a signal, with a checkpoint: the same command resumes the warm-up
        raise Stopped(code, f"the SFT warm-up was stopped; the same `ndtrain {command}` command continues it, "
                      "then the job")
    if code != 0 or not finished(run):
        raise ConfigError("model.init_from", "", f"the default SFT warm-up in {folder} failed")
    if describe is not None:
        print(describe(cfg, run), flush=True)
    return run


def cmd_dpo(args) -> int:
    from ndtrain.checkpoint.sources import resolve_init_from
    from ndtrain.config.lora import check_lora_tokens
    from ndtrain.config import DPO_DEFAULTS, ConfigError, check_dpo_job, load_config, validate
    from ndtrain.config.faults import check_pretraining_only
    from ndtrain.data import preference
    from ndtrain.data.sft import ShortSequence
    from ndtrain.launch import external_world
    from ndtrain.train import dpo
    from ndtrain.train.sft import make_template

    cfg = with_nproc(load_config(args.config, args.overrides, defaults=DPO_DEFAULTS), args)
    check_pretraining_only(cfg, "dpo")
    world = external_world()
    scratch = cfg.model.init_from == "scratch"  # random weights; "" means the default SFT warm-up
    if scratch:
        cfg.model.init_from = ""
    validate(cfg, world=world)
    check_dpo_job(cfg)
    d, t = cfg.data, cfg.train
    preference.load_pairs(d.path, d.on_bad_record, d.cache_dir)  # a bad record fails here, before any warm-up
    if not scratch and not cfg.model.init_from:
        cfg.model.init_from = f"run:{default_dpo_warmup(cfg, world)}"
    resolve_init_from(cfg)  # the model and tokenizer of model.init_from
    validate(cfg, world=world)
    check_fits(cfg, world)
    warn_before_start(cfg, world, "dpo")
    template = make_template(cfg, progress=cfg.run.progress)
    if cfg.model.vocab_size is not None and template.vocab_size > cfg.model.vocab_size:
        cfg.model.vocab_size = template.vocab_size  # the template's special tokens: rows added on loading
    check_lora_tokens(cfg, template.added_ids)
    try:
        data = preference.prepare_preferences(d.path, template, t.seq_len, d.val_fraction, d.on_bad_record,
                                              d.cache_dir)
    except ShortSequence as e:
        raise ConfigError("train.seq_len", t.seq_len, f"is smaller than the shortest pair (its prompt with both "
                          f"answers: {e.shortest} positions, {e.key}): a row holds a whole pair") from None
    run_dir = choose_run_dir(cfg, "dpo")
    resumed = check_resume(cfg, run_dir)
    banner = [f"ndtrain dpo: β = {cfg.dpo.beta:g}, {model_words(cfg)} from "
              f"{cfg.model.init_from or 'random weights'}, {layout_words(cfg)}, {t.steps} steps of "
              f"{t.global_batch} pairs → {run_dir}"
              + (f" (resuming {resumed.name})" if resumed else "")
              + (" · control: chosen and rejected shuffled" if cfg.dpo.shuffle else ""), data.describe()]
    return run_task(cfg, world, run_dir, dpo.dpo_worker, (cfg.to_dict(), str(run_dir), data),
                    ("ndtrain.train.dpo", "ndtrain.train.trainer"), banner, dpo.describe_summary, args.argv)


def default_dpo_warmup(cfg, world) -> Path:
    """The default DPO job's starting point (and reference): SFT from random weights on the
    training split's prompts, each with its chosen and its rejected answer, of the embedded
    pairs, run now unless a finished one is cached."""
    from ndtrain.config import ConfigError
    from ndtrain.data.preference import EMBEDDED_NAME
    from ndtrain.train import dpo
    if cfg.data.path != EMBEDDED_NAME:
        raise ConfigError("model.init_from", "", f"set the model to start from (run:DIR, hf:DIR, or scratch): the "
                          f"default SFT warm-up is the embedded {EMBEDDED_NAME}'s, not data.path's")
    if cfg.dpo.warmup_steps == 0:
        raise ConfigError("dpo.warmup_steps", 0, "no warm-up and no model.init_from: set model.init_from=run:DIR, "
                          "or model.init_from=scratch for random weights")
    folder = dpo.warmup_folder(cfg)
    return _cached_warmup(cfg, world, "dpo", folder,
                          f"on both answers of the training pairs ({cfg.dpo.warmup_steps} steps",
                          lambda: dpo.write_warmup_data(cfg, folder), dpo.warmup_overrides(cfg, folder))


def default_pretraining_run(cfg, world) -> Path:
    """The newest finished run of the default `ndtrain train` under runs/, trained now if
    there is none (with this command's process count)."""
    from ndtrain.cli import main
    from ndtrain.config import ConfigError
    from ndtrain.train.sft import find_default_run
    found = find_default_run(Path("runs"))
    if found is not None:
        return found
    if world is not None:
        raise ConfigError("model.init_from", "", "no default pretraining run under runs/; under torchrun, run "
                          "`ndtrain train` first or set model.init_from=run:DIR")
    print("ndtrain sft: no finished default pretraining run under runs/; running `ndtrain train` first", flush=True)
    nproc = ["--nproc", str(cfg.run.nproc)] if cfg.run.nproc else []
    code = main(["train", *nproc, f"run.device={cfg.run.device}"])
    if code > 128:  # stopped by a signal: a bare `ndtrain sft` would start another pretraining run
        raise Stopped(code, "the default pretraining run was stopped; finish it with the command above, then run "
                      "`ndtrain sft` again")
    if code != 0:
        raise ConfigError("model.init_from", "", "the default pretraining run failed")
    return find_default_run(Path("runs"))
