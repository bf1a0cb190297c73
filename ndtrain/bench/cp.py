"""`ndtrain bench cp`: the three context-parallel back ends against each other and against
one process running the same sequences.

On `--nproc` ranks (default 2), all of them one CP group: ring, allgather and ulysses train
the same model (same initial weights) on the same global batch, one step each (forward,
backward, AdamW), at two sequence lengths (train.seq_len / 2 and train.seq_len), alternated
round by round with a fourth contender, the model without CP on rank 0 alone (the other
ranks wait). Then one more step of each, untimed, measures the activation peak per rank
(observe/memory.py). The last line is the ring's throughput over allgather's at the longer
sequence.
"""

from __future__ import annotations

import statistics

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
    from ndtrain.parallel.parallelize import build
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

            def contender(name):
                def step(measure: bool = False):
                    if name in steppers:
                        steppers[name].forward_backward(batches[name], n_targets, measure_memory=measure)
                        if t.grad_clip:
                            steppers[name].clip_grad_norm(t.grad_clip)
                        steppers[name].optimizer_step(t.lr)
                return step

            names = list(IMPLS) + ["1 process"]
            times = alternate({n: contender(n) for n in names}, rounds, steps, env.device)
            for n in names:
                contender(n)(measure=True)
            mine = [steppers[n].memory.activations if n in steppers else 0 for n in names]
            table = per_rank(mine, env.device)
            results.append({"seq_len": seq_len, "tokens": t.global_batch * seq_len,
                            "median_s": {n: statistics.median(times[n]) for n in names},
                            "activations": {n: [row[i] for row in table] for i, n in enumerate(names)}})
        return results
    finally:
        shutdown()


def render(results: list[dict]) -> str:
    lines = []
    for r in results:
        single = r["median_s"]["1 process"]
        lines.append(f"seq_len {r['seq_len']} ({r['tokens']} tokens per step)")
        lines.append(f"  {'contender':<10} {'tokens/s':>10} {'vs 1 process':>13} {'activations per rank':>22}")
        for name, s in r["median_s"].items():
            act = " / ".join(format_bytes(a) for a in r["activations"][name] if a or name != "1 process")
            lines.append(f"  {name:<10} {r['tokens'] / s:>10,.0f} {single / s:>12.2f}× {act:>22}")
    last = results[-1]["median_s"]
    lines.append(f"ndtrain cp ring/allgather throughput ratio: {last['allgather'] / last['ring']:.2f}")
    return "\n".join(lines)


def run(args) -> int:
    cfg = bench_config(args, bench(args.nproc))
    announce(args, cfg, f"bench cp: cp={cfg.parallel.cp} · ring, allgather, ulysses and 1 process · {describe(cfg)} "
                        f"and {cfg.train.seq_len // 2} · {args.rounds} rounds × {args.steps} steps, alternating")
    results = launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps)[0]
    print(render(results))
    return 0
