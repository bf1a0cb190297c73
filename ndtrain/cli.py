"""The `ndtrain` command: train, prepare, generate, trace, bench, convert, checkpoint.

Bad input is refused before anything starts or is written: one line naming the key, the
value and the rule, exit status 2. A fault during a run names the rank and exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

from ndtrain import __version__

EPILOG = """\
examples:
  ndtrain train                                  the embedded default: small Llama on the stdlib, DP over 2 processes
  ndtrain train --nproc 4 train.steps=100        4-way data parallel
  ndtrain train --config configs/default.toml model.preset=tiny
  ndtrain train --nproc 4 parallel.zero=3 train.precision=bf16 train.recompute=full
                                                 ZeRO-3 (fully sharded), bf16 compute, every block recomputed
  ndtrain train --nproc 4 parallel.pp=2 parallel.pp_schedule=zb train.micro_batch=2
                                                 2 pipeline stages (zero bubble) × 2 data-parallel
  ndtrain train --dry-run --nproc 4 parallel.zero=2 model.preset=125M
                                                 memory per rank of a step, then exit (writes nothing)
  ndtrain sft                                    fine-tune the default run's model on stdlib functions (signature → body)
  ndtrain sft --show-example                     one training example, the trained (answer) tokens highlighted
  ndtrain sft data.path=chat.jsonl model.init_from=hf:./my-llama
                                                 fine-tune a Hugging Face model on your chats with its chat template
  ndtrain rl                                     the embedded default: SFT warm-up on addition (cached), then GRPO
  ndtrain rl rl.loss=dapo rl.task=sort           DAPO on sorting lists (after an SFT warm-up on sorting)
  ndtrain rl --evaluate model.init_from=run:DIR  held-out pass@1 and pass@k of a run's model on rl.task
  ndtrain generate --run runs/train-... --prompt "def main("
  ndtrain train --nproc 4 parallel.tp=2 run.dir=runs/x   resume runs/x on another layout (any layout reads any checkpoint)
  ndtrain train --nproc 2 model.init_from=hf:DIR data.path=my.jsonl   start from a Hugging Face Llama/Qwen model
  ndtrain convert --to-hf runs/x --out hf/x      export a run as a Hugging Face model folder
  ndtrain checkpoint inspect runs/x              steps, layout, tensors and bytes per rank of a run's checkpoints
  ndtrain train --nproc 4 run.max_restarts=3 train.save_every=20   restart every rank (from the last good
                                                 checkpoint) when one dies or hangs; Ctrl-C saves, then exits
  ndtrain trace --nproc 2 parallel.pp=2 train.micro_batch=1    a pipeline schedule as a picture
  ndtrain trace --nproc 2 parallel.cp=2 train.seq_len=512      context-parallel ring steps and their overlap
  ndtrain bench dp                               our DP against torch DDP, side by side
  ndtrain bench zero                             our ZeRO-3 against torch FSDP2, side by side
  ndtrain bench tp                               our TP+SP against DTensor TP+SP on 2 ranks, side by side
  ndtrain bench pp                               our 1F1B, interleaved and zero bubble against torch.distributed.pipelining,
                                                 and each schedule's bubble (real compute, paced, theory)
  ndtrain bench zero model.preset=125M train.global_batch=8
                                                 the same on a preset's shape (every benchmark takes model.preset)
  ndtrain bench sft                              fine-tuning on packed against padded rows, answer tokens/s
  ndtrain bench cp                               context parallelism: ring vs allgather vs ulysses vs one process
  ndtrain bench generate                         batched generation with a KV cache against recomputing the prefix
  ndtrain bench ep                               experts split over 2 ranks (ep=2) against replicated (ep=1)
  ndtrain bench compile                          the default job's step compiled (train.compile=true) against eager
  ndtrain bench gpu [--dry-run]                  the first GPU run: CUDA tests, 1B MFU eager and compiled, one-GPU
                                                 benches, each with its own time limit → docs/benchmarks-gpu.md
  ndtrain bench checkpoint                       our checkpoint save/load against torch.distributed.checkpoint (125M, 2 ranks)
  ndtrain train --nproc 4 parallel.tp=2          tensor (+ sequence) parallel over 2 ranks, times DP 2
  ndtrain train --nproc 4 model.preset=tiny-moe parallel.ep=2 parallel.dp=4
                                                 mixture of experts, experts split over 2 of the 4 data-parallel ranks
  ndtrain bench comm                             every collective's bus bandwidth; our ring all-reduce vs the backend's
  ndtrain plan --cluster H100-SXM --gpus 64 model.preset=8B train.precision=bf16 parallel.tp=8 parallel.zero=1
                                                 memory per rank, step time, MFU of a layout too large for this machine
  ndtrain plan --cluster H100-SXM --gpus 64 --search model.preset=8B train.precision=bf16
                                                 the fastest layouts that fit
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ndtrain", description="N-D parallel training of transformer language models.",
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"ndtrain {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    def with_config(p):
        p.add_argument("--config", metavar="FILE", help="TOML file with [model], [parallel], [train], [data], [run] tables")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=50 parallel.dp=2")

    p = sub.add_parser("train", help="pretrain a model (with no arguments: the embedded default job)",
                       description="Pretrain a model. With no arguments: a small Llama-style model on the Python "
                                   "standard library's source, data parallel over 2 CPU processes (or every local GPU).")
    p.add_argument("--nproc", type=int, metavar="N", help="local processes to start (same as run.nproc=N)")
    p.add_argument("--dry-run", action="store_true",
                   help="build the layout, run two steps on random tokens, print each rank's memory "
                        "(parameters, gradients, optimizer state, activations, peak) and exit; writes nothing")
    with_config(p)

    p = sub.add_parser("sft", help="supervised fine-tuning on chat or prompt/completion JSONL (no arguments: "
                                   "the embedded default job)",
                       description="Fine-tune a model on conversations: the loss counts answer tokens only. With no "
                                   "arguments: the default pretraining run's model (trained first if there is none) "
                                   "on functions of the Python standard library, asked for by signature and docstring.")
    p.add_argument("--nproc", type=int, metavar="N", help="local processes to start (same as run.nproc=N)")
    p.add_argument("--show-example", action="store_true",
                   help="print one training example as the model sees it, the trained tokens highlighted, and exit")
    with_config(p)

    p = sub.add_parser("rl", help="reinforcement learning with verifiable rewards (no arguments: the embedded "
                                  "default job)",
                       description="Train a policy on a verifiable task: before each update it samples rl.group_size "
                                   "completions per prompt, a program scores them, and a policy-gradient loss "
                                   "(rl.loss: reinforce, grpo, dr_grpo, dapo) reinforces them by their advantage. "
                                   "Starts from model.init_from; with no arguments, from a short SFT warm-up on "
                                   "multi-digit addition (run through `ndtrain sft` once, cached), then GRPO on 2 "
                                   "CPU processes (or every local GPU). model.init_from=scratch: random weights.")
    p.add_argument("--nproc", type=int, metavar="N", help="local processes to start (same as run.nproc=N)")
    p.add_argument("--evaluate", action="store_true",
                   help="only evaluate model.init_from's policy on held-out prompts (pass@1, pass@k) and exit; "
                        "writes nothing")
    with_config(p)

    p = sub.add_parser("prepare", help="tokenize a corpus into token shards (cached)",
                       description="Train or load the tokenizer and write memory-mapped token shards. "
                                   "`ndtrain train` does this itself when needed.")
    with_config(p)

    p = sub.add_parser("generate", help="sample text from a trained run")
    p.add_argument("--run", required=True, metavar="DIR", help="a run directory written by `ndtrain train`")
    p.add_argument("--prompt", required=True, metavar="TEXT")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("trace", help="run a few pipelined or context-parallel steps; write the last one as a Chrome "
                                     "trace and a picture",
                       description="Train a few steps of a pipelined layout (parallel.pp > 1), then write the last "
                                   "step's per-rank timeline as trace.json (chrome://tracing, ui.perfetto.dev) and "
                                   "timeline.png, and print the measured bubble next to the theory. With context "
                                   "parallelism (parallel.cp > 1): every ring step of every layer and every message "
                                   "of the last step as ring-trace.json and ring.png, and the share of message time "
                                   "hidden behind attention compute. Writes no checkpoint.")
    p.add_argument("--nproc", type=int, metavar="N", help="local processes to start (same as run.nproc=N)")
    p.add_argument("--out", metavar="DIR", help="where to write (default runs/trace-<date>-<time>)")
    p.add_argument("--steps", type=int, default=3, help="training steps; the last one is drawn (default 3)")
    with_config(p)

    p = sub.add_parser("plan", help="predict memory per rank, step time and days of a layout on a cluster; "
                                    "--search for the best layouts that fit",
                       description="Plan before you spend: memory per rank (parameters, gradients, optimizer "
                                   "states, activations, communication buffers), step time (compute, TP/SP/CP/EP, "
                                   "pipeline bubble, DP/ZeRO), tokens/s, MFU and days, for a layout on a cluster "
                                   "too large for this machine. Checks the layout with the rules train enforces. "
                                   "Formulas and sources: docs/plan.md.")
    p.add_argument("--cluster", required=True, metavar="SPEC",
                   help="A100-40GB, A100-80GB, H100-SXM, H200, B200, this-machine (calibrated by bench matmul "
                        "and bench comm), or a TOML file")
    p.add_argument("--gpus", type=int, metavar="N", help="GPUs (processes); default: the layout's product, or one node")
    p.add_argument("--mfu", type=float, metavar="X", help="an achieved MFU (0-1) instead of the modelled step time")
    p.add_argument("--tflops", type=float, metavar="X", help="an achieved TFLOP/s per GPU instead of the modelled step time")
    p.add_argument("--tokens", metavar="N", help="tokens to train on (e.g. 15T, 300B, 2e12): prints the days")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--search", action="store_true", help="list the fastest layouts that fit (model, batch, "
                                                          "sequence and precision as configured)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="--search: how many layouts (default 10)")
    with_config(p)

    p = sub.add_parser("convert", help="Hugging Face models in and out (Llama, Qwen2, Qwen3)",
                       description="--from-hf DIR --to RUN_DIR: a run directory with a step-0 checkpoint of the HF "
                                   "weights and its tokenizer (train from it with model.init_from=run:RUN_DIR). "
                                   "--to-hf RUN_DIR --out DIR: the run's newest good checkpoint as a HF model folder "
                                   "(model.safetensors, config.json, tokenizer.json).")
    p.add_argument("--from-hf", metavar="DIR", help="a Hugging Face model folder (config.json, *.safetensors)")
    p.add_argument("--to", metavar="RUN_DIR", help="with --from-hf: the run directory to create")
    p.add_argument("--to-hf", metavar="RUN_DIR", help="an ndtrain run directory (or one checkpoint folder)")
    p.add_argument("--out", metavar="DIR", help="with --to-hf: the HF model folder to write")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="--to-hf: the exported dtype (default: as stored)")

    p = sub.add_parser("checkpoint", help="inspect a run's checkpoints",
                       description="inspect DIR: the checkpoints of a run (or one checkpoint folder): steps, the "
                                   "layout that wrote them, the model, every tensor with its pieces, bytes per rank.")
    p.add_argument("action", choices=["inspect"])
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--verify", action="store_true", help="also check every file against its SHA-256")

    p = sub.add_parser("bench", help="benchmarks: matmul (CPU peak), dp (ours vs torch DDP), "
                                     "tp (ours vs DTensor TP+SP over --nproc ranks), zero (our ZeRO-3 vs torch FSDP2), "
                                     "pp (our 1F1B, interleaved, zero bubble vs torch.distributed.pipelining; "
                                     "bubbles), cp (ring vs allgather vs ulysses vs 1 process at two sequence lengths), "
                                     "comm (every collective's bus bandwidth, our ring all-reduce vs the backend's), "
                                     "sft (packed vs padded fine-tuning rows), checkpoint (our save/load vs "
                                     "torch.distributed.checkpoint, MB/s), ep (experts split over --nproc ranks vs "
                                     "replicated), generate (KV cache vs recomputing the prefix, one process), "
                                     "compile (train.compile=true vs eager, same layout), gpu (the one-GPU "
                                     "acceptance run: CUDA tests, 1B MFU eager/compiled, one-GPU benches; "
                                     "--dry-run lists them); "
                                     "KEY=VALUE reaches both sides or is refused",
                       description="Run ndtrain and its PyTorch-native anchor side by side (sft: packed and padded "
                                   "rows), alternating rounds; the last line is the ratio of their median "
                                   "throughputs. Every key a benchmark accepts (model.*, train.precision, "
                                   "train.recompute, train.micro_batch, ...) reaches both sides; others are refused. "
                                   "docs/benchmarks.md lists the settings of each side.")
    p.add_argument("what", choices=["matmul", "dp", "tp", "zero", "pp", "cp", "comm", "sft", "checkpoint", "ep",
                                    "generate", "compile", "gpu"])
    p.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks for distributed benchmarks")
    p.add_argument("--dry-run", action="store_true", help="gpu: print the steps and their time budgets, run nothing")
    p.add_argument("--rounds", type=int, help="alternating A/B rounds (default 10; generate 5)")
    p.add_argument("--steps", type=int, help="timed steps per round (default 3; generate 1: one whole generation)")
    p.add_argument("--out", metavar="DIR", help="pp: draw each schedule's timeline into DIR; "
                                               "comm: the picture and figures (default runs/bench-comm-<date>); "
                                               "checkpoint: write the checkpoints there (default: a temporary folder)")
    p.add_argument("--sizes", nargs="+", metavar="SIZE", help="comm: message sizes, e.g. 1K 4M 64M "
                                                              "(default 1 KB to 256 MB by powers of 4)")
    with_config(p)
    return ap


