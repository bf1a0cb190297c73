"""`ndtrain trace`: train a few steps of a pipelined layout, then draw the last step's
schedule (observe/trace.py) and report its bubble next to the theory."""

from __future__ import annotations

import json
from pathlib import Path

from ndtrain import config as config_mod
from ndtrain.data.prepare import PreparedData
from ndtrain.launch import init_process, shutdown
from ndtrain.mesh import ParallelMesh
from ndtrain.observe.trace import bubble_report, chrome_trace, draw
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


def trace_run(cfg, mesh, data, out: Path) -> dict:
    """`trace_worker` on an existing process group and mesh. Collective."""
    trainer = Trainer(cfg, mesh, data, None)
    schedule = trainer.par.schedule
    schedule.timeline.sync = mesh.device.type == "cuda"
    trainer.fit()
    ranks = gather(schedule.timeline.events)
    if mesh.rank != 0:
        return {}
    p, t = cfg.parallel, cfg.train
    m = t.accumulation(p.dp)
    labels = [f"rank {r}  " + " ".join(f"{d}{c}" for d, c in mesh.shape.coords(r).items() if getattr(mesh.shape, d) > 1)
              for r in range(mesh.world)]
    report = bubble_report(ranks, p.pp_schedule, p.pp, p.pp_virtual, m, mesh.group("pp").ranks)
    out.mkdir(parents=True, exist_ok=True)
    title = (f"{p.pp_schedule} · {mesh.describe()}" + (f" · v={p.pp_virtual}" if p.pp_virtual > 1 else "")
             + f" · {m} micro-batches · bubble {report['measured_bubble']:.3f} measured, "
             f"{report['replayed_bubble']:.3f} replayed, {report['theory_bubble']:.3f} theory {report['theory']}")
    report["trace"] = str(chrome_trace(ranks, out / "trace.json", labels))
    report["timeline"] = str(draw(ranks, out / "timeline.png", title, labels, p.pp))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report
