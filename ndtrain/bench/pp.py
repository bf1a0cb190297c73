"""`ndtrain bench pp`: our 1F1B against torch.distributed.pipelining's Schedule1F1B, and the
bubble of each of our schedules next to its theory.

Same model, same two-stage split and weights, same micro-batches, same ranks: one training
step's forward and backward through the pipeline each, alternated round by round. The
model's stages cost the same (the balanced split; a small vocabulary keeps the head light)
and each micro-batch carries enough work for the timings to mean something. Then each of
our schedules runs a few more steps with its timeline recorded, and the median measured
bubble (idle over busy time per rank) is printed next to the theory.
"""

from __future__ import annotations

import inspect

import torch

from ndtrain.bench.common import alternate, bench_config, report, synthetic_batch
from ndtrain.data.batch import MicroBatch
from ndtrain.launch import init_process, launch_local, shutdown
from ndtrain.mesh import ParallelMesh
from ndtrain.parallel.parallelize import build, decoder
from ndtrain.parallel.pipeline.stage import build_chunks
from ndtrain.parallel.pipeline.timeline import gather
from ndtrain.model.loss import token_loss_sum
from ndtrain.train.worker import mesh_shape

BENCH_DEFAULTS = ["model.preset=small", "model.n_layers=8", "model.dim=256", "model.ffn_dim=768",
                  "model.vocab_size=512", "train.seq_len=128", "train.global_batch=16", "train.micro_batch=2",
                  "parallel.pp=2", "parallel.pp_schedule=1f1b", "run.progress=false"]
SCHEDULES = (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1))
BUBBLE_STEPS = 5  # timed steps per schedule for the bubble; the median one is reported
PACE_S = 0.05  # seconds per block per F, B and W in the paced measurement (large against the ~2 ms
# of real work and hook overhead per block, and against this host's sleep jitter)


