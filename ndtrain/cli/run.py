"""Running a task from the command line, shared by train, sft, rl and trace: the data, the run
directory and whether it resumes, the model-state fit, the warnings before the start, the
ranks under the run directory's lock, and the summary printed at the end."""

from __future__ import annotations

import datetime
import os
import shlex
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

from ndtrain.config.schema import uses_cuda


class Stopped(Exception):
    """A run started on the way (sft's default pretraining run, rl's SFT warm-up) was stopped
    by a signal: the command ends with its status (`code`) and says what continues it."""

    def __init__(self, code: int, message: str):
        self.code = code
        super().__init__(message)


def layout_words(cfg) -> str:
    """'2 processes (pp=1 dp=2 cp=1 tp=1), fp32': the banner's layout and the precision that
    runs (after validation resolved train.precision = auto for the device)."""
    p, t = cfg.parallel, cfg.train
    precision = t.precision
    if precision == "fp8":
        precision = f"fp8 {t.fp8_recipe} (the rest {t.fp8_base})"
    elif precision == "nvfp4":
        precision = f"nvfp4 (the rest {t.fp8_base})"
    elif precision == "fp32" and t.tf32 and uses_cuda(cfg.run.device):
        precision = "fp32 (matmuls on TF32)"
    return (f"{p.world} process{'es' if p.world > 1 else ''} (pp={p.pp} dp={p.dp} cp={p.cp} tp={p.tp}"
            + (f" ep={p.ep}" if p.ep > 1 else "") + f"), {precision}")


SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "moe_experts")


def model_words(cfg) -> str:
    """'1B model (1.24 B parameters)': the preset and what it holds with the vocabulary that
    runs (model.vocab_size once resolved from the tokenizer); a model whose shape is not its
    preset's (model.init_from's, or keys set) is named by its shape instead, not by a preset
    it is not."""
    from ndtrain.model.args import PRESETS, param_count
    a = cfg.model_args(vocab_size=cfg.model.vocab_size)
    preset = PRESETS.get(cfg.model.preset)
    same = preset is not None and all(getattr(a, k) == getattr(preset, k) for k in SHAPE)
    name = f"{cfg.model.preset} model" if same else f"model of dim {a.dim} × {a.n_layers} layers"
    n = param_count(a)
    return f"{name} ({n / 1e9:.2f} B parameters)" if n >= 1e9 else f"{name} ({n / 1e6:.1f} M parameters)"


def warn_before_start(cfg, world: int | None, command: str = "train") -> None:
    """Keys that do nothing in this layout, and more CPU processes than cores."""
    from ndtrain.idle_keys import idle_keys
    from ndtrain.launch import oversubscribed, warn
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.world)) if world else cfg.parallel.world
    warn(idle_keys(cfg, world, command) + [oversubscribed(local, cfg.run.device)])


def open_data(cfg, progress: bool):
    """The prepared data of `cfg` (prepared now if the cache lacks it; a mixture's sources
    each), every shard checked against its checksum and its ids against the vocabulary."""
    from ndtrain.train.worker import prepare
    data = prepare(cfg, progress)
    data.verify()
    return data


def choose_run_dir(cfg, task: str) -> Path:
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


def with_nproc(cfg, args):
    """`--nproc N` is `run.nproc = N`, set explicitly."""
    if args.nproc is not None:
        cfg.run.nproc = args.nproc
        cfg.explicit |= {"run.nproc"}
    return cfg


def run_task(cfg, world: int | None, run_dir: Path, worker, worker_args: tuple, preload: tuple[str, ...] = (),
             banner: list[str] = (), describe=None, argv: list[str] = ()) -> int:
    """A task's ranks under the run directory's lock: this process as one rank (torchrun,
    SLURM: rank 0 takes the lock), or ranks started here after printing `banner`. Then rank
    0's summary (`describe(summary)` first), and the exit status: 128 + the signal that
    stopped the run, or 0 (always 0 under torchrun, which would take another status for a
    failure to restart). `argv`: the command's arguments, for the command that continues a
    stopped run."""
    from ndtrain import supervisor
    from ndtrain.checkpoint.lock import RunLock
    _check_replicas(cfg, world)
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
    code = _stopped(summary, stop_signal, continue_command(cfg, run_dir, argv, world))
    return 0 if world is not None else code


