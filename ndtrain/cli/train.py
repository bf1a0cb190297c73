"""`ndtrain train` (with `--dry-run`) and `ndtrain prepare`."""

from __future__ import annotations

import os

from ndtrain import supervisor
from ndtrain.launch import warn
from ndtrain.cli.run import (check_fits, check_resume, choose_run_dir, layout_words, model_words, open_data,
                             run_task, warn_before_start, with_nproc)


def cmd_train(args) -> int:
    from ndtrain.checkpoint.sources import resolve_init_from
    from ndtrain.config import load_config, validate
    from ndtrain.launch import external_world
    from ndtrain.train.tasks import Pretrain
    from ndtrain.train.worker import prepared_paths, resolve_vocab, train_worker

    cfg = with_nproc(load_config(args.config, args.overrides), args)
    world = external_world()
    resolve_init_from(cfg)  # the model (and tokenizer) of model.init_from, before validating it
    validate(cfg, world=world)
    check_fits(cfg, world)
    warn_before_start(cfg, world)
    if args.dry_run:
        return dry_run(cfg, world)
    run_dir = choose_run_dir(cfg, "train")
    resumed = check_resume(cfg, run_dir)
    if resumed and cfg.model.init_from:
        warn([f"model.init_from = {cfg.model.init_from!r} has no effect here: run.dir holds a checkpoint, "
              "which is resumed"])

    if world is not None:  # torchrun / SLURM started us: this process is one rank
        return run_task(cfg, world, run_dir, train_worker, (cfg.to_dict(), str(run_dir), None), argv=args.argv)
    data = open_data(cfg, cfg.run.progress)
    resolve_vocab(cfg, data)  # fails here, before any process starts or file is written
    warn(Pretrain(cfg, data).notes)  # a mixture's source that repeats; one that may not and would: DataError
    banner = (f"ndtrain: {model_words(cfg)}, {layout_words(cfg)}, {cfg.train.steps} steps → {run_dir}"
              + (f" (resuming {resumed.name})" if resumed else ""))
    return run_task(cfg, world, run_dir, train_worker, (cfg.to_dict(), str(run_dir), prepared_paths(data)),
                    supervisor.TRAINER_PRELOAD, [banner], argv=args.argv)


def dry_run(cfg, world: int | None) -> int:
    """`train --dry-run`: a measured step on every rank, a table from rank 0, nothing written."""
    from ndtrain.launch import launch_local
    from ndtrain.train.dry_run import dry_run_worker, render
    if world is None and cfg.parallel.world > 1:
        result = launch_local(cfg.parallel.world, dry_run_worker, cfg.to_dict())[0]
    else:  # alone, or one rank of torchrun / SLURM
        result = dry_run_worker(cfg.to_dict())
        if os.environ.get("RANK", "0") != "0":
            return 0
    print(render(cfg, result), flush=True)
    return 0


def cmd_prepare(args) -> int:
    from ndtrain.config import load_config, validate
    cfg = load_config(args.config, args.overrides)
    validate(cfg)
    data = open_data(cfg, cfg.run.progress)
    for name, d in getattr(data, "sources", None) and [(s.name, s.data) for s in data.sources] or [("", data)]:
        m = d.meta
        print(f"prepared {f'source {name}: ' if name else ''}{d.path}\n  vocabulary {d.vocab_size} · "
              f"train {m['train_tokens']:,} tokens · validation {m['val_tokens']:,} tokens · "
              f"unigram validation loss {d.unigram_val_loss:.4f}")
    return 0