def fail(message: str, code: int = 2) -> int:
    print(f"ndtrain: error: {message}", file=sys.stderr)
    return code


def warn_before_start(cfg, world: int | None, command: str = "train") -> None:
    """Keys that do nothing in this layout, and more CPU processes than cores."""
    from ndtrain.idle_keys import idle_keys
    from ndtrain.launch import oversubscribed, warn
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.world)) if world else cfg.parallel.world
    warn(idle_keys(cfg, world, command) + [oversubscribed(local, cfg.run.device)])


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Like parse_args, but KEY=VALUE overrides may stand anywhere, also after options."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or "=" in argv[0]:
        argv = ["train"] + argv
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from ndtrain.checkpoint.store import CheckpointError
    from ndtrain.config import ConfigError
    from ndtrain.data.shards import DataError
    from ndtrain.launch import RankFailure

    try:
        return {"train": cmd_train, "sft": cmd_sft, "rl": cmd_rl, "prepare": cmd_prepare, "generate": cmd_generate,
                "bench": cmd_bench, "trace": cmd_trace, "convert": cmd_convert,
                "checkpoint": cmd_checkpoint, "plan": cmd_plan}[args.command](args)
    except (ConfigError, DataError) as e:
        return fail(str(e))
    except CheckpointError as e:
        return fail(str(e), 1)
    except RankFailure as e:
        if e.traceback and not _known_fault(e.summary):
            print(e.traceback, file=sys.stderr)
        return fail(str(e), 2 if e.summary.startswith(("DataError", "ConfigError")) else 1)
    except KeyboardInterrupt:
        return fail("interrupted", 130)


