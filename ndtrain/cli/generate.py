"""`ndtrain generate` (text from a run's newest good checkpoint) and `ndtrain trace` (a few
pipelined or context-parallel steps drawn as a timeline)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from ndtrain.cli.run import choose_run_dir, open_data, warn_before_start, with_nproc


def cmd_generate(args) -> int:
    import torch

    from ndtrain.checkpoint import store
    from ndtrain.checkpoint.hf_files import eos_ids
    from ndtrain.checkpoint.layout import load_model
    from ndtrain.checkpoint.sources import CheckpointSource
    from ndtrain.config import ConfigError
    from ndtrain.data.tokenizer import TextTokenizer
    from ndtrain.generate.sampler import sample
    from ndtrain.model.args import ModelArgs
    from ndtrain.model.llama import Transformer

    if args.max_new_tokens <= 0:
        raise ConfigError("--max-new-tokens", args.max_new_tokens, "must be > 0")
    if not 0 <= args.temperature < math.inf:  # also refuses nan
        raise ConfigError("--temperature", args.temperature, "must be a finite number >= 0 (0 = greedy)")
    if args.top_k < 0:
        raise ConfigError("--top-k", args.top_k, "must be >= 0 (0 = the whole vocabulary)")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError("--prompt", args.prompt, f"is not UTF-8 text (position {e.start} is a byte that is no "
                          "character, or half of a surrogate pair)") from None
    run = Path(args.run)
    if not run.is_dir():
        raise ConfigError("--run", args.run, "directory does not exist")
    if not store.steps_of(run):
        raise ConfigError("--run", args.run, "holds no checkpoint (did training save one?)")
    last = store.select(run, report=lambda m: print(f"ndtrain: {m}", file=sys.stderr))
    if last is None:
        raise store.CheckpointError(f"run {run}: none of its checkpoints passes its checks")
    meta = store.read_meta(last)
    model = Transformer(ModelArgs(**meta["model_args"]))
    load_model(CheckpointSource(last, meta), model)
    tok = TextTokenizer.from_file(run / "tokenizer.json")
    ids = tok.encode_prompt(args.prompt)
    if not args.prompt or not ids:
        raise ConfigError("--prompt", args.prompt, "must not be empty")
    stops = set(eos_ids(run) or [tok.eot_id])  # the generation config's, as HF generate stops
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = sample(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 seed=args.seed, stop_ids=stops, report=lambda m: print(f"ndtrain generate: {m}", file=sys.stderr))
    if out and out[-1] in stops:
        out = out[:-1]
    print(args.prompt + tok.decode(out))
    return 0


def cmd_trace(args) -> int:
    from ndtrain.checkpoint.lock import RunLock
    from ndtrain.config import ConfigError, check_out_folder, load_config, validate
    from ndtrain.launch import launch_local
    from ndtrain.train.trace import trace_worker
    from ndtrain.train.worker import prepared_paths, resolve_vocab

    if args.steps <= 0:
        raise ConfigError("--steps", args.steps, "must be > 0")
    cfg = with_nproc(load_config(args.config, list(args.overrides) + [f"train.steps={args.steps}",
                                                                      "train.eval_batches=1", "run.progress=false"]),
                     args)
    validate(cfg)
    p, t = cfg.parallel, cfg.train
    if p.pp == 1 and p.cp == 1:
        raise ConfigError("parallel.pp", 1, "ndtrain trace draws a pipeline schedule (parallel.pp > 1) or "
                          "context-parallel attention (parallel.cp > 1); set one of them")
    if args.out:
        check_out_folder("--out", args.out, args.overwrite)
    warn_before_start(cfg, None)
    out = Path(args.out) if args.out else choose_run_dir(cfg, "trace")
    data = open_data(cfg, False)
    resolve_vocab(cfg, data)
    m = t.accumulation(p.dp)
    watched = ([f"schedule {p.pp_schedule}" + (f" v={p.pp_virtual}" if p.pp_virtual > 1 else "")
                + f", {m} micro-batches"] if p.pp > 1 else []) + ([f"attention {p.cp_impl}"] if p.cp > 1 else [])
    print(f"ndtrain trace: {cfg.model.preset} model, pp={p.pp} dp={p.dp} cp={p.cp} tp={p.tp}, {', '.join(watched)}, "
          f"{t.steps} steps, the last one recorded → {out}", flush=True)
    with RunLock(out):  # its .lock marks the folder as ndtrain's (config/paths.py): a second trace may reuse it
        r = launch_local(p.world, trace_worker, cfg.to_dict(), str(out), prepared_paths(data))[0]
    if p.pp > 1:
        ms = " ".join(f"{k} {v:.1f} ms" for k, v in r["mean_ms"].items())
        print(f"bubble    {r['measured_bubble']:.3f} measured vs {r['theory_bubble']:.3f} theory {r['theory']} "
              f"(idle / busy per rank; mean {ms})\n"
              f"          {r['replayed_bubble']:.3f} with these action durations and free messages "
              f"(measured − this = what messages and the executor cost)\n"
              f"step      {r['measured_step_ms']:.1f} ms measured vs {r['simulated_step_ms']:.1f} ms simulated "
              f"(bubble {r['simulated_bubble']:.3f}) from the mean F, B, W per chunk and message times "
              f"(parallel/pipeline/simulate.py)\n"
              f"trace     {r['trace']}   (chrome://tracing or ui.perfetto.dev)\n"
              f"timeline  {r['timeline']}", flush=True)
    if p.cp > 1:
        c = r["ring"]
        print(f"messages  {1e3 * c['in_flight']:.1f} ms in flight per rank, {1e3 * c['waited']:.1f} ms waited: "
              f"{100 * c['hidden']:.0f}% hidden behind {1e3 * c['compute']:.1f} ms of attention compute "
              f"({c['messages']:.0f} messages, {c['layers']} layers, forward and backward)\n"
              f"trace     {c['trace']}   (chrome://tracing or ui.perfetto.dev)\n"
              f"ring      {c['timeline']}", flush=True)
    return 0
