"""`ndtrain bench muon`: training steps with Muon against the same steps with AdamW, under
plain data parallelism and under ZeRO-3.

Four contenders on the same ranks, model, weights and micro-batches, each a full training
step (forward, backward, clip, optimizer) on our own layout: AdamW and Muon
(train.optimizer=muon, train/muon.py) with parallel.zero = 0, and the same two with
parallel.zero = 3. Rounds alternate between the four; tokens/s per round, the medians, the
bytes every rank sends in one step (the comm accounting, by group and collective: Muon's
extra traffic is the `stage` group's all-to-alls), one step-time ratio per layout, and last
`ndtrain muon/adamw step-time ratio: X`, the larger of the two.
"""

from __future__ import annotations

import statistics

from ndtrain.bench.common import TRAINING, Bench, Contest, alternate, announce, bench_config, describe, report
from ndtrain.launch import launch_local, shutdown

MODEL = ("model.preset=small",)
SETTINGS = ("train.seq_len=128", "train.global_batch=16", "run.progress=false")  # the default job's step
# Every training key reaches all four except the optimizer and the ZeRO stage, which are what differ.
BENCH = Bench("muon", MODEL, SETTINGS, tuple(k for k in TRAINING if k != "train.optimizer")
              + ("parallel.dp", "train.reduce_fp32") + tuple(f"train.muon_{k}" for k in (
                  "lr", "momentum", "nesterov", "ns_steps", "ns_coefficients", "adjust_lr", "ns_dtype")))
CONTENDERS = (("adamw", 0), ("muon", 0), ("adamw", 3), ("muon", 3))


def _contender(cfg, env, optimizer: str, zero: int):
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.step import TrainStep
    from ndtrain.train.worker import mesh_shape

    cfg = cfg.copy()
    cfg.train.optimizer, cfg.parallel.zero = optimizer, zero
    return TrainStep(build(cfg.model_args(), ParallelMesh.build(mesh_shape(cfg), env.device), cfg), cfg)


def _worker(cfg_dict: dict, rounds: int, steps: int) -> str:
    c = Contest.start(cfg_dict)  # AdamW, zero = 0
    try:
        steppers = {"adamw-dp": c.ours}
        steppers.update({f"{o}-{'zero3' if z else 'dp'}": _contender(c.cfg, c.env, o, z) for o, z in CONTENDERS[1:]})
        sent = {}
        for name, s in steppers.items():  # one step each, counted alone
            s.mesh.stats.reset()
            c.step_of(s)()
            sent[name] = {f"{dim}.{kind}": tally.wire for (dim, kind), tally in s.mesh.stats.tallies.items()}
        times = alternate({name: c.step_of(s) for name, s in steppers.items()}, rounds, steps, c.env.device)
        table = report(times, c.tokens, "tok/s", "", numerator="muon-dp", denominator="adamw-dp").rsplit("\n", 1)[0]
        median = {n: statistics.median(v) for n, v in times.items()}
        lines = [table, "bytes sent by rank 0 in one step (comm accounting, by group.collective):"]
        for name, by in sent.items():
            muon = sum(v for k, v in by.items() if k.startswith("stage."))
            lines.append(f"  {name:<12} total {sum(by.values()):>14,.0f}  Muon's owners (stage.all_to_all) {muon:>12,.0f}  "
                         + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(by.items())))
        ratios = {layout: median[f"muon-{layout}"] / median[f"adamw-{layout}"] for layout in ("dp", "zero3")}
        lines += [f"muon/adamw step-time ratio, {layout}: {r:.3f}" for layout, r in ratios.items()]
        lines.append(f"ndtrain muon/adamw step-time ratio: {max(ratios.values()):.2f}")
        return "\n".join(lines)
    finally:
        shutdown()


def run(args) -> int:
    cfg = bench_config(args, BENCH)
    cfg.train.optimizer = "adamw"
    announce(args, cfg, f"bench muon: AdamW vs Muon, dp and ZeRO-3 · {args.nproc} rank{'s' if args.nproc > 1 else ''} "
                        f"· {describe(cfg)} · {args.rounds} rounds × {args.steps} steps of 4 contenders, alternating")
    print(launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps)[0])
    return 0
