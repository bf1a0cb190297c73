"""`ndtrain trace`: train a few steps, then draw the last one: a pipelined layout's schedule
(observe/trace.py) with its bubble next to the theory, and with context parallelism every
rank's ring steps and messages (observe/ring_trace.py) with the share of message time
hidden behind attention compute."""

from __future__ import annotations

import gc
import json
from pathlib import Path

from ndtrain import config as config_mod
from ndtrain.launch import init_process, shutdown
from ndtrain.mesh import ParallelMesh
from ndtrain.observe.ring_trace import draw_ring
from ndtrain.observe.trace import bubble_report, chrome_trace, draw
from ndtrain.parallel import context
from ndtrain.parallel.context.recorder import COMPUTE, RingTimeline, overlap
from ndtrain.parallel.pipeline.timeline import gather
from ndtrain.train.tasks import Pretrain
from ndtrain.train.trainer import Trainer
from ndtrain.train.worker import mesh_shape, open_prepared


def trace_worker(cfg_dict: dict, out_dir: str, data_dir: str | list[str]) -> dict:
    """One rank: train `train.steps` steps (no checkpoint), then gather the last step's
    timelines on rank 0, which draws them (`trace_run`). Returns the report on rank 0."""
    cfg = config_mod.from_dict(cfg_dict)
    env = init_process(cfg.run.device, cfg.run.threads)
    try:
        mesh = ParallelMesh.build(mesh_shape(cfg), env.device)
        return trace_run(cfg, mesh, open_prepared(cfg, data_dir), Path(out_dir))
    finally:
        shutdown()


def _labels(mesh) -> list[str]:
    return [f"rank {r}  " + " ".join(f"{d}{c}" for d, c in mesh.shape.coords(r).items() if getattr(mesh.shape, d) > 1)
            for r in range(mesh.world)]


def trace_run(cfg, mesh, data, out: Path) -> dict:
    """`trace_worker` on an existing process group and mesh: train all steps but the last,
    then run the last one watched: the pipeline schedule (pp > 1: trace.json, timeline.png)
    and the context-parallel attention (cp > 1: every ring step of every layer, forward and
    backward, and every message: ring-trace.json, ring.png). Collective; the report on rank 0
    (the ring's under "ring")."""
    trainer = Trainer(cfg, mesh, Pretrain(cfg, data), None)
    if cfg.train.steps > 1:
        trainer.fit(stop_after=cfg.train.steps - 1)
    pipelined, cuda = mesh.shape.pp > 1, mesh.device.type == "cuda"
    if pipelined:
        trainer.par.schedule.timeline.sync = cuda
    recorder = RingTimeline(mesh.device, sync=cuda) if mesh.shape.cp > 1 else None
    context.set_recorder(trainer.par.model, recorder)
    # A full collection of every object alive (torch's own included) takes tens of ms on a CPU
    # and would land in whichever traced action happens to allocate at that moment: freeze
    # what exists so the timeline shows the schedule, not Python's collector.
    gc.collect()
    gc.freeze()
    try:
        trainer.train_step(trainer.step)
    finally:
        gc.unfreeze()
    context.set_recorder(trainer.par.model, None)
    stages = gather(trainer.par.schedule.timeline.events) if pipelined else None
    rings = gather(recorder.events) if recorder is not None else None
    if mesh.rank != 0:
        return {}
    out.mkdir(parents=True, exist_ok=True)
    report = _pipeline_report(cfg, mesh, stages, out) if pipelined else {}
    if rings is not None:
        report["ring"] = _ring_report(cfg, mesh, rings, out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def _pipeline_report(cfg, mesh, ranks, out: Path) -> dict:
    p, t = cfg.parallel, cfg.train
    m = t.accumulation(p.dp)
    labels = _labels(mesh)
    report = bubble_report(ranks, p.pp_schedule, p.pp, p.pp_virtual, m, mesh.group("pp").ranks)
    title = (f"{p.pp_schedule} · {mesh.describe()}" + (f" · v={p.pp_virtual}" if p.pp_virtual > 1 else "")
             + f" · {m} micro-batches · bubble {report['measured_bubble']:.3f} measured, "
             f"{report['replayed_bubble']:.3f} replayed, {report['theory_bubble']:.3f} theory {report['theory']}")
    report["trace"] = str(chrome_trace(ranks, out / "trace.json", labels))
    report["timeline"] = str(draw(ranks, out / "timeline.png", title, labels, p.pp))
    return report


def _ring_report(cfg, mesh, ranks, out: Path) -> dict:
    p = cfg.parallel
    layers = len({e.chunk for e in ranks[0] if e.kind in COMPUTE})  # rank 0's (a pipeline stage's)
    totals = [overlap(events) for events in ranks]
    report = {"cp_impl": p.cp_impl, "cp": p.cp, "layers": layers,
              **{k: sum(t[k] for t in totals) / len(totals) for k in totals[0]}}
    labels = _labels(mesh)
    title = (f"cp_impl={p.cp_impl} · {mesh.describe()} · one step, {layers} layers per rank: messages "
             f"{1e3 * report['in_flight']:.1f} ms in flight, {1e3 * report['waited']:.1f} ms waited "
             f"({100 * report['hidden']:.0f}% hidden behind compute) per rank")
    report["trace"] = str(chrome_trace(ranks, out / "ring-trace.json", labels,
                                       name=lambda e: f"{e.kind} layer {e.chunk} step {e.micro}"))
    report["timeline"] = str(draw_ring(ranks, out / "ring.png", title, labels))
    return report