def _known_fault(summary: str) -> bool:
    return summary.startswith(("TrainingError", "DataError", "ConfigError", "CheckpointError", "CollectiveError"))


# --------------------------------------------------------------------------- train

def _data_kwargs(cfg) -> dict:
    d = cfg.data
    return dict(source=d.path, tokenizer=d.tokenizer, vocab_size=d.vocab_size,
                val_fraction=d.val_fraction, cache_dir=d.cache_dir, jsonl_key=d.jsonl_key)


def open_data(cfg, progress: bool):
    """The prepared data of `cfg` (prepared now if the cache lacks it), every shard checked
    against its checksum and its ids against the vocabulary."""
    from ndtrain.data.prepare import PreparedData, prepare_data
    data = PreparedData.open(prepare_data(**_data_kwargs(cfg), progress=progress))
    data.verify()
    return data


def _run_dir(cfg, task: str) -> Path:
    """run.dir, or a new folder under runs/ (validate() checked a given run.dir)."""
    from ndtrain.config import check_writable_dir
    from ndtrain.launch import external_run_id
    if cfg.run.dir:
        return Path(cfg.run.dir).expanduser()
    run_id = external_run_id()
    if run_id:
        path = Path("runs") / f"{task}-{run_id}"
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{task}-{stamp}"
        n = 1
        while path.exists():
            n += 1
            path = Path("runs") / f"{task}-{stamp}-{n}"
    check_writable_dir("run.dir", str(path))
    return path


