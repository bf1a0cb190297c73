"""Where a pipeline step's time goes outside the model: each of our schedules and torch's
counterpart (`ndtrain bench pp`'s pairs, same model, chunks and micro-batches) on 2 ranks.

    PYTHONPATH=. python benchmarks/pp_profile.py [--steps 5] [KEY=VALUE ...]

Per contender and rank, per step: Python function calls and autograd engine calls (one
step under cProfile: exact counts); the wall time per step (median of `--steps` steps, the
two sides alternating step by step, no profiler); for ours, the step split by its timeline
(timeline.py) into compute (F, B, W), waiting for messages, posting them, and the rest: the
executor's own time between actions. Then the zero-bubble split itself on one chunk, one
process: a whole backward against B + W (`SplitBackward`), and the Python graph walk inside
B, medians of alternating runs. Runs against whatever ndtrain is on PYTHONPATH, so an older
checkout is profiled the same way.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time


def _counts(step) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    return {"calls": sum(v[1] for v in stats.values()),
            "engine": sum(v[1] for (_, _, name), v in stats.items() if "run_backward' of" in name)}


def _breakdown(events) -> dict:
    """Seconds of one step on one rank: compute, waits, posts, and the executor's time between."""
    span = max(e.end for e in events) - min(e.start for e in events)
    parts = {k: sum(e.end - e.start for e in events if e.kind in kinds)
             for k, kinds in (("compute", ("F", "B", "W")), ("wait", ("wait", "wait_F", "wait_B")), ("post", ("post",)))}
    parts["between"] = span - sum(parts.values())
    for kind in ("F", "B", "W"):
        parts[kind] = sum(e.end - e.start for e in events if e.kind == kind)
    return parts


def _worker(cfg_dict: dict, steps: int, only: str = "") -> list:
    import torch.distributed as dist

    from ndtrain.bench import pp
    from ndtrain.bench.common import synthetic_batch
    from ndtrain.config import from_dict
    from ndtrain.data.batch import MicroBatch
    from ndtrain.launch import init_process, shutdown
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.worker import mesh_shape

    cfg = from_dict(cfg_dict)
    env = init_process(cfg.run.device, cfg.run.threads)
    try:
        mesh = ParallelMesh.build(mesh_shape(cfg), env.device)
        args, t = cfg.model_args(), cfg.train
        x, y = synthetic_batch(args, t.global_batch, t.seq_len, 0, env.device)
        micro = MicroBatch(x, y).split(t.micro_batch)
        n = float(t.global_batch * t.seq_len)
        contests = pp._contests() if hasattr(pp, "_contests") else pp.CONTESTS
        rows = []
        for name, anchor, third in contests:
            if only and name not in only.split(","):
                continue
            c = pp._with_schedule(cfg, name, third)
            par = build(args, mesh, c)

            def ours(par=par):
                par.forward_backward(micro, n)
                par.grad_sync.zero_grad()
            theirs = pp._anchor(c, args, mesh, anchor, x, y, n, len(micro))
            ours(), theirs()
            counts = (_counts(ours), _counts(theirs))
            walls, cpus, parts = ([], []), ([], []), []
            for _ in range(steps):
                for side, step in enumerate((ours, theirs)):
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    step()
                    cpus[side].append(time.process_time() - c0)
                    dist.barrier()
                    walls[side].append(time.perf_counter() - t0)
                    if side == 0:
                        parts.append(_breakdown(par.schedule.timeline.events))
            median = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
            rows.append((name, anchor, counts, [statistics.median(w) for w in walls], median,
                         [statistics.median(c) for c in cpus]))
        return rows
    finally:
        shutdown()