def _check_replicas(cfg, world: int | None) -> None:
    """run.fault_tolerance = "replicas" needs ndtrain's own launcher: its parent hosts the
    lighthouse (docs/faults.md)."""
    from ndtrain.config import ConfigError
    if cfg.run.fault_tolerance == "replicas" and world is not None:
        raise ConfigError("run.fault_tolerance", "replicas", "needs ndtrain's own launcher (one machine), not "
                          "torchrun or srun: its parent process is the lighthouse")


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
    if run.fault_tolerance == "replicas":
        from ndtrain.replicas.launch import launch_replicas
        results = launch_replicas(p.world, p.dp_replicate, worker, args, max_restarts=run.max_restarts,
                                  heartbeat_s=run.heartbeat_s, preload=preload,
                                  log=lambda m: print(f"ndtrain: {m}", file=sys.stderr, flush=True))
        return results[0], 0
    results = launch_local(p.world, worker, *args, max_restarts=run.max_restarts, heartbeat_s=run.heartbeat_s,
                           preload=preload)
    return results[0], results.stop_signal


def continue_command(cfg, run_dir: Path, argv: list[str], world: int | None) -> str:
    """What continues this run: the same command, with `run.dir=` added when the run chose
    its folder itself (a bare command would start a new runs/<task>-<time>)."""
    extra = [] if cfg.run.dir else [f"run.dir={run_dir}"]
    if world is not None:  # torchrun or srun started this process: we cannot spell their command
        return "the same launch" + (f" with {shlex.join(extra)}" if extra else "")
    return shlex.join(["ndtrain", *argv, *extra])


def _stopped(summary: dict, stop_signal: int, resume: str) -> int:
    """Exit status 0, or 128 + the signal that stopped the run at a step boundary."""
    if not summary.get("stopped"):
        return 0
    stop_signal = signal.Signals(stop_signal or signal.SIGTERM)
    print(f"ndtrain: stopped by {stop_signal.name} after step {summary['steps']}, checkpoint saved; continue the "
          f"run with: {resume}", file=sys.stderr, flush=True)
    return 128 + int(stop_signal)


def check_fits(cfg, world: int | None, key: str = "train.seq_len", rollout_rows: int = 0) -> None:
    """Refuse, before any process starts, a model whose states alone overflow the device,
    a sequence (set by `key`) whose logits and rotary tables alone would, and LoRA targets
    that leave a pipeline rank nothing to train."""
    from ndtrain.plan.fit import check_lora_stages, check_model_states_fit, check_sequence_fits
    from ndtrain.train.dry_run import vocab_size
    check_lora_stages(cfg)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.world)) if world else cfg.parallel.world
    vocab = vocab_size(cfg)
    check_model_states_fit(cfg, vocab, local)
    section, name = key.split(".")
    check_sequence_fits(cfg, vocab, local, key, getattr(getattr(cfg, section), name), rollout_rows)


def print_summary(s: dict) -> None:
    run = Path(s["run_dir"])
    lines = []
    if s.get("val_loss") is not None:
        lines.append(f"validation loss {s['val_loss']:.4f} {s.get('loss_unit', 'nats/token')} vs {s['baseline']} "
                     f"{s['baseline_val_loss']:.4f} after {s['steps']} steps")
    if s.get("source_tokens"):  # a mixture: each source's share of the tokens, its validation loss
        total = sum(s["source_tokens"].values()) or 1
        val = s.get("source_val_loss") or {}
        lines += [f"  source {name}: {n:,} tokens ({100 * n / total:.1f}%)"
                  + (f" · validation loss {val[name]:.4f}" if name in val else "")
                  for name, n in s["source_tokens"].items()]
    mfu = f"MFU {100 * s['mfu']:.1f}%" if s.get("mfu") is not None else "MFU n/a"
    if s.get("tokens_per_s"):
        lines.append(f"throughput {s['tokens_per_s']:,.0f} tokens/s · {mfu} ({s['mfu_peak_source']})")
        if (s.get("mfu") or 0) > 1:  # a CPU peak measured while other work shared the cores
            lines.append("note: MFU above 100% means the measured peak is too low (taken while the machine was "
                         "busy?): rerun `ndtrain bench matmul` on an idle machine")
    if s.get("fp8"):
        lines.append(s["fp8"])
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
