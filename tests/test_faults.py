"""Fault tolerance: a dead or hung rank stops the others and the run restarts from its last
good checkpoint, ending bit for bit where an uninterrupted run ends; a collective that does
not complete names itself; Ctrl-C saves at the step boundary, a second one quits at once; one
run per run directory."""

import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import TINY, make_tiny_corpus
from ndtrain.launch import RankFailure, launch_local
from ndtrain.testing import run_ranks

REPO = Path(__file__).parent.parent


# --------------------------------------------------------------------------- helpers

def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        frontier = [c for c, p in parents.items() if p in frontier]
        out += frontier
    return out


def wait_for(condition, timeout: float = 180.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


# --------------------------------------------------------------------------- dead, hung, slow

def _sigkill_rank_1():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # rank 0 waits on the dead peer: must not hang
    return "finished"


def _hang_rank_1():
    """Rank 1 goes silent (no heartbeat after its start); rank 0 waits for it to join the
    group, beating all along from a thread of its own (beating only once joined, a loaded
    machine could delay rank 0's first beat past heartbeat_s and blame the wrong rank)."""
    import torch.distributed as dist

    from ndtrain import supervisor
    if os.environ["RANK"] == "1":
        time.sleep(600)

    def beat():
        while True:
            supervisor.heartbeat()
            time.sleep(0.05)
    threading.Thread(target=beat, daemon=True).start()
    dist.init_process_group("gloo")


def test_a_killed_or_hung_rank_ends_the_group_named():
    with pytest.raises(RankFailure) as e:
        launch_local(2, _sigkill_rank_1)
    assert e.value.rank == 1 and e.value.summary == "killed by SIGKILL"
    with pytest.raises(RankFailure) as e:
        launch_local(2, _hang_rank_1, heartbeat_s=4.0)
    assert e.value.rank == 1 and e.value.summary.startswith("sent no heartbeat for 4 s")


def _stuck_collective(kind):
    import torch.distributed as dist

    from ndtrain.comm import ops
    from ndtrain.comm.ops import CollectiveError
    from ndtrain.launch import set_collective_timeout
    from ndtrain.mesh import MeshShape, ParallelMesh
    mesh = ParallelMesh.build(MeshShape(dp_shard=2, tp=2))
    set_collective_timeout(1.0)
    if mesh.rank == 1:  # never joins the collective
        time.sleep(4)
        return None
    if mesh.rank != 0:
        return None
    group = mesh.group("tp")
    try:
        if kind == "sync":
            ops.all_reduce(torch.ones(4), group)
        else:
            ops.reduce_scatter(torch.empty(2), torch.ones(4), group, async_op=True).wait()
    except CollectiveError as e:
        return str(e)
    return "completed"


@pytest.mark.parametrize("kind", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_a_collective_that_does_not_complete_names_the_op_group_and_rank(kind):
    message = run_ranks(_stuck_collective, 4, kind, timeout=120)[0]
    op = "all_reduce" if kind == "sync" else "reduce_scatter"
    assert message.startswith(f"{op} over group tp (ranks [0, 1]) did not complete within the collective timeout "
                              "(run.collective_timeout_s) on rank 0: "), message


def _ignores_stop(folder: str):
    import torch.distributed as dist

    from ndtrain import supervisor
    dist.init_process_group("gloo")
    Path(folder, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    while True:  # never reaches a step boundary
        supervisor.heartbeat()
        time.sleep(0.05)


def test_a_second_ctrl_c_kills_the_ranks_at_once(tmp_path):
    """The first SIGINT asks the ranks to stop at their next step boundary; these never get
    there, and the second SIGINT ends them, and the launch, at once."""
    def pids():
        return [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]

    def press_ctrl_c_twice():
        wait_for(lambda: len(pids()) == 2, what="both ranks")
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.7)
        os.kill(os.getpid(), signal.SIGINT)
    presser = threading.Thread(target=press_ctrl_c_twice, daemon=True)
    previous = signal.signal(signal.SIGINT, lambda *_: None)  # no stray SIGINT may reach pytest
    try:
        presser.start()
        with pytest.raises(KeyboardInterrupt):
            launch_local(2, _ignores_stop, str(tmp_path))
        presser.join(timeout=30)
    finally:
        signal.signal(signal.SIGINT, previous)
    wait_for(lambda: not [p for p in pids() if alive(p)], timeout=10, what="the ranks to be gone")


# --------------------------------------------------------------------------- random kills

STEPS = ["train.steps=10", "train.save_every=2", "train.micro_batch=2"]


def _kill_at(plan: dict, trainer):
    """Attempt a's rank r dies by SIGKILL at the start of step resumed + offset."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if attempt not in plan or trainer.mesh.rank != plan[attempt][0]:
        return
    from ndtrain.bench.ft import kill_at_step
    kill_at_step(trainer, trainer.step + plan[attempt][1])


def _config(extra):
    from ndtrain.config import load_config, validate
    return validate(load_config(None, TINY + STEPS + extra), world=2).to_dict()


def test_random_ranks_killed_at_random_steps_restart_and_end_bit_exact(tiny_data, tmp_path, capfd):
    from ndtrain.checkpoint import store
    from ndtrain.checkpoint.sources import CheckpointSource
    from ndtrain.observe.metrics import read_metrics
    from ndtrain.train.worker import train_worker

    rng = random.Random(12)
    kills = 2
    plan = {a: (rng.randrange(2), rng.randrange(1, 4)) for a in range(kills)}
    cfg = _config(["parallel.zero=1"])
    launch_local(2, train_worker, cfg, str(tmp_path / "straight"), tiny_data)
    launch_local(2, train_worker, cfg, str(tmp_path / "killed"), tiny_data, functools.partial(_kill_at, plan),
                 max_restarts=kills)
    err = capfd.readouterr().err
    for a, (rank, _) in plan.items():
        assert f"rank {rank} failed (killed by SIGKILL) at step " in err and f"(restart {a + 1} of {kills})" in err
    restarts = [json.loads(line) for line in (tmp_path / "killed" / "restarts.jsonl").read_text().splitlines()]
    assert [r["restart"] for r in restarts] == list(range(1, kills + 1))
    for r in restarts:
        assert r["steps_lost"] == r["reached_step"] - r["resumed_step"] >= 0 and r["time_lost_s"] > 0
    a = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    b = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(10)) and [r["loss"] for r in a] == [r["loss"] for r in b]
    straight = CheckpointSource(store.latest(tmp_path / "straight"))
    killed = CheckpointSource(store.latest(tmp_path / "killed"))
    assert straight.meta["step"] == killed.meta["step"] == 10 and straight.index.keys() == killed.index.keys()
    from ndtrain.checkpoint.slices import Piece
    for key, (shape, _) in straight.index.items():  # weights and moments, bit for bit
        x, y = torch.empty(torch.Size(shape).numel()), torch.empty(torch.Size(shape).numel())
        straight.fill(key, Piece.whole(shape), x)
        killed.fill(key, Piece.whole(shape), y)
        assert torch.equal(x, y), key


# --------------------------------------------------------------------------- the command line

def _cli(run: Path, corpus: Path, cache: Path, *extra: str) -> list[str]:
    return ["train", "--nproc", "2", "model.preset=tiny", "train.steps=100000", "train.global_batch=4",
            "train.seq_len=32", "train.eval_every=0", "train.eval_batches=1", f"data.path={corpus}",
            "data.vocab_size=300", f"data.cache_dir={cache}", f"run.dir={run}", "run.device=cpu", "run.plot=false",
            "run.progress=false", *extra]


@pytest.mark.slow  # the 5-minute budget: test_stop's SIGTERM to the group and the one-process Ctrl-C below stay
def test_ctrl_c_saves_at_the_step_boundary_and_one_run_holds_a_run_dir(tmp_path, capsys):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it): every rank
    finishes its step, a checkpoint of that step is written, the command exits 130 with no
    traceback and leaves no process behind; the same command then continues the run (on
    another layout). While it runs, a second run on its run.dir is refused, naming its pid."""
    from ndtrain.checkpoint import store
    from ndtrain.cli import main
    from ndtrain.observe.metrics import read_metrics

    corpus, run, cache = make_tiny_corpus(tmp_path), tmp_path / "run", tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "ndtrain.cli", *_cli(run, corpus, cache)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        metrics = run / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(read_metrics(metrics)) >= 3, what="three steps")
        capsys.readouterr()
        assert main(_cli(run, corpus, cache)) == 2
        assert f"is in use by another ndtrain run (pid {proc.pid})" in capsys.readouterr().err
        ranks = descendants(proc.pid)
        assert len(ranks) >= 2
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "stopped by SIGINT after step" in err, err[-2000:]
    done = read_metrics(run / "metrics.jsonl")[-1]["step"] + 1
    assert store.read_meta(store.latest(run))["step"] == done  # not a step lost
    wait_for(lambda: not [p for p in ranks if alive(p)], timeout=30, what="the ranks to be gone")
    # the same command continues it, here on another layout and for two more steps
    assert main(_cli(run, corpus, cache, f"train.steps={done + 2}", "parallel.tp=2")) == 0
    meta = store.read_meta(store.latest(run))
    assert meta["step"] == done + 2 and meta["mesh"]["tp"] == 2
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(done + 2))


def test_ctrl_c_in_a_single_process_run_saves_at_the_step_boundary(tiny_data, tmp_path, capsys):
    """One process runs in the command's own process (as each rank does under torchrun): it
    arms SIGINT itself; the first one stops the run after the step, with a checkpoint."""
    from helpers import TINY
    from ndtrain.checkpoint import store
    from ndtrain.cli import main
    from ndtrain.observe.metrics import read_metrics

    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"

    def press_ctrl_c():
        wait_for(lambda: metrics.exists() and len(read_metrics(metrics)) >= 2, what="two steps")
        os.kill(os.getpid(), signal.SIGINT)
    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    previous = signal.signal(signal.SIGINT, lambda *_: None)  # no stray SIGINT may reach pytest
    try:
        presser.start()
        code = main(["train", "--nproc", "1", *TINY, "train.steps=100000", f"data.path={tiny_data}",
                     f"run.dir={run}"])
        presser.join(timeout=30)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and "stopped by SIGINT after step" in capsys.readouterr().err
    assert store.read_meta(store.latest(run))["step"] == read_metrics(metrics)[-1]["step"] + 1