def _torch_1f1b(cfg, args, mesh, x, y, n_targets: float, m: int):
    """The anchor: PipelineStage + Schedule1F1B over copies of our chunks (same weights)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    (c, chunk), = build_chunks(args, mesh, cfg, decoder(args, mesh, cfg)).items()
    stage = PipelineStage(chunk, c, mesh.shape.pp, mesh.device, group=mesh.group("pp").pg)
    kwargs = {"scale_grads": False} if "scale_grads" in inspect.signature(Schedule1F1B).parameters else {}
    schedule = Schedule1F1B(stage, m, loss_fn=lambda out, t: token_loss_sum(out, t) / n_targets, **kwargs)

    def step():
        schedule.step(*((x,) if mesh.is_first_stage else ()), **({"target": y} if mesh.is_last_stage else {}))
        chunk.zero_grad(set_to_none=False)
    return step


def _bubbles(cfg, args, mesh, micro, n_targets: float, steps: int, out: str,
             paced_s: float = 0.0) -> list[dict] | None:
    """Each schedule's median measured bubble over `steps` steps (after one warm-up step);
    with `out`, the timeline of that median step drawn to out/pp-<schedule>.png
    (pp-paced-<schedule>.png when every block is paced to `paced_s` per F, B and W)."""
    from pathlib import Path

    from ndtrain.bench.pacing import pace
    from ndtrain.observe.trace import bubble_report, draw

    rows = []
    for name, v in SCHEDULES:
        c = cfg.copy()
        c.parallel.pp_schedule, c.parallel.pp_virtual = name, v
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


def _bubble_table(title: str, bubbles: list[dict]) -> list[str]:
    lines = [title, f"{'schedule':<16}{'median':>8}{'best':>8}{'replay':>8}{'theory':>8}  formula", "-" * 80]
    by_name = {}
    for r in bubbles:
        name = r["schedule"] + (f" v={r['virtual']}" if r["virtual"] > 1 else "")
        by_name[r["schedule"]] = r
        within = abs(r["measured_bubble"] - r["theory_bubble"]) <= 0.25 * r["theory_bubble"]
        lines.append(f"{name:<16}{r['measured_bubble']:>8.3f}{r['best_bubble']:>8.3f}{r['replayed_bubble']:>8.3f}"
                     f"{r['theory_bubble']:>8.3f}"
                     f"  {r['theory']:<24}" + ("" if r["schedule"] == "zb" else f" median within 25%: {'yes' if within else 'no'}"))
    zb, ofb = by_name["zb"], by_name["1f1b"]
    ms = zb["mean_ms"]
    lines.append(f"zero bubble below 1F1B: median {'yes' if zb['measured_bubble'] < ofb['measured_bubble'] else 'no'}, "
                 f"best {'yes' if zb['best_bubble'] < ofb['best_bubble'] else 'no'} "
                 f"(zb mean F {ms['F']:.1f} ms, B {ms['B']:.1f} ms, W {ms['W']:.1f} ms)")
    return lines + [""]


def _slowdown_when_sharing(device: torch.device) -> float:
    """How much slower a rank computes while every rank computes than alone (1.0: the ranks
    really run in parallel). Above 1, an idle rank speeds the others up, which no bubble
    theory assumes."""
    import time

    import torch.distributed as dist

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


def _worker(cfg_dict: dict, rounds: int, steps: int, out: str) -> str:
    from ndtrain.config import from_dict
    cfg = from_dict(cfg_dict)
    env = init_process(cfg.run.device, cfg.run.threads)
    try:
        mesh = ParallelMesh.build(mesh_shape(cfg), env.device)
        args = cfg.model_args()
        t = cfg.train
        x, y = synthetic_batch(args, t.global_batch, t.seq_len, 0, env.device)  # the same rows on every stage
        m = t.global_batch // t.micro_batch
        micro = MicroBatch(x, y).split(t.micro_batch)
        n_targets = float(t.global_batch * t.seq_len)

        slowdown = _slowdown_when_sharing(env.device)
        ours = build(args, mesh, cfg)

        def step_ours():
            ours.forward_backward(micro, n_targets)
            ours.grad_sync.zero_grad()

        step_torch = _torch_1f1b(cfg, args, mesh, x, y, n_targets, m)
        times = alternate({"ndtrain-1f1b": step_ours, "torch-Schedule1F1B": step_torch}, rounds, steps, env.device)
        bubbles = _bubbles(cfg, args, mesh, micro, n_targets, BUBBLE_STEPS, out)
        # Paced: a small model whose blocks each sleep PACE_S per F, B and W, so the ranks'
        # "compute" cannot slow each other down (see bench/pacing.py).
        paced_args = args.with_(dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2)
        paced_micro = [MicroBatch(mb.tokens[:, :32], mb.targets[:, :32]) for mb in micro]
        paced = _bubbles(cfg, paced_args, mesh, paced_micro, n_targets, BUBBLE_STEPS, out, PACE_S)
        if mesh.rank != 0:
            return ""
        lines = [f"machine: a rank computes {slowdown:.2f}x slower while the other ranks compute than alone "
                 f"(1.00 = truly parallel; above, idle ranks speed the others up and bubbles read high)",
                 f"bubble = idle / busy time per rank over the step, median (best) of {BUBBLE_STEPS} steps; "
                 "replay = the median step's own action durations with free messages (the executor's cost is median − replay)"]
        lines += _bubble_table("real compute (this machine's cores)", bubbles)
        lines += _bubble_table(f"paced compute: every block sleeps {PACE_S * 1e3:.0f} ms in F, B and W "
                               "(the executor, messages and B/W split are real)", paced)
        tokens = t.global_batch * t.seq_len
        lines.append(report(times, tokens, "tok/s", "ndtrain/torch-pipelining", numerator="ndtrain-1f1b",
                            denominator="torch-Schedule1F1B"))
        return "\n".join(lines)
    finally:
        shutdown()


def run(args) -> int:
    cfg = bench_config(args, BENCH_DEFAULTS)
    a, t, p = cfg.model_args(), cfg.train, cfg.parallel
    print(f"bench pp: {p.pp} stages × dp {p.dp} · model dim={a.dim} layers={a.n_layers} vocab={a.vocab_size} · "
          f"{t.global_batch // t.micro_batch} micro-batches of {t.micro_batch}×{t.seq_len} · "
          f"{args.rounds} rounds × {args.steps} steps, alternating", flush=True)
    print(launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps, args.out or "")[0])
    return 0