def check_resume(cfg, run_dir: Path) -> Path | None:
    """Decide, before anything is written, whether this run continues a checkpoint, and
    refuse a config the checkpoint cannot continue (another model, other data or their
    order), naming the key. The ranks verify checksums and fall back to older checkpoints
    themselves; here only the cheap checks run."""
    from ndtrain.checkpoint import store
    from ndtrain.checkpoint.resume import check_resume_config
    from ndtrain.checkpoint.sources import newest_readable
    from ndtrain.config import ConfigError
    if not store.steps_of(run_dir):
        if cfg.run.resume == "true":
            raise ConfigError("run.resume", "true", f"run.dir {str(run_dir)!r} holds no checkpoint to resume")
        return None
    if cfg.run.resume == "false":
        raise ConfigError("run.dir", str(run_dir), "already holds checkpoints; set run.resume=true to continue "
                          "it or choose another run.dir")
    last = newest_readable(run_dir)
    if last is None:
        raise store.CheckpointError(f"run.dir {run_dir}: none of its checkpoints is complete; move them away "
                                    "(or choose another run.dir) to start afresh")
    check_resume_config(cfg, store.read_meta(last))
    return last


def cmd_train(args) -> int:
    from ndtrain.checkpoint.sources import resolve_init_from
    from ndtrain.config import load_config, validate
    from ndtrain.launch import external_world
    from ndtrain.train.worker import resolve_vocab, train_worker

    cfg = _with_nproc(load_config(args.config, args.overrides), args)
    world = external_world()
    resolve_init_from(cfg)  # the model (and tokenizer) of model.init_from, before validating it
    validate(cfg, world=world)
    _check_fits(cfg, world)
    warn_before_start(cfg, world)
    if args.dry_run:
        return dry_run(cfg, world)
    run_dir = _run_dir(cfg, "train")
    resumed = check_resume(cfg, run_dir)
    if resumed and cfg.model.init_from:
        warn([f"model.init_from = {cfg.model.init_from!r} has no effect here: run.dir holds a checkpoint, "
              "which is resumed"])

    if world is not None:  # torchrun / SLURM started us: this process is one rank
        return _run_task(cfg, world, run_dir, train_worker, (cfg.to_dict(), str(run_dir), None))
    data = open_data(cfg, cfg.run.progress)
    resolve_vocab(cfg, data)  # fails here, before any process starts or file is written
    p = cfg.parallel
    banner = (f"ndtrain: {cfg.model.preset} model, {p.world} process{'es' if p.world > 1 else ''} "
              f"(pp={p.pp} dp={p.dp} cp={p.cp} tp={p.tp}" + (f" ep={p.ep}" if p.ep > 1 else "")
              + f"), {cfg.train.steps} steps → {run_dir}" + (f" (resuming {resumed.name})" if resumed else ""))
    return _run_task(cfg, world, run_dir, train_worker, (cfg.to_dict(), str(run_dir), str(data.path)),
                     ("ndtrain.train.worker", "ndtrain.train.trainer"), [banner])


