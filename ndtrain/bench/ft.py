"""`ndtrain bench ft`: one replica lost mid-run, `run.fault_tolerance = "restart"` against
`"replicas"` (docs/faults.md).

Both sides train the same model for `train.steps` (default 40) steps on --nproc ranks split
into parallel.dp_replicate = 2 replica groups, with a checkpoint every 20 steps. At the start
of step 30 the first rank of replica group 1 is killed (SIGKILL):
- restart: the supervisor ends every rank and starts them all again from the checkpoint of
  step 20 (steps 20-29 are done again);
- replicas: group 0 goes on; group 1 restarts, receives the state from group 0, and rejoins
  at a step boundary.
After one warm-up round (not counted: the process's first launch is slower), each round
runs both, alternating (restart first), and then the same run without a kill
(`restart`'s launch): the time a run takes without a failure, which no side can beat, so
that the bench shows how far each side is from it (`replicas` cannot be better than it, and
the ratio cannot go below its median over restart's). A round's figure is the wall time of
the whole launch, start-up included. Both sides' processes come from one fork server
that has imported the trainer (supervisor.TRAINER_PRELOAD), started before the first
round (else the first side timed would pay for its imports): neither side's restart pays
for imports. Every step's metrics line is written at once
(train.log_every = 1), so the restart's count of steps done again is exact. Reported per side: the median wall time, the steps lost
(restart: the steps done again, restarts.jsonl; replicas: the steps group 0 did not record,
0 when it never stopped), and for replicas the step at which group 1 was back and the
longest step of group 0. Then the floor (the run without a kill over restart's, with each
side's seconds over it), and last the replicas/restart wall-time ratio (below 1: replicas
finish sooner).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from ndtrain.bench.common import Bench, announce, bench_config, describe

KILL_AT = 30
LABEL = {"restart": "restart", "replicas": "replicas", "none": "no kill"}
BENCH = Bench("ft", (), ("train.steps=40", "train.save_every=20", "train.eval_every=0", "train.eval_batches=1",
                         "train.log_every=1", "parallel.dp_replicate=2", "run.progress=false", "run.plot=false", "run.heartbeat_s=60"),
              ("model.", "train.", "data.", "parallel.dp_replicate", "parallel.tp", "parallel.zero", "run.device",
               "run.threads", "run.heartbeat_s"))


def _kill(at: int, trainer) -> None:
    """before_fit: the first rank of replica group 1 dies at the start of step `at`, in the
    first attempt (restart) or the first incarnation (replicas)."""
    env = os.environ
    if "NDTRAIN_REPLICA" in env:
        hit = env["NDTRAIN_REPLICA"] == "1" and env["NDTRAIN_REPLICA_INCARNATION"] == "0" and trainer.mesh.rank == 0
    else:
        hit = env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and trainer.mesh.rank == trainer.mesh.world // 2
    if hit:
        kill_at_step(trainer, at)


def kill_at_step(trainer, at: int) -> None:
    """This process dies by SIGKILL at the start of its trainer's step `at`."""
    run_step = trainer.train_step

    def train_step(step):
        if step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return run_step(step)
    trainer.train_step = train_step


def _one(kind: str, cfg, data: str, nproc: int, root: Path) -> dict:
    """One launch: `restart` or `replicas` with the kill, or `none` (restart's launch, no kill)."""
    from ndtrain.launch import launch_local
    from ndtrain.observe.metrics import read_metrics
    from ndtrain.replicas.launch import launch_replicas
    from ndtrain.supervisor import TRAINER_PRELOAD
    from ndtrain.train.worker import train_worker
    run = root / kind
    shutil.rmtree(run, ignore_errors=True)
    cfg.run.fault_tolerance = "replicas" if kind == "replicas" else "restart"
    args = (cfg.to_dict(), str(run), data, None if kind == "none" else functools.partial(_kill, KILL_AT))
    t0 = time.perf_counter()
    if kind == "replicas":
        launch_replicas(nproc, 2, train_worker, args, max_restarts=1, heartbeat_s=cfg.run.heartbeat_s)
    else:
        launch_local(nproc, train_worker, *args, max_restarts=1, heartbeat_s=cfg.run.heartbeat_s, preload=TRAINER_PRELOAD)
    out = {"wall": time.perf_counter() - t0}
    if kind == "none":
        return {**out, "lost": 0}
    if kind == "restart":
        restarts = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
        out["lost"] = sum(r["steps_lost"] for r in restarts)
        return out
    metrics = read_metrics(run / "metrics.jsonl")
    steps = [r["step"] for r in metrics]
    out["lost"] = cfg.train.steps - len(set(steps))
    out["back"] = next((r["step"] for r in metrics if r["step"] > KILL_AT and len(r.get("replicas", [])) == 2), None)
    out["longest"] = max(r["step_time_s"] for r in metrics)
    return out


def run(args) -> int:
    from ndtrain.train.worker import prepare, prepared_paths
    cfg = bench_config(args, BENCH)
    if cfg.train.steps <= KILL_AT:
        from ndtrain.config import ConfigError
        raise ConfigError("train.steps", cfg.train.steps, f"bench ft kills a replica at step {KILL_AT}: more steps")
    data = prepared_paths(prepare(cfg, progress=False))
    root = Path(tempfile.mkdtemp(prefix="ndtrain-bench-ft-"))
    from multiprocessing import forkserver

    from ndtrain.replicas.launch import fork_context
    fork_context()
    forkserver.ensure_running()  # its imports before the first round, not inside it (the first side's)
    announce(args, cfg, f"bench ft: {args.nproc} ranks in 2 replica groups · {describe(cfg)} · {cfg.train.steps} "
                        f"steps, replica group 1 killed at step {KILL_AT}, checkpoints every {cfg.train.save_every} "
                        f"· a warm-up round and {args.rounds} rounds, alternating, each with a run without a kill")
    results: dict[str, list[dict]] = {"restart": [], "replicas": [], "none": []}
    try:
        # a warm-up round first, not counted: the first launch in this process took ~2 s longer
        # (restart's, measured 12.0 s against 9.9 s after it), which counted against restart
        warm = {kind: _one(kind, cfg, data, args.nproc, root)["wall"] for kind in results}
        print("warm-up round (not counted): " + ", ".join(f"{LABEL[k]} {w:.1f} s" for k, w in warm.items()),
              flush=True)
        for i in range(args.rounds):
            for kind in results:
                r = _one(kind, cfg, data, args.nproc, root)
                results[kind].append(r)
                extra = (f", group 1 back at step {r['back']}, longest step of group 0 {r['longest']:.2f} s"
                         if kind == "replicas" else "")
                print(f"round {i + 1} {LABEL[kind]:>8}: {r['wall']:.1f} s, {r['lost']} steps lost{extra}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(r["wall"] for r in v) for k, v in results.items()}
    lost = {k: statistics.median(r["lost"] for r in v) for k, v in results.items()}
    for k in results:
        print(f"median {LABEL[k]:>8}: {med[k]:.1f} s, {lost[k]:g} steps lost", flush=True)
    print(f"floor {med['none'] / med['restart']:.2f} (no kill / restart); over a run without a kill: replicas "
          f"{med['replicas'] - med['none']:+.1f} s, restart {med['restart'] - med['none']:+.1f} s", flush=True)
    print(f"ndtrain ft replicas/restart wall-time ratio: {med['replicas'] / med['restart']:.2f}", flush=True)
    return 0
