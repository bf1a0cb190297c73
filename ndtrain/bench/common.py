"""Side-by-side timing (A B / B A rounds, medians, ratio) and what keeps a contest fair.

The machine is shared and noisy, so a benchmark never compares against a number measured
earlier: both contenders run in the same processes, interleaved round by round, and only the
ratio of their medians is reported as the result.

Fair means: the same model, weights, batch and micro-batches, AdamW settings, clip,
precision and recomputed regions on both sides, each applied the way its own framework
documents (`anchor_*` below), and the anchor in its documented best configuration. A key a
benchmark cannot give both sides is refused before anything starts (`Bench.applies`).
"""

from __future__ import annotations

import functools
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ndtrain.config import Config


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def alternate(contenders: dict[str, Callable[[], None]], rounds: int, steps: int,
              device: torch.device, warmup_rounds: int = 1) -> dict[str, list[float]]:
    """Seconds per step of each contender, one figure per round, rounds interleaved, every
    other round in reverse order (A B, then B A), so that no contender always runs right
    after the same other one: what a step leaves behind (freed memory of another shape,
    caches) falls on both sides alike. Every rank runs this; the times are those of the
    slowest rank (barriers around)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(warmup_rounds + rounds):
        order = list(contenders.items())
        for name, fn in (reversed(order) if r % 2 else order):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            _sync(device)
            if r >= warmup_rounds:
                times[name].append((time.perf_counter() - t0) / steps)
    return times


def report(times: dict[str, list[float]], work_per_step: float | dict[str, float], unit: str, ratio_label: str,
           numerator: str, denominator: str) -> str:
    """A table of rounds, the medians, and the ratio line (always last): the throughput of
    `numerator` over that of `denominator` (above 1.00: numerator is faster). `work_per_step`:
    one figure for both, or one per contender."""
    names = list(times)
    work = work_per_step if isinstance(work_per_step, dict) else dict.fromkeys(names, work_per_step)
    width = {n: max(18, len(n)) for n in names}
    cell = lambda n, seconds: f"{f'{work[n] / seconds:,.0f} {unit}':>{width[n]}}"  # noqa: E731
    lines = ["round  " + "  ".join(f"{n:>{width[n]}}" for n in names)]
    for i in range(len(times[names[0]])):
        lines.append(f"{i + 1:>5}  " + "  ".join(cell(n, times[n][i]) for n in names))
    med = {n: statistics.median(v) for n, v in times.items()}
    lines.append("median " + "  ".join(cell(n, med[n]) for n in names))
    rate = {n: work[n] / med[n] for n in names}
    lines.append(f"{ratio_label} throughput ratio: {rate[numerator] / rate[denominator]:.2f}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Bench:
    """A benchmark's defaults and the keys it applies to both contenders.

    `model` is the default shape, dropped as a whole when the user names `model.preset`
    (so `model.preset=125M` means the preset's shape); `settings` are the other defaults;
    `applies` lists the keys (a trailing "." for a whole section) that both sides honour,
    each in the way its own framework documents. Any other key the user sets is refused:
    a setting that reached one side only would make the ratio meaningless."""

    name: str
    model: tuple[str, ...]
    settings: tuple[str, ...]
    applies: tuple[str, ...]


# What every training benchmark (dp, zero, tp) applies to both sides: the model, the batch and
# its micro-batches, AdamW's settings, the global-norm clip, bf16, recomputation, the device.
TRAINING = ("model.", "train.seq_len", "train.global_batch", "train.micro_batch", "train.lr", "train.weight_decay",
            "train.beta1", "train.beta2", "train.eps", "train.grad_clip", "train.seed", "train.precision",
            "train.recompute", "run.device", "run.threads")


def _applies(key: str, keys: tuple[str, ...]) -> bool:
    return key in keys or any(k.endswith(".") and key.startswith(k) for k in keys)


def bench_config(args, bench: Bench) -> Config:
    """The user's --config and KEY=VALUE over the benchmark's defaults, validated for --nproc
    ranks; a key the benchmark cannot apply to both sides is a ConfigError."""
    from ndtrain.config import ConfigError, load_config, validate

    user = load_config(args.config, args.overrides)
    for key in sorted(user.explicit):
        if not _applies(key, bench.applies):
            section, name = key.split(".")
            raise ConfigError(key, getattr(getattr(user, section), name),
                              f"bench {bench.name} cannot apply it to both contenders; leave it out "
                              "(docs/benchmarks.md lists what each benchmark applies)")
    if user.train.precision not in ("auto", "fp32", "bf16"):  # auto: bf16 on CUDA, fp32 on the CPU
        raise ConfigError("train.precision", user.train.precision, "a benchmark compares fp32 or bf16 (fp16's "
                          "loss scaling has no equal on the torch side; fp64 is for the CPU proofs)")
    defaults = bench.settings + (() if "model.preset" in user.explicit else bench.model)
    defaults = [d for d in defaults if d.split("=")[0] not in user.explicit]
    cfg = load_config(args.config, defaults + list(args.overrides))
    cfg.run.nproc = args.nproc
    return validate(cfg, check_paths=False)


def announce(args, cfg: Config, line: str) -> None:
    """Once the benchmark's own checks passed: a warning if its processes outnumber the CPU
    cores, then its header line."""
    from ndtrain.launch import oversubscribed, warn
    warn([oversubscribed(args.nproc, cfg.run.device)])
    print(line, flush=True)


def describe(cfg: Config) -> str:
    """The model and batch of a benchmark's header line."""
    from ndtrain.model.args import param_count
    a, t = cfg.model_args(), cfg.train
    return (f"model {cfg.model.preset} dim={a.dim} layers={a.n_layers} heads={a.n_heads}/{a.n_kv_heads} "
            f"vocab={a.vocab_size}{' tied' if a.tie_embeddings else ''} ({param_count(a) / 1e6:.1f} M parameters) · "
            f"batch {t.global_batch}×{t.seq_len} in micro-batches of {t.micro_batch} · {t.precision} · "
            f"recompute={t.recompute}")


# --------------------------------------------------------------------------- the anchors' settings

def anchor_autocast(cfg: Config, device: torch.device):
    """bf16 on the torch side where no wrapper casts by itself (DDP, DTensor TP): autocast
    around forward and loss, as torch's AMP recipe and torchtitan (without FSDP) do;
    parameters, gradients and AdamW stay fp32. (FSDP2 casts itself: MixedPrecisionPolicy.)"""
    if cfg.train.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def anchor_recompute(model: torch.nn.Module, spec: str) -> None:
    """The regions ours recomputes (parallel/recompute.py), each wrapped in torch's own
    non-reentrant `torch.utils.checkpoint`."""
    from torch.utils.checkpoint import checkpoint

    from ndtrain.parallel.recompute import regions
    for module in regions(model, spec).values():
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)