def _split_bench(runs: int) -> str:
    """One process: the last chunk of the default bench model (4 blocks and the head), a
    whole backward against the split one, alternating; and the graph walk inside B."""
    import torch

    from ndtrain.model.args import ModelArgs
    from ndtrain.model.llama import Transformer
    from ndtrain.parallel.pipeline import weightgrad
    from ndtrain.parallel.pipeline.weightgrad import SplitBackward

    torch.manual_seed(0)
    a = ModelArgs(dim=256, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=512, max_seq_len=128)
    chunk = Transformer(a, [4, 5, 6, 7], embed=False, head=True)
    chunk.init_weights(0)
    tokens = torch.randint(0, 512, (2, 128))

    def forward():
        x = torch.randn(2, 128, 256, requires_grad=True)
        return x, torch.nn.functional.cross_entropy(chunk(x).flatten(0, 1), tokens.flatten())

    walk, inner = [], weightgrad._reaches

    def timed_reaches(*args):
        t0 = time.perf_counter()
        out = inner(*args)
        walk.append(time.perf_counter() - t0)
        return out
    weightgrad._reaches = timed_reaches
    times = {"whole": [], "B": [], "W": []}
    for _ in range(runs):
        x, loss = forward()
        t0 = time.perf_counter()
        loss.backward()
        times["whole"].append(time.perf_counter() - t0)
        x, loss = forward()
        t0 = time.perf_counter()
        work = SplitBackward(loss, x, None)
        t1 = time.perf_counter()
        work.weights()
        times["B"].append(t1 - t0)
        times["W"].append(time.perf_counter() - t1)
        chunk.zero_grad()
    weightgrad._reaches = inner
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return (f"split backward of the last chunk (4 blocks + head, 2×128 tokens), median of {runs}: whole "
            f"{med['whole']:.1f} ms, B {med['B']:.1f} ms + W {med['W']:.1f} ms = {med['B'] + med['W']:.1f} ms "
            f"({(med['B'] + med['W']) / med['whole']:.2f}× the whole); the graph walk in B "
            f"{1e3 * statistics.median(walk):.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--split-runs", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated schedules (default: every pair of bench pp)")
    ap.add_argument("overrides", nargs="*")
    opts = ap.parse_args()
    from ndtrain.bench import pp
    from ndtrain.bench.common import bench_config
    from ndtrain.launch import launch_local

    ns = argparse.Namespace(config=None, overrides=opts.overrides, nproc=2, rounds=1, steps=1, out="")
    cfg = bench_config(ns, pp.BENCH)
    ranks = launch_local(2, _worker, cfg.to_dict(), opts.steps, opts.only)
    print(f"per step; counts: rank 0 | rank 1 (one step under cProfile); wall: median of {opts.steps} steps, "
          "alternating, rank 0; cpu: the process's CPU time (all its threads; less sensitive to other "
          "jobs' load than wall), rank 0 | rank 1; ours split by its timeline on rank 0 | rank 1")
    print(f"{'schedule':<12}{'Python calls ours':>20}{'torch':>16}{'autograd calls ours':>22}{'torch':>12}"
          f"{'wall ms ours':>14}{'torch':>8}{'cpu ms ours':>18}{'torch':>14}  "
          f"{'ours: compute (F+B+W) / wait / post / between (ms)':<44}")
    for (name, anchor, (c0o, c0t), wall, p0, cpu0), (_, _, (c1o, c1t), _, p1, cpu1) in zip(ranks[0], ranks[1]):
        split = " | ".join(f"{1e3 * p['compute']:.0f} ({'+'.join(f'{1e3 * p[k]:.0f}' for k in 'FBW')})/"
                           + "/".join(f"{1e3 * p[k]:.0f}" for k in ("wait", "post", "between"))
                           for p in (p0, p1))
        print(f"{name:<12}{c0o['calls']:>10,.0f} |{c1o['calls']:>7,.0f}{c0t['calls']:>8,.0f} |{c1t['calls']:>7,.0f}"
              f"{c0o['engine']:>14,.0f} |{c1o['engine']:>6,.0f}{c0t['engine']:>6,.0f} |{c1t['engine']:>5,.0f}"
              f"{1e3 * wall[0]:>14.1f}{1e3 * wall[1]:>8.1f}{1e3 * cpu0[0]:>10.0f} |{1e3 * cpu1[0]:>5.0f}"
              f"{1e3 * cpu0[1]:>7.0f} |{1e3 * cpu1[1]:>5.0f}  {split}")
    print(_split_bench(opts.split_runs))


if __name__ == "__main__":
    main()
