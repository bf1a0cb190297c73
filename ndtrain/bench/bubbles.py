"""The bubble of each of our pipeline schedules, measured on real compute and on paced
compute, next to its theory (`ndtrain bench pp`).

Each schedule runs 1 + BUBBLE_STEPS steps with its timeline recorded; the median step's
bubble (idle over busy time per rank, Megatron's t_bubble / t_ideal) is reported with the
best one and the *replay*: the bubble the schedule would have with exactly that step's action
durations but free messages (measured − replay is what our messages and executor cost).
Twice: on this machine's cores, and *paced* (bench/pacing.py), where every block costs
exactly PACE_S in F, B and W without occupying a core, which is what the theory assumes.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from ndtrain.bench.pacing import pace
from ndtrain.observe.trace import bubble_report, draw
from ndtrain.parallel.parallelize import build
from ndtrain.parallel.pipeline.schedules import vshape
from ndtrain.parallel.pipeline.timeline import gather

# interleaved with parallel.pp_virtual chunks per rank, ZB-V and DualPipeV with 2 (a V)
SCHEDULES = ("afab", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
BUBBLE_STEPS = 5  # timed steps per schedule for the bubble; the median one is reported
PACE_S = 0.05  # seconds per block per F, B and W in the paced measurement (large against the ~2 ms
# of real work and hook overhead per block, and against this host's sleep jitter)


def measure_bubbles(cfg, args, mesh, micro, n_targets: float, steps: int, out: str,
                    paced_s: float = 0.0) -> list[dict] | None:
    """Each schedule's median measured bubble over `steps` steps (after one warm-up step);
    with `out`, the timeline of that median step drawn to out/pp-<schedule>.png
    (pp-paced-<schedule>.png when every block is paced to `paced_s` per F, B and W)."""
    rows = []
    for name in SCHEDULES:
        v = cfg.parallel.pp_virtual if name == "interleaved" else 2 if vshape(name) else 1
        c = cfg.copy()
        c.parallel.pp_schedule, c.parallel.pp_virtual = name, v
        chunks = mesh.shape.pp * v
        if paced_s and args.n_layers % chunks == 0:  # paced blocks cost the same: as many in every chunk
            c.parallel.pp_split = ",".join([str(args.n_layers // chunks)] * chunks)
        par = build(args, mesh, c)
        if paced_s:
            pace(par.model, paced_s, paced_s, paced_s)
        par.schedule.timeline.sync = mesh.device.type == "cuda"
        measured = []
        for k in range(steps + 1):
            par.forward_backward(micro, n_targets)
            par.grad_sync.zero_grad()
            ranks = gather(par.schedule.timeline.events)
            if k and ranks is not None:
                measured.append((bubble_report(ranks, name, mesh.shape.pp, v, len(micro)), ranks))
        if measured:
            ordered = sorted(measured, key=lambda r: r[0]["measured_bubble"])
            median, ranks = ordered[len(ordered) // 2]
            median["best_bubble"] = ordered[0][0]["measured_bubble"]
            rows.append(median)
            if out:
                Path(out).mkdir(parents=True, exist_ok=True)
                label = name + (f" v={v}" if v > 1 else "") + (f" · paced {paced_s * 1e3:.0f} ms/block" if paced_s else "")
                title = (f"{label} · pp={mesh.shape.pp} · {len(micro)} micro-batches · bubble "
                         f"{median['measured_bubble']:.3f} measured, {median['theory_bubble']:.3f} theory {median['theory']}")
                png = f"pp-paced-{name}.png" if paced_s else f"pp-{name}.png"
                draw(ranks, Path(out) / png, title, [f"stage {r}" for r in range(len(ranks))], mesh.shape.pp)
    return rows if mesh.rank == 0 else None


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def bubble_table(real: list[dict], paced: list[dict]) -> list[str]:
    """One row per schedule: the real-compute bubble (median, best, replay, theory with the
    measured F, B, W), the paced one next to it, and the formula; then how zero bubble
    compares with 1F1B and whether each paced median is within 25% of its theory."""
    columns = f"{'median':>8}{'best':>7}{'replay':>8}{'theory':>8}"
    lines = [f"{'':<16}{'real compute (these cores)':^31}   {f'paced ({PACE_S * 1e3:.0f} ms per block per F, B, W)':^31}",
             f"{'schedule':<16}{columns}   {columns}  formula", "-" * 100]
    for r, q in zip(real, paced):
        name = r["schedule"] + (f" v={r['virtual']}" if r["virtual"] > 1 else "")
        cells = ["".join(f"{x[k]:>{w}.3f}" for k, w in (("measured_bubble", 8), ("best_bubble", 7),
                                                       ("replayed_bubble", 8), ("theory_bubble", 8))) for x in (r, q)]
        lines.append(f"{name:<16}{cells[0]}   {cells[1]}  {r['theory']}")
    within = [f"{q['schedule']} {_yes(abs(q['measured_bubble'] - q['theory_bubble']) <= 0.25 * q['theory_bubble'])}"
              for q in paced]
    lines.append("paced median within 25% of theory: " + ", ".join(within))
    lines += ["", "step time of the median step: measured, and simulated from its mean F, B, W per chunk, message "
              "post and message time (parallel/pipeline/simulate.py)",
              f"{'schedule':<16}{'real ms':>9}{'sim ms':>9}{'sim/real':>9}   {'paced ms':>9}{'sim ms':>9}{'sim/real':>9}"]
    for r, q in zip(real, paced):
        name = r["schedule"] + (f" v={r['virtual']}" if r["virtual"] > 1 else "")
        cells = [f"{x['measured_step_ms']:>9.1f}{x['simulated_step_ms']:>9.1f}"
                 f"{x['simulated_step_ms'] / x['measured_step_ms']:>9.2f}" for x in (r, q)]
        lines.append(f"{name:<16}{cells[0]}   {cells[1]}")
    worst = max(abs(x["simulated_step_ms"] / x["measured_step_ms"] - 1) for x in real + paced)
    lines.append(f"simulated within 15% of measured for every schedule: {_yes(worst <= 0.15)} (worst {100 * worst:.0f}%)")
    for label, rows in (("real", real), ("paced", paced)):
        by = {r["schedule"]: r for r in rows}
        zb, ofb, ms = by["zb"], by["1f1b"], by["zb"]["mean_ms"]
        lines.append(f"zero bubble below 1F1B, {label}: median {_yes(zb['measured_bubble'] < ofb['measured_bubble'])}, "
                     f"best {_yes(zb['best_bubble'] < ofb['best_bubble'])} "
                     f"(zb mean F {ms['F']:.1f} ms, B {ms['B']:.1f} ms, W {ms['W']:.1f} ms)")
    return lines + [""]


def slowdown_when_sharing(device: torch.device) -> float:
    """How much slower a rank computes while every rank computes than alone (1.0: the ranks
    really run in parallel). Above 1, an idle rank speeds the others up, which no bubble
    theory assumes."""
    a = torch.randn(384, 384, device=device)

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(60):
            a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    timed()
    alone = 0.0
    for r in range(dist.get_world_size()):
        dist.barrier()
        if r == dist.get_rank():
            alone = timed()
        dist.barrier()
    together = timed()
    ratio = torch.tensor([together / alone])
    dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
    return float(ratio)