def _with_nproc(cfg, args):
    """`--nproc N` is `run.nproc = N`, set explicitly."""
    if args.nproc is not None:
        cfg.run.nproc = args.nproc
        cfg.explicit |= {"run.nproc"}
    return cfg


def _run_task(cfg, world: int | None, run_dir: Path, worker, worker_args: tuple, preload: tuple[str, ...] = (),
              banner: list[str] = (), describe=None) -> int:
    """A task's ranks under the run directory's lock: this process as one rank (torchrun,
    SLURM: rank 0 takes the lock), or ranks started here after printing `banner`. Then rank
    0's summary (`describe(summary)` first), and the exit status: 128 + the signal that
    stopped the run, or 0 (always 0 under torchrun, which would take another status for a
    failure to restart)."""
    from ndtrain import supervisor
    from ndtrain.checkpoint.lock import RunLock
    if world is not None:
        with RunLock(run_dir) if os.environ.get("RANK", "0") == "0" else nullcontext():
            summary = worker(*worker_args)
        stop_signal = supervisor.control().stop_signal
    else:
        with RunLock(run_dir):
            for line in banner:
                print(line, flush=True)
            summary, stop_signal = _run_ranks(cfg, worker, worker_args, preload)
    if not summary:
        return 0
    if describe is not None:
        print(describe(summary), flush=True)
    print_summary(summary)
    code = _stopped(summary, stop_signal)
    return 0 if world is not None else code


def _run_ranks(cfg, worker, args: tuple, preload: tuple[str, ...]) -> tuple[dict, int]:
    """`worker(*args)` on every rank: in this process when there is one and no restart to
    watch for, else in watched processes (supervisor.py). Rank 0's result and the signal
    that stopped the run, if one did."""
    from ndtrain import supervisor
    from ndtrain.launch import launch_local
    p, run = cfg.parallel, cfg.run
    if p.world == 1 and run.max_restarts == 0:
        summary = worker(*args)
        return summary, supervisor.control().stop_signal
    results = launch_local(p.world, worker, *args, max_restarts=run.max_restarts, heartbeat_s=run.heartbeat_s,
                           preload=preload)
    return results[0], results.stop_signal


def _stopped(summary: dict, stop_signal: int) -> int:
    """Exit status 0, or 128 + the signal that stopped the run at a step boundary."""
    if not summary.get("stopped"):
        return 0
    stop_signal = stop_signal or signal.SIGTERM
    print(f"ndtrain: stopped by a signal after step {summary['steps']}, checkpoint saved; the same command "
          "continues the run", file=sys.stderr, flush=True)
    return 128 + int(stop_signal)


def cmd_sft(args) -> int:
    from ndtrain.checkpoint.sources import resolve_init_from
    from ndtrain.config import SFT_DEFAULTS, ConfigError, load_config, validate
    from ndtrain.data.sft import ShortSequence, make_template, prepare_sft
    from ndtrain.launch import external_world
    from ndtrain.train import sft

    cfg = _with_nproc(load_config(args.config, args.overrides, defaults=SFT_DEFAULTS), args)
    world = external_world()
    if cfg.model.init_from == "scratch":  # random weights; "" means the default pretraining run
        cfg.model.init_from = ""
    elif not cfg.model.init_from and not args.show_example:
        validate(cfg, world=world)
        cfg.model.init_from = f"run:{default_pretraining_run(cfg, world)}"
    resolve_init_from(cfg)  # the model and tokenizer of model.init_from
    validate(cfg, world=world)
    _check_fits(cfg, world)
    warn_before_start(cfg, world, "sft")
    sft.load_score(cfg.sft.score)  # a bad scoring function fails here, not after training
    d, t = cfg.data, cfg.train
    template = make_template(cfg, progress=cfg.run.progress)
    if cfg.model.vocab_size is not None and template.vocab_size > cfg.model.vocab_size:
        cfg.model.vocab_size = template.vocab_size  # the template's special tokens: rows added on loading
    try:
        data = prepare_sft(d.path, template, t.seq_len, d.truncate, d.val_fraction, d.on_bad_record, d.cache_dir)
    except ShortSequence as e:
        raise ConfigError("train.seq_len", t.seq_len, f"is smaller than the shortest example ({e.shortest} positions, "
                          f"{e.key}): packing would have to cut or drop every example") from None
    if args.show_example:
        print(sft.show_example(data), flush=True)
        return 0
    run_dir = _run_dir(cfg, "sft")
    resumed = check_resume(cfg, run_dir)
    p = cfg.parallel
    banner = [f"ndtrain sft: {cfg.model.preset} model from {cfg.model.init_from or 'random weights'}, "
              f"{p.world} process{'es' if p.world > 1 else ''} (pp={p.pp} dp={p.dp} cp={p.cp} tp={p.tp}), "
              f"{t.steps} steps, packing {d.packing} → {run_dir}"
              + (f" (resuming {resumed.name})" if resumed else ""), data.describe()]
    return _run_task(cfg, world, run_dir, sft.sft_worker, (cfg.to_dict(), str(run_dir), data),
                     ("ndtrain.train.sft", "ndtrain.train.trainer"), banner, sft.describe_summary)