def anchor_clip(model: torch.nn.Module, max_norm: float) -> None:
    """The global-norm clip, torch's (DTensor-aware) one; 0 = none, as ours."""
    if max_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def synthetic_batch(args, rows: int, seq_len: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, args.vocab_size, (rows, seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


@dataclass
class Contest:
    """What both contenders of a distributed benchmark share: this process's rank, the
    config, this rank's rows of one synthetic global batch (by data-parallel rank: tensor
    parallel ranks share theirs) cut into the config's micro-batches, and our `TrainStep`
    on the config's layout."""

    cfg: Config
    env: object  # launch.ProcessEnv
    args: object  # model.args.ModelArgs
    micro: list  # data.batch.MicroBatch
    n_targets: float
    ours: object  # train.step.TrainStep on a parallel.parallelize.Parallelized

    @classmethod
    def start(cls, cfg_dict: dict) -> "Contest":
        """Join the launched process group and build our side (call `launch.shutdown` after)."""
        from ndtrain.config import from_dict
        from ndtrain.data.batch import MicroBatch
        from ndtrain.launch import init_process
        from ndtrain.mesh import ParallelMesh
        from ndtrain.parallel.parallelize import build
        from ndtrain.train.step import TrainStep
        from ndtrain.train.worker import mesh_shape

        cfg = from_dict(cfg_dict)
        env = init_process(cfg.run.device, cfg.run.threads)
        mesh = ParallelMesh.build(mesh_shape(cfg), env.device)
        args, t = cfg.model_args(), cfg.train
        x, y = synthetic_batch(args, t.global_batch // mesh.dp_size, t.seq_len, mesh.dp_rank, env.device)
        ours = TrainStep(build(args, mesh, cfg), cfg)
        return cls(cfg, env, args, MicroBatch(x, y).split(t.micro_batch), float(t.global_batch * t.seq_len), ours)

    def step_ours(self) -> None:
        """Forward and backward of every micro-batch, the clip, the optimizer: a training step."""
        self.step_of(self.ours)()

    def step_of(self, stepper) -> Callable[[], None]:
        """A training step of `stepper` (a TrainStep on this contest's batch), as a function."""
        t = self.cfg.train

        def step() -> None:
            stepper.forward_backward(self.micro, self.n_targets)
            if t.grad_clip:
                stepper.clip_grad_norm(t.grad_clip)
            stepper.optimizer_step(t.lr)
        return step

    @property
    def tokens(self) -> int:
        return self.cfg.train.global_batch * self.cfg.train.seq_len
