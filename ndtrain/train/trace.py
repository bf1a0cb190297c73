"""`ndtrain trace`: train a few steps, then draw the last one: a pipelined layout's schedule
(observe/trace.py) with its bubble next to the theory, or, with context parallelism and no
pipeline, every rank's ring steps and messages (observe/ring_trace.py) with the share of
message time hidden behind attention compute."""

from __future__ import annotations

import json
from pathlib import Path

from ndtrain import config as config_mod
from ndtrain.data.prepare import PreparedData
from ndtrain.launch import init_process, shutdown
from ndtrain.mesh import ParallelMesh
from ndtrain.observe.ring_trace import draw_ring
from ndtrain.observe.trace import bubble_report, chrome_trace, draw
from ndtrain.parallel import context
from ndtrain.parallel.context.recorder import RingTimeline, overlap
from ndtrain.parallel.pipeline.timeline import gather
from ndtrain.train.trainer import Trainer
from ndtrain.train.worker import mesh_shape


def trace_worker(cfg_dict: dict, out_dir: str, data_dir: str) -> dict:
    """One rank: train `train.steps` steps (no checkpoint), then gather the last step's
    timeline on rank 0, which writes trace.json and timeline.png. Returns the report on rank 0."""
    cfg = config_mod.from_dict(cfg_dict)
    env = init_process(cfg.run.device, cfg.run.threads)
    try:
        mesh = ParallelMesh.build(mesh_shape(cfg), env.device)
        return trace_run(cfg, mesh, PreparedData.open(data_dir), Path(out_dir))
    finally:
        shutdown()


def _labels(mesh) -> list[str]:
    return [f"rank {r}  " + " ".join(f"{d}{c}" for d, c in mesh.shape.coords(r).items() if getattr(mesh.shape, d) > 1)
            for r in range(mesh.world)]


def trace_run(cfg, mesh, data, out: Path) -> dict:
    """`trace_worker` on an existing process group and mesh. Collective."""
    if mesh.shape.pp == 1:
        return ring_trace_run(cfg, mesh, data, out)
    trainer = Trainer(cfg, mesh, data, None)
    schedule = trainer.par.schedule
    schedule.timeline.sync = mesh.device.type == "cuda"
    trainer.fit()
    ranks = gather(schedule.timeline.events)
    if mesh.rank != 0:
        return {}
    p, t = cfg.parallel, cfg.train
    m = t.accumulation(p.dp)
    labels = _labels(mesh)
    report = bubble_report(ranks, p.pp_schedule, p.pp, p.pp_virtual, m, mesh.group("pp").ranks)
    out.mkdir(parents=True, exist_ok=True)
    title = (f"{p.pp_schedule} · {mesh.describe()}" + (f" · v={p.pp_virtual}" if p.pp_virtual > 1 else "")
             + f" · {m} micro-batches · bubble {report['measured_bubble']:.3f} measured, "
             f"{report['replayed_bubble']:.3f} replayed, {report['theory_bubble']:.3f} theory {report['theory']}")
    report["trace"] = str(chrome_trace(ranks, out / "trace.json", labels))
    report["timeline"] = str(draw(ranks, out / "timeline.png", title, labels, p.pp))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def ring_trace_run(cfg, mesh, data, out: Path) -> dict:
    """Context parallelism: train all steps but the last, then record the last one's
    attention (every ring step of every layer, forward and backward, and every message).
    Collective; the report on rank 0."""
    trainer = Trainer(cfg, mesh, data, None)
    if cfg.train.steps > 1:
        trainer.fit(stop_after=cfg.train.steps - 1)
    recorder = RingTimeline(mesh.device, sync=mesh.device.type == "cuda")
    context.set_recorder(trainer.par.model, recorder)
    trainer.train_step(trainer.step)
    context.set_recorder(trainer.par.model, None)
    ranks = gather(recorder.events)
    if mesh.rank != 0:
        return {}
    p = cfg.parallel
    totals = [overlap(events) for events in ranks]
    report = {"cp_impl": p.cp_impl, "cp": p.cp, "layers": trainer.args.n_layers,
              **{k: sum(t[k] for t in totals) / len(totals) for k in totals[0]}}
    out.mkdir(parents=True, exist_ok=True)
    labels = _labels(mesh)
    title = (f"cp_impl={p.cp_impl} · {mesh.describe()} · one step, {report['layers']} layers: messages "
             f"{1e3 * report['in_flight']:.1f} ms in flight, {1e3 * report['waited']:.1f} ms waited "
             f"({100 * report['hidden']:.0f}% hidden behind compute) per rank")
    report["trace"] = str(chrome_trace(ranks, out / "trace.json", labels,
                                       name=lambda e: f"{e.kind} layer {e.chunk} step {e.micro}"))
    report["timeline"] = str(draw_ring(ranks, out / "timeline.png", title, labels))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report