def cmd_rl(args) -> int:
    from ndtrain.checkpoint.sources import resolve_init_from
    from ndtrain.config import RL_DEFAULTS, ConfigError, check_rl_job, load_config, validate
    from ndtrain.data.sft import make_template
    from ndtrain.launch import external_world, launch_local
    from ndtrain.train.rl import job

    cfg = _with_nproc(load_config(args.config, args.overrides, defaults=RL_DEFAULTS), args)
    world = external_world()
    scratch = cfg.model.init_from == "scratch"  # random weights, the task's character tokenizer
    if scratch:
        cfg.model.init_from = ""
    validate(cfg, world=world)  # every key's own rules, the job's and the reward's, before anything runs
    check_rl_job(cfg)
    job.check_reward(cfg)
    if "train.seq_len" in cfg.explicit and cfg.train.seq_len < job.row_length(cfg, rounded=False):
        raise ConfigError("train.seq_len", cfg.train.seq_len, f"must hold the task's longest prompt and "
                          f"rl.max_new_tokens = {cfg.rl.max_new_tokens} new tokens: at least "
                          f"{job.row_length(cfg, rounded=False)} (leave it unset to get that)")
    if scratch and not cfg.data.tokenizer:
        cfg.data.tokenizer = str(job.char_tokenizer_file(cfg.data.cache_dir))
    elif not scratch and not cfg.model.init_from:
        cfg.model.init_from = f"run:{default_warmup(cfg, world)}"
    resolve_init_from(cfg)  # the model and tokenizer of model.init_from
    if "train.seq_len" not in cfg.explicit:
        cfg.train.seq_len = job.row_length(cfg)
    validate(cfg, world=world)
    check_rl_job(cfg)  # again: model.init_from's shape (an MoE source) is known now
    warn_before_start(cfg, world, "rl")
    template = make_template(cfg, progress=cfg.run.progress)
    if cfg.model.vocab_size is not None and template.vocab_size > cfg.model.vocab_size:
        cfg.model.vocab_size = template.vocab_size  # the template's special tokens: rows added on loading
    p, r = cfg.parallel, cfg.rl
    if args.evaluate:
        if world is not None:
            result = job.rl_worker(cfg.to_dict(), "", template, True)
        else:
            result = launch_local(p.world, job.rl_worker, cfg.to_dict(), "", template, True)[0]
        if result:
            print(job.describe_eval(f"{cfg.model.init_from} on {r.task}", result), flush=True)
        return 0
    run_dir = _run_dir(cfg, "rl")
    resumed = check_resume(cfg, run_dir)
    banner = (f"ndtrain rl: {r.loss} on {r.task} (size {r.size}), {cfg.model.preset} model from "
              f"{cfg.model.init_from or 'random weights'}, {p.world} process{'es' if p.world > 1 else ''} "
              f"(pp={p.pp} dp={p.dp} cp={p.cp} tp={p.tp}), {cfg.train.steps} updates of "
              f"{cfg.train.global_batch // r.group_size} prompts × {r.group_size} completions → {run_dir}"
              + (f" (resuming {resumed.name})" if resumed else ""))
    return _run_task(cfg, world, run_dir, job.rl_worker, (cfg.to_dict(), str(run_dir), template),
                     ("ndtrain.train.rl.job", "ndtrain.train.trainer"), [banner], job.describe_summary)


