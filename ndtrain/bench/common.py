"""Side-by-side timing: A B A B rounds, medians, ratio.

The machine is shared and noisy, so a benchmark never compares against a number measured
earlier: both contenders run in the same processes, interleaved round by round, and only the
ratio of their medians is reported as the result.
"""

from __future__ import annotations

import statistics
import time
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
    """Seconds per step of each contender, one figure per round, rounds interleaved.
    Every rank runs this; the times are those of the slowest rank (barriers around)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(warmup_rounds + rounds):
        for name, fn in contenders.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            _sync(device)
            if r >= warmup_rounds:
                times[name].append((time.perf_counter() - t0) / steps)
    return times


def report(times: dict[str, list[float]], work_per_step: float, unit: str, ratio_label: str,
           numerator: str, denominator: str) -> str:
    """A table of rounds, the medians, and the ratio line (always last): the throughput of
    `numerator` over that of `denominator` (above 1.00: numerator is faster)."""
    names = list(times)
    lines = ["round  " + "  ".join(f"{n:>18}" for n in names)]
    for i in range(len(times[names[0]])):
        lines.append(f"{i + 1:>5}  " + "  ".join(f"{work_per_step / times[n][i]:>14,.0f} {unit}" for n in names))
    med = {n: statistics.median(v) for n, v in times.items()}
    lines.append("median " + "  ".join(f"{work_per_step / med[n]:>14,.0f} {unit}" for n in names))
    lines.append(f"{ratio_label} throughput ratio: {med[denominator] / med[numerator]:.2f}")
    return "\n".join(lines)


def bench_config(args, defaults: list[str]) -> Config:
    """The benchmark's defaults, then --config, then the command line's KEY=VALUE, validated
    for --nproc ranks."""
    from ndtrain.config import load_config, validate
    cfg = load_config(args.config, defaults + list(args.overrides))
    cfg.run.nproc = args.nproc
    return validate(cfg)


def synthetic_batch(args, rows: int, seq_len: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, args.vocab_size, (rows, seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


@dataclass
class Contest:
    """What both contenders of a distributed benchmark share: this process's rank, the
    config, this rank's rows of one synthetic global batch (by data-parallel rank: tensor
    parallel ranks share theirs), and our `Parallelized` on the config's layout."""

    cfg: Config
    env: object  # launch.ProcessEnv
    args: object  # model.args.ModelArgs
    x: torch.Tensor
    y: torch.Tensor
    n_targets: float
    ours: object  # train.step.TrainStep on a parallel.parallelize.Parallelized

    @classmethod
    def start(cls, cfg_dict: dict) -> "Contest":
        """Join the launched process group and build our side (call `launch.shutdown` after)."""
        from ndtrain.config import from_dict
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
        return cls(cfg, env, args, x, y, float(t.global_batch * t.seq_len), ours)

    def step_ours(self) -> None:
        from ndtrain.data.batch import MicroBatch
        self.ours.forward_backward([MicroBatch(self.x, self.y)], self.n_targets)
        self.ours.optimizer_step(self.cfg.train.lr)

    @property
    def tokens(self) -> int:
        return self.cfg.train.global_batch * self.cfg.train.seq_len
