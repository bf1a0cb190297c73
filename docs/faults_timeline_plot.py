"""docs/faults-timeline.png: the timeline of a failure under run.fault_tolerance = "replicas",
drawn from a real run: 2 replica groups of 1 rank (the small model, 40 steps, one step per
metrics line), the rank of group 1 killed (SIGKILL) at the start of step 20; each group's
steps from its metrics file (metrics.jsonl, metrics.replica1.jsonl: when each step ended and
how long it took), the kill and the rejoin marked.
PYTHONPATH=. python docs/faults_timeline_plot.py docs/faults-timeline.png"""

import functools
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

KILL_AT = 20


def kill(marks: str, trainer) -> None:
    if os.environ["NDTRAIN_REPLICA"] != "1" or os.environ["NDTRAIN_REPLICA_INCARNATION"] != "0":
        return
    run_step = trainer.train_step

    def train_step(step):
        if step == KILL_AT:
            Path(marks).write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return run_step(step)
    trainer.train_step = train_step


def main(out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ndtrain.config import load_config, validate
    from ndtrain.observe.metrics import read_metrics
    from ndtrain.replicas.launch import launch_replicas
    from ndtrain.train.worker import prepare, prepared_paths, train_worker

    root = Path(tempfile.mkdtemp(prefix="ndtrain-faults-"))
    cfg = validate(load_config(None, ["model.preset=small", "train.steps=40", "train.global_batch=8",
                                      "train.seq_len=128", "train.log_every=1", "train.eval_every=0",
                                      "train.eval_batches=1", "parallel.dp_replicate=2", "run.heartbeat_s=30",
                                      "run.fault_tolerance=replicas", "run.max_restarts=1", "run.progress=false",
                                      "run.plot=false", "run.device=cpu"]), world=2)
    data = prepared_paths(prepare(cfg, progress=False))
    marks = root / "killed_at"
    launch_replicas(2, 2, train_worker, (cfg.to_dict(), str(root / "run"), data, functools.partial(kill, str(marks))),
                    max_restarts=1, heartbeat_s=30)
    groups = [read_metrics(root / "run" / "metrics.jsonl"), read_metrics(root / "run" / "metrics.replica1.jsonl")]
    t0 = min(r["ended_at"] - r["step_time_s"] for r in groups[0])
    killed = float(marks.read_text()) - t0
    fig, ax = plt.subplots(figsize=(10, 2.8))
    for g, records in enumerate(groups):
        for r in records:
            both = len(r["replicas"]) == 2
            ax.barh(g, r["step_time_s"], left=r["ended_at"] - r["step_time_s"] - t0, height=0.5,
                    color="tab:blue" if both else "tab:orange", edgecolor="white", lw=0.3)
    back = next(r for r in groups[1] if r["step"] > KILL_AT)
    ax.axvline(killed, color="tab:red", lw=1)
    ax.text(killed, 1.45, f" group 1 killed (step {KILL_AT})", color="tab:red", fontsize=8, va="bottom")
    rejoin = back["ended_at"] - back["step_time_s"] - t0
    ax.axvline(rejoin, color="tab:green", lw=1)
    ax.text(rejoin, -0.75, f" group 1 rejoined at step {back['step']}, state from group 0", color="tab:green",
            fontsize=8, va="bottom")
    ax.set_yticks([0, 1], ["replica group 0", "replica group 1"])
    ax.set_ylim(-0.8, 1.8)
    ax.set_xlabel("seconds since the first step (blue: a step summed over both groups; orange: group 0 alone, "
                  "group 1's rows skipped)", fontsize=8)
    ax.set_title("run.fault_tolerance = \"replicas\": a lost replica group, the survivor never stops", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    lost = [r["step"] for r in groups[0] if len(r["replicas"]) == 1]
    print(f"group 0 stepped alone at steps {lost[0]}-{lost[-1]}; longest step of group 0 "
          f"{max(r['step_time_s'] for r in groups[0]):.2f} s; group 1 back at step {back['step']}")


if __name__ == "__main__":
    main(sys.argv[1])