def default_warmup(cfg, world) -> Path:
    """The default RL job's starting point: its SFT warm-up (`ndtrain sft` on problems of the
    task), run now unless a finished one is cached."""
    from ndtrain.config import ConfigError
    from ndtrain.train.rl import job
    if cfg.rl.warmup_steps == 0:
        raise ConfigError("rl.warmup_steps", 0, "no warm-up and no model.init_from: set model.init_from=run:DIR, "
                          "or model.init_from=scratch for random weights")
    folder = job.warmup_folder(cfg)
    run = folder / "run"
    if job.finished(run):
        print(f"ndtrain rl: starting from the cached SFT warm-up {run}", flush=True)
        return run
    if world is not None:
        raise ConfigError("model.init_from", "", "the default SFT warm-up is not cached yet; under torchrun, run "
                          "`ndtrain rl` locally once first or set model.init_from=run:DIR")
    print(f"ndtrain rl: SFT warm-up on {cfg.rl.task} ({cfg.rl.warmup_steps} steps, once; cached in {folder})",
          flush=True)
    job.write_warmup_data(cfg, folder)
    nproc = ["--nproc", str(cfg.run.nproc)] if cfg.run.nproc else []
    if main(["sft", *nproc, *job.warmup_overrides(cfg, folder)]) != 0 or not job.finished(run):
        raise ConfigError("model.init_from", "", f"the default SFT warm-up in {folder} failed")
    return run


def default_pretraining_run(cfg, world) -> Path:
    """The newest finished run of the default `ndtrain train` under runs/, trained now if
    there is none (with this command's process count)."""
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
    if main(["train", *nproc, f"run.device={cfg.run.device}"]) != 0:
        raise ConfigError("model.init_from", "", "the default pretraining run failed")
    return find_default_run(Path("runs"))


def _check_fits(cfg, world: int | None) -> None:
    """Refuse, before any process starts, a model whose states alone overflow the device."""
    from ndtrain.plan.fit import check_model_states_fit
    from ndtrain.train.dry_run import vocab_size
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.world)) if world else cfg.parallel.world
    check_model_states_fit(cfg, vocab_size(cfg), local)


