"""`ndtrain bench cp`: the three context-parallel back ends against each other and against
one process running the same sequences.

On `--nproc` ranks (default 2), all of them one CP group: ring, allgather and ulysses train
the same model (same initial weights) on the same global batch, one step each (forward,
backward, AdamW), at two sequence lengths (train.seq_len / 2 and train.seq_len), alternated
round by round with a fourth contender, the model without CP on rank 0 alone (the other
ranks wait). Next to the wall-clock throughput, each contender's CPU seconds per step on
its busiest rank (process time, median), and that over one process's ("work vs 1": 0.5
is a perfect split over 2 ranks): on a host whose cores other jobs share, a contender
that needs every core at once loses wall time that the CPU seconds do not show. Then one
more step of each, untimed, measures the activation peak per rank (observe/memory.py).
A line names the attention op the ring and all-gather blocks run on (parallel/context/
fused.py: full, causal and document-masked blocks; this benchmark's rows have no
documents). The last line is each back end's throughput over one process's at the longer
sequence.
"""

from __future__ import annotations

import statistics
import time

import torch

from ndtrain.bench.common import TRAINING, Bench, alternate, announce, bench_config, describe
from ndtrain.launch import launch_local, shutdown
from ndtrain.observe.memory import format_bytes, per_rank

MODEL = ("model.preset=small", "model.n_layers=4", "model.dim=256", "model.ffn_dim=768", "model.n_heads=8",
         "model.n_kv_heads=4", "model.vocab_size=4096", "model.tie_embeddings=false")
SETTINGS = ("train.seq_len=2048", "train.global_batch=2", "run.progress=false")
IMPLS = ("ring", "allgather", "ulysses")


def bench(nproc: int) -> Bench:
    """Every contender is ours, so every training key reaches all of them; the CP group is
    every rank."""
    return Bench("cp", MODEL, SETTINGS + (f"parallel.cp={nproc}",), TRAINING)


def _alone(device: torch.device):
    """A one-process mesh inside a launched group (for the contender without CP)."""
    from ndtrain.comm.stats import CommStats
    from ndtrain.mesh import COMPOSITES, DIMS, Group, MeshShape, ParallelMesh, expert_groups
    stats = CommStats()
    groups = {name: Group(name, [0], 0, None, stats, device) for name in DIMS + tuple(COMPOSITES)}
    groups.update(expert_groups(MeshShape(), 0, device, stats, groups))
    return ParallelMesh(MeshShape(), 0, device, groups, stats)


def _worker(cfg_dict: dict, rounds: int, steps: int) -> list[dict]:
    from ndtrain.config import from_dict
    from ndtrain.data.batch import MicroBatch
    from ndtrain.launch import init_process
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel import context
    from ndtrain.parallel.context import fused
    from ndtrain.parallel.parallelize import build
    from ndtrain.parallel.precision import compute_dtype
    from ndtrain.train.step import TrainStep
    from ndtrain.train.worker import mesh_shape

    base = from_dict(cfg_dict)
    env = init_process(base.run.device, base.run.threads)
    try:
        mesh = ParallelMesh.build(mesh_shape(base), env.device)
        cp = mesh.group("cp")
        results = []
        for seq_len in (base.train.seq_len // 2, base.train.seq_len):
            cfg = base.copy()
            cfg.train.seq_len = seq_len
            args, t = cfg.model_args(), cfg.train
            g = torch.Generator().manual_seed(1234)
            tokens = torch.randint(0, args.vocab_size, (t.global_batch, seq_len + 1), generator=g).to(env.device)
            whole = MicroBatch(tokens[:, :-1], tokens[:, 1:])  # the CP group shares every row
            n_targets = float(t.global_batch * seq_len)
            steppers, batches = {}, {}
            for impl in IMPLS:
                cfg.parallel.cp_impl = impl
                steppers[impl] = TrainStep(build(args, mesh, cfg), cfg)
                batches[impl] = context.shard(whole, cp.size, cp.rank).split(t.micro_batch)
            if mesh.rank == 0:
                single = cfg.copy()
                single.parallel.cp, single.parallel.dp = 1, 1
                steppers["1 process"] = TrainStep(build(args, _alone(env.device), single), single)
            batches["1 process"] = whole.split(t.micro_batch)

            cpu: dict[str, list[float]] = {}  # this process's CPU seconds of each step

            def contender(name):
                def step(measure: bool = False):
                    start = time.process_time()
                    if name in steppers:
                        steppers[name].forward_backward(batches[name], n_targets, measure_memory=measure)
                        if t.grad_clip:
                            steppers[name].clip_grad_norm(t.grad_clip)
                        steppers[name].optimizer_step(t.lr)
                    cpu.setdefault(name, []).append(time.process_time() - start)
                return step

            names = list(IMPLS) + ["1 process"]
            times = alternate({n: contender(n) for n in names}, rounds, steps, env.device)
            busy = per_rank([statistics.median(cpu[n][steps:]) for n in names], env.device)  # past the warm-up
            for n in names:
                contender(n)(measure=True)
            mine = [steppers[n].memory.activations if n in steppers else 0 for n in names]
            table = per_rank(mine, env.device)
            heads, kv_heads = args.n_heads // cfg.parallel.tp, max(1, args.n_kv_heads // cfg.parallel.tp)
            kernels = fused.describe(env.device, compute_dtype(t.precision), heads, kv_heads, args.head_dim,
                                     seq_len // cp.size)
            results.append({"seq_len": seq_len, "tokens": t.global_batch * seq_len, "kernels": kernels,
                            "median_s": {n: statistics.median(times[n]) for n in names},
                            "cpu_s": {n: max(row[i] for row in busy) for i, n in enumerate(names)},
                            "activations": {n: [row[i] for row in table] for i, n in enumerate(names)}})
        return results
    finally:
        shutdown()


def render(results: list[dict]) -> str:
    lines = []
    for r in results:
        single, single_cpu = r["median_s"]["1 process"], r["cpu_s"]["1 process"]
        lines.append(f"seq_len {r['seq_len']} ({r['tokens']} tokens per step)")
        lines.append(f"  {'contender':<10} {'tokens/s':>10} {'vs 1 process':>13} {'CPU s/rank':>11} "
                     f"{'work vs 1':>10} {'activations per rank':>22}")
        for name, s in r["median_s"].items():
            act = " / ".join(format_bytes(a) for a in r["activations"][name] if a or name != "1 process")
            busy = r["cpu_s"][name]
            lines.append(f"  {name:<10} {r['tokens'] / s:>10,.0f} {single / s:>12.2f}× {busy:>11.3f} "
                         f"{busy / single_cpu:>10.2f} {act:>22}")
    last = results[-1]
    lines.append(f"ring and allgather attention: {last['kernels']}")
    ratios = ", ".join(f"{n} {last['median_s']['1 process'] / last['median_s'][n]:.2f}" for n in IMPLS)
    lines.append(f"ndtrain cp throughput vs 1 process at seq_len {last['seq_len']}: {ratios}")
    return "\n".join(lines)


def run(args) -> int:
    cfg = bench_config(args, bench(args.nproc))
    announce(args, cfg, f"bench cp: cp={cfg.parallel.cp} · ring, allgather, ulysses and 1 process · {describe(cfg)} "
                        f"and {cfg.train.seq_len // 2} · {args.rounds} rounds × {args.steps} steps, alternating")
    results = launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps)[0]
    print(render(results))
    return 0
