"""Where Muon's step time goes, measured in CPU seconds (docs/benchmarks.md, "Muon against AdamW").

    python docs/muon_step_cpu.py steps ROUNDS ZERO   # 2 ranks: AdamW vs Muon training steps
    python docs/muon_step_cpu.py ns                  # one process: the owner's iterations alone

`steps`: `ndtrain bench muon`'s contenders (the default job's model and step, 2 CPU ranks) with
parallel.zero = ZERO, alternating round by round; per step and rank the wall seconds and the
CPU seconds of the process (time.process_time: every thread, gloo's included), medians over
ROUNDS, and Muon's over AdamW's. On a shared machine the wall figures move with the other
jobs; CPU seconds much less (caches still suffer), which is why they are printed.

`ns`: one dp2 rank's share of the small model's Newton–Schulz work (two layers' q, k, v, o,
gate, up, down: 1.19 GFLOP) in fp32 on one thread, the minimum CPU time of 25 repetitions:
as train/muon.newton_schulz runs it, with kept `out=` buffers, with the tall matrices made
contiguous first, batched by shape (`baddbmm`), and in bf16."""

from __future__ import annotations

import statistics
import sys
import time

import torch


def _worker(cfg_dict: dict, rounds: int, zero: int) -> str:
    import torch.distributed as dist

    from ndtrain.bench.common import Contest
    from ndtrain.bench.muon import _contender
    from ndtrain.launch import shutdown
    c = Contest.start(cfg_dict)
    try:
        steps = {name: c.step_of(_contender(c.cfg, c.env, name, zero)) for name in ("adamw", "muon")}
        wall = {name: [] for name in steps}
        cpu = {name: [] for name in steps}
        for r in range(rounds + 1):  # round 0 warms up
            for name, step in (list(steps.items()) if r % 2 == 0 else list(reversed(steps.items()))):
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                step()
                if r:
                    wall[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
        w = {n: statistics.median(v) for n, v in wall.items()}
        u = {n: statistics.median(v) for n, v in cpu.items()}
        return (f"rank {dist.get_rank()} zero={zero}: wall ms adamw {w['adamw'] * 1e3:.1f} muon {w['muon'] * 1e3:.1f} "
                f"(ratio {w['muon'] / w['adamw']:.3f}) · cpu ms adamw {u['adamw'] * 1e3:.1f} muon {u['muon'] * 1e3:.1f} "
                f"(ratio {u['muon'] / u['adamw']:.3f}, Muon's extra {(u['muon'] - u['adamw']) * 1e3:.1f} ms)")
    finally:
        shutdown()


def steps(rounds: int, zero: int) -> None:
    from ndtrain.bench.common import bench_config
    from ndtrain.bench.muon import BENCH
    from ndtrain.cli.parser import build_parser
    from ndtrain.launch import launch_local
    args = build_parser().parse_args(["bench", "muon"])
    cfg = bench_config(args, BENCH)
    for line in launch_local(args.nproc, _worker, cfg.to_dict(), rounds, zero):
        print(line)


def ns() -> None:
    from ndtrain.train.muon import newton_schulz
    torch.set_num_threads(1)
    coefficients = (3.4445, -4.7750, 2.0315)
    a, b, c = coefficients
    layer = [(128, 128), (128, 128), (64, 128), (64, 128), (384, 128), (384, 128), (128, 384)]
    mats = [torch.randn(s) for s in layer * 2]  # a dp2 rank owns half of the 4 layers' matrices

    def kept_buffers(g):
        x = g.T if g.size(0) > g.size(1) else g
        x = x / x.norm().clamp(min=1e-7)
        m, n = x.shape
        gram, update, ys = torch.empty(m, m), torch.empty(m, m), [torch.empty(m, n), torch.empty(m, n)]
        for i in range(5):
            torch.mm(x, x.T, out=gram)
            torch.addmm(gram, gram, gram, beta=b, alpha=c, out=update)
            x = torch.addmm(x, update, x, beta=a, out=ys[i % 2])
        return x

    def contiguous(g):
        x = g.T.contiguous() if g.size(0) > g.size(1) else g
        return newton_schulz(x, coefficients, 5, torch.float32)

    def batched(group):
        x = torch.stack(group)
        x = x.mT if x.size(1) > x.size(2) else x
        x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=1e-7)
        for _ in range(5):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x
    by_shape: dict = {}
    for m in mats:
        by_shape.setdefault(tuple(m.shape), []).append(m)
    variants = {"as run (fp32)": lambda: [newton_schulz(m, coefficients, 5, torch.float32) for m in mats],
                "kept out= buffers": lambda: [kept_buffers(m) for m in mats],
                "tall made contiguous": lambda: [contiguous(m) for m in mats],
                "batched by shape": lambda: [batched(g) for g in by_shape.values()],
                "bf16": lambda: [newton_schulz(m, coefficients, 5, torch.bfloat16) for m in mats]}
    for name, run in variants.items():
        best = float("inf")
        for _ in range(25):
            c0 = time.process_time()
            run()
            best = min(best, time.process_time() - c0)
        print(f"{name:<22} {best * 1e3:6.1f} ms")


if __name__ == "__main__":
    if sys.argv[1] == "ns":
        ns()
    else:
        steps(int(sys.argv[2]), int(sys.argv[3]))