def cmd_trace(args) -> int:
    from ndtrain.config import ConfigError, check_writable_dir, load_config, validate
    from ndtrain.launch import launch_local
    from ndtrain.train.trace import trace_worker
    from ndtrain.train.worker import resolve_vocab

    if args.steps <= 0:
        raise ConfigError("--steps", args.steps, "must be > 0")
    cfg = _with_nproc(load_config(args.config, list(args.overrides) + [f"train.steps={args.steps}",
                                                                       "train.eval_batches=1", "run.progress=false"]),
                      args)
    validate(cfg)
    p, t = cfg.parallel, cfg.train
    if p.pp == 1 and p.cp == 1:
        raise ConfigError("parallel.pp", 1, "ndtrain trace draws a pipeline schedule (parallel.pp > 1) or "
                          "context-parallel attention (parallel.cp > 1); set one of them")
    if args.out:
        check_writable_dir("--out", args.out)
    warn_before_start(cfg, None)
    out = Path(args.out) if args.out else _run_dir(cfg, "trace")
    data = open_data(cfg, False)
    resolve_vocab(cfg, data)
    m = t.accumulation(p.dp)
    watched = ([f"schedule {p.pp_schedule}" + (f" v={p.pp_virtual}" if p.pp_virtual > 1 else "")
                + f", {m} micro-batches"] if p.pp > 1 else []) + ([f"attention {p.cp_impl}"] if p.cp > 1 else [])
    print(f"ndtrain trace: {cfg.model.preset} model, pp={p.pp} dp={p.dp} cp={p.cp} tp={p.tp}, {', '.join(watched)}, "
          f"{t.steps} steps, the last one recorded → {out}", flush=True)
    r = launch_local(p.world, trace_worker, cfg.to_dict(), str(out), str(data.path))[0]
    if p.pp > 1:
        ms = " ".join(f"{k} {v:.1f} ms" for k, v in r["mean_ms"].items())
        print(f"bubble    {r['measured_bubble']:.3f} measured vs {r['theory_bubble']:.3f} theory {r['theory']} "
              f"(idle / busy per rank; mean {ms})\n"
              f"          {r['replayed_bubble']:.3f} with these action durations and free messages "
              f"(measured − this = what messages and the executor cost)\n"
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


def print_summary(s: dict) -> None:
    run = Path(s["run_dir"])
    lines = []
    if s.get("val_loss") is not None:
        lines.append(f"validation loss {s['val_loss']:.4f} nats/token vs {s['baseline']} "
                     f"{s['baseline_val_loss']:.4f} after {s['steps']} steps")
    mfu = f"MFU {100 * s['mfu']:.1f}%" if s.get("mfu") is not None else "MFU n/a"
    if s.get("tokens_per_s"):
        lines.append(f"throughput {s['tokens_per_s']:,.0f} tokens/s · {mfu} ({s['mfu_peak_source']})")
        if (s.get("mfu") or 0) > 1:  # a CPU peak measured while other work shared the cores
            lines.append("note: MFU above 100% means the measured peak is too low (taken while the machine was "
                         "busy?): rerun `ndtrain bench matmul` on an idle machine")
    lines += [f"run directory  {run}",
              f"config         {run / 'config.toml'}",
              f"metrics        {run / 'metrics.jsonl'}"]
    if s.get("plot"):
        lines.append(f"loss plot      {s['plot']}")
    if s.get("moe_plot"):
        lines.append(f"MoE load plot  {s['moe_plot']}")
    sample = s.get("sample")  # a prompt of the run's own task (sft, rl): greedy, its answer's length
    hint = (f"--prompt {shlex.quote(sample['prompt'])} --temperature 0 --max-new-tokens {sample['max_new_tokens']}"
            if sample else f"--prompt {shlex.quote('def ')}")
    lines += [f"checkpoint     {s['checkpoint']}",
              f"sample with    ndtrain generate --run {shlex.quote(str(run))} {hint}"]
    print("\n".join(lines), flush=True)


# --------------------------------------------------------------------------- prepare

def cmd_prepare(args) -> int:
    from ndtrain.config import load_config, validate
    cfg = load_config(args.config, args.overrides)
    validate(cfg)
    data = open_data(cfg, cfg.run.progress)
    m = data.meta
    print(f"prepared {data.path}\n  vocabulary {data.vocab_size} · train {m['train_tokens']:,} tokens · "
          f"validation {m['val_tokens']:,} tokens · unigram validation loss {data.unigram_val_loss:.4f}")
    return 0


# --------------------------------------------------------------------------- generate

def cmd_generate(args) -> int:
    import torch

    from ndtrain.checkpoint import store
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
    ids = tok.encode(args.prompt)
    if not ids:
        raise ConfigError("--prompt", args.prompt, "must not be empty")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = sample(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 seed=args.seed, eot_id=tok.eot_id)
    if out and out[-1] == tok.eot_id:
        out = out[:-1]
    print(args.prompt + tok.decode(out))
    return 0


# --------------------------------------------------------------------------- plan

def cmd_plan(args) -> int:
    from ndtrain.plan.command import run
    return run(args)

# --------------------------------------------------------------------------- convert, checkpoint

def cmd_convert(args) -> int:
    from ndtrain.checkpoint.convert import from_hf, to_hf
    from ndtrain.config import ConfigError
    if bool(args.from_hf) == bool(args.to_hf):
        raise ConfigError("convert", "--from-hf / --to-hf", "give exactly one of --from-hf DIR --to RUN_DIR "
                          "and --to-hf RUN_DIR --out DIR")
    if args.from_hf:
        if not args.to:
            raise ConfigError("--to", None, "--from-hf needs --to RUN_DIR, the run directory to create")
        if not Path(args.from_hf).is_dir():
            raise ConfigError("--from-hf", args.from_hf, "directory does not exist")
        path = from_hf(Path(args.from_hf), Path(args.to))
        print(f"converted {args.from_hf} → {path}\ntrain from it with  ndtrain train model.init_from=run:{args.to}")
        return 0
    if not args.out:
        raise ConfigError("--out", None, "--to-hf needs --out DIR, the Hugging Face folder to write")
    if not Path(args.to_hf).is_dir():
        raise ConfigError("--to-hf", args.to_hf, "directory does not exist")
    out = to_hf(Path(args.to_hf), Path(args.out), args.dtype,
                report=lambda m: print(f"ndtrain: {m}", file=sys.stderr))
    print(f"exported {args.to_hf} → {out} (transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def cmd_checkpoint(args) -> int:
    from ndtrain.checkpoint.inspect import describe
    from ndtrain.config import ConfigError
    if not Path(args.dir).is_dir():
        raise ConfigError("DIR", args.dir, "directory does not exist")
    print(describe(Path(args.dir), verify=args.verify))
    return 0


# --------------------------------------------------------------------------- bench

# Benchmarks whose steps are long on a CPU take fewer rounds by default: one generation of
# 256 new tokens without a cache is about 20 s there (docs/benchmarks.md).
BENCH_ROUNDS_STEPS = {"generate": (5, 1)}


def cmd_bench(args) -> int:
    from ndtrain.config import ConfigError, check_writable_dir
    rounds, steps = BENCH_ROUNDS_STEPS.get(args.what, (10, 3))
    args.rounds = rounds if args.rounds is None else args.rounds
    args.steps = steps if args.steps is None else args.steps
    for flag, value in (("--nproc", args.nproc), ("--rounds", args.rounds), ("--steps", args.steps)):
        if value <= 0:
            raise ConfigError(flag, value, "must be > 0")
    if args.out:
        check_writable_dir("--out", args.out)
    if args.what == "matmul":
        from ndtrain.bench.matmul import run_matmul_bench
        return run_matmul_bench(args)
    if args.what == "gpu":
        from ndtrain.bench.gpu import run as run_gpu
        return run_gpu(args)
    from ndtrain.bench import checkpoint, comm, compile, cp, dp, ep, generate, pp, sft, tp, zero
    return {"dp": dp, "tp": tp, "zero": zero, "pp": pp, "cp": cp, "comm": comm, "sft": sft,
            "checkpoint": checkpoint, "ep": ep, "generate": generate, "compile": compile}[args.what].run(args)


if __name__ == "__main__":
    sys.exit(main())
