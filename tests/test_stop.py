"""Stopping without losing anything (issue 28): SIGTERM (as `timeout`, systemd, SLURM and
Kubernetes stop a job) on train, sft and rl, an RL rollout cut short by it; a full disk
during a checkpoint; a user's own folder refused as a run directory; the command that
continues a stopped run; strict JSON in every --json output and metrics.jsonl line."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import TINY, make_tiny_corpus
from test_faults import alive, descendants, wait_for

REPO = Path(__file__).parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}


def _ndtrain(*args: str) -> subprocess.Popen:
    """`ndtrain ARGS` in a process group of its own, as a job scheduler starts it."""
    return subprocess.Popen([sys.executable, "-m", "ndtrain.cli", *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _assert_stopped_by_sigterm(code: int, err: str, run: Path) -> int:
    """Exit 143, the truth in one line, no traceback; the checkpoint follows the last
    metrics line (no step lost). Returns the checkpoint's step."""
    from ndtrain.checkpoint import store
    from ndtrain.observe.metrics import read_metrics
    assert code == 143, err[-3000:]
    assert "Traceback" not in err and "without a report" not in err, err[-3000:]
    assert "stopped by SIGTERM after step" in err, err[-3000:]
    step = store.read_meta(store.latest(run))["step"]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(step))
    return step


# --------------------------------------------------------------------------- SIGTERM

def test_sigterm_to_the_group_stops_train_with_a_checkpoint_and_exit_143(tmp_path):
    """SIGTERM to the whole process group (the fork server included, which used to die of
    it, so that rank 0's clean stop read as "exited with code 255 without a report", exit 1):
    every rank saves, the command exits 143, says so, and leaves no process behind."""
    corpus, run = make_tiny_corpus(tmp_path), tmp_path / "run"
    proc = _ndtrain("train", "--nproc", "2", "model.preset=tiny", "train.steps=100000", "train.global_batch=4",
                    "train.seq_len=32", "train.eval_every=0", "train.eval_batches=1", "train.log_every=50",
                    f"data.path={corpus}", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
                    f"run.dir={run}", "run.device=cpu", "run.plot=false", "run.progress=false")
    wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text(), what="a step")
    ranks = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = _finish(proc)
    _assert_stopped_by_sigterm(proc.returncode, err, run)
    wait_for(lambda: not [p for p in ranks if alive(p)], timeout=30, what="every process to be gone")


def test_sigterm_stops_sft_in_the_commands_own_process(tiny_data, tmp_path, capsys):
    """One process, in the command's own (as under torchrun): it arms SIGTERM itself."""
    from ndtrain.cli import main
    from test_sft import make_records
    data, run = tmp_path / "chat.jsonl", tmp_path / "run"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_records()))

    def terminate():
        wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text(), what="a step")
        os.kill(os.getpid(), signal.SIGTERM)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # no stray SIGTERM may reach pytest
    try:
        threading.Thread(target=terminate, daemon=True).start()
        code = main(["sft", "--nproc", "1", f"data.path={data}", f"data.tokenizer={tiny_data}/tokenizer.json",
                     "model.init_from=scratch", "model.preset=tiny", "train.seq_len=64", "train.global_batch=4",
                     "train.steps=100000", "train.log_every=1", "train.eval_every=0", "run.device=cpu",
                     "run.progress=false", "run.plot=false", f"run.dir={run}"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    _assert_stopped_by_sigterm(code, capsys.readouterr().err, run)


def reward_then_sigterm(prompt: str, completion: str, answer: str) -> float:
    """rl.reward of the test below: rank 0, scoring its share of update 2's rollout, sends
    SIGTERM to the process group (as `scancel` would) and takes a second over it."""
    global _scored
    _scored = globals().get("_scored", 0) + 1
    if os.environ.get("RANK") == "0" and _scored == 2 * RL_SHARE + 1:
        os.killpg(os.getpgid(0), signal.SIGTERM)
        time.sleep(1.0)
    return float(len(completion))


RL_SHARE = 8  # rows each of the 2 ranks scores per update: 16 rows / 2


def test_sigterm_cuts_an_rl_rollout_short_and_saves_the_update_before_it(tmp_path):
    """train.log_every=100 puts the next agreement on stopping past the end (step 39): the
    stop comes from the next rollout instead, cut short at its first token on every rank;
    its update (3) is abandoned and updates 0-2 are saved, so a resume redraws it."""
    run = tmp_path / "run"
    proc = _ndtrain("rl", "--nproc", "2", "model.init_from=scratch", "model.preset=tiny", "run.device=cpu",
                    f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={run}", "rl.reward=test_stop:reward_then_sigterm",
                    "rl.eval_prompts=0", "train.steps=40", "train.log_every=100", "train.eval_every=0",
                    "train.global_batch=16", "rl.group_size=4", "run.progress=false", "run.plot=false")
    out, err = _finish(proc)
    assert _assert_stopped_by_sigterm(proc.returncode, err, run) == 3
