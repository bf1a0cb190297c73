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

def main_until_sigterm(argv: list[str], started) -> int:
    """`ndtrain ARGV` in this process, sent SIGTERM (as a job scheduler sends it) once
    `started()` is true; returns its exit status. pytest's own SIGTERM handling is off
    meanwhile, so no stray signal reaches it."""
    from ndtrain.cli import main

    def terminate():
        wait_for(started, what="a step")
        os.kill(os.getpid(), signal.SIGTERM)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        threading.Thread(target=terminate, daemon=True).start()
        return main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_to_the_group_stops_train_with_a_checkpoint_and_exit_143(tmp_path):
    """SIGTERM to the whole process group (the fork server included, which used to die of
    it, so that rank 0's clean stop read as "exited with code 255 without a report", exit 1):
    every rank saves, the command exits 143, says so, and leaves no process behind."""
    corpus, run = make_tiny_corpus(tmp_path), tmp_path / "run"
    proc = _ndtrain("train", "--nproc", "2", "model.preset=tiny", "train.steps=100000", "train.global_batch=4",
                    "train.seq_len=32", "train.eval_every=0", "train.eval_batches=1", "train.log_every=5",
                    f"data.path={corpus}", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
                    f"run.dir={run}", "run.device=cpu", "run.plot=false", "run.progress=false")
    wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text(), what="a step")
    ranks = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = _finish(proc)
    _assert_stopped_by_sigterm(proc.returncode, err, run)
    wait_for(lambda: not [p for p in ranks if alive(p)], timeout=30, what="every process to be gone")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow  # train's SIGTERM test stays in the default tier
def test_sigterm_ends_a_benchmark_at_once_with_exit_143(tmp_path):
    """A benchmark has nothing to save: SIGTERM ends its ranks at once (it used to say a
    checkpoint would be saved at the next log step, and then run every round to the end)."""
    def ranks_run() -> bool:  # the fork server has started both ranks (it ignores SIGTERM only once ready)
        servers = [pid for pid in descendants(proc.pid) if b"forkserver" in _cmdline(pid)]
        return bool(servers) and len(descendants(servers[0])) >= 2

    proc = _ndtrain("bench", "dp", "--rounds", "100000", "--steps", "1", "model.preset=tiny", "train.seq_len=32",
                    "train.global_batch=4", "run.device=cpu")
    wait_for(ranks_run, what="the benchmark's ranks")
    ranks = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = _finish(proc)
    assert proc.returncode == 143, err[-3000:]
    assert "SIGTERM: stopping now (nothing to save)" in err and "stopped by SIGTERM" in err, err[-3000:]
    assert "Traceback" not in err and "checkpoint" not in err, err[-3000:]
    wait_for(lambda: not [p for p in ranks if alive(p)], timeout=30, what="every process to be gone")


def test_sigterm_stops_sft_in_the_commands_own_process_and_the_printed_command_continues_it(
        tiny_data, tmp_path, capsys, monkeypatch):
    """One process, in the command's own (as under torchrun): it arms SIGTERM itself. The
    run chose its folder (runs/sft-<time>), so the same bare command would start another
    one: the message prints the command with run.dir= (it used to say "the same command
    continues the run"), and that command (with run.stop_after=1 added to end the test)
    continues this run, in this folder, from the step saved."""
    import shlex

    from ndtrain.checkpoint import store
    from ndtrain.cli import main
    from ndtrain.observe.metrics import read_metrics
    from test_sft import make_records
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_records()))
    argv = ["sft", "--nproc", "1", f"data.path={data}", f"data.tokenizer={tiny_data}/tokenizer.json",
            "model.init_from=scratch", "model.preset=tiny", "train.seq_len=64", "train.global_batch=4",
            "train.steps=100000", "train.log_every=1", "train.eval_every=0", "run.device=cpu", "run.progress=false",
            "run.plot=false"]

    def metrics():
        return list(Path("runs").glob("sft-*/metrics.jsonl"))

    code = main_until_sigterm(argv, lambda: metrics() and metrics()[0].read_text())
    err = capsys.readouterr().err
    run = metrics()[0].parent
    step = _assert_stopped_by_sigterm(code, err, run)
    command = err.split("continue the run with: ")[1].splitlines()[0]
    assert shlex.split(command) == ["ndtrain", *argv, f"run.dir={run}"]
    assert main(shlex.split(command)[1:] + ["run.stop_after=1"]) == 0
    assert list(Path("runs").iterdir()) == [run]
    assert store.read_meta(store.latest(run))["step"] == step + 1
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(step + 1))


def reward_then_sigterm(prompt: str, completion: str, answer: str) -> float:
    """rl.reward of the test below: rank 0, scoring its share of update 2's rollout, sends
    SIGTERM to the process group (as `scancel` would)."""
    global _scored
    _scored = globals().get("_scored", 0) + 1
    if os.environ.get("RANK") == "0" and _scored == 2 * RL_SHARE + 1:
        os.killpg(os.getpgid(0), signal.SIGTERM)
    return float(len(completion))


RL_SHARE = 8  # rows each of the 2 ranks scores per update: 16 rows / 2


@pytest.mark.slow
def test_sigterm_cuts_an_rl_rollout_short_and_saves_the_update_before_it(tmp_path):
    """train.log_every=100 puts the next agreement on stopping past the end (step 39): the
    stop comes from a rollout cut short instead, on every rank together: rank 1's share of
    update 2 if it was still sampling when the signal came, else update 3's at its first
    token. That update is abandoned and the ones before it are saved, so a resume redraws
    it."""
    run = tmp_path / "run"
    proc = _ndtrain("rl", "--nproc", "2", "model.init_from=scratch", "model.preset=tiny", "run.device=cpu",
                    f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={run}", "rl.reward=test_stop:reward_then_sigterm",
                    "rl.eval_prompts=0", "train.steps=40", "train.log_every=100", "train.eval_every=0",
                    "train.global_batch=16", "rl.group_size=4", "run.progress=false", "run.plot=false")
    out, err = _finish(proc)
    assert _assert_stopped_by_sigterm(proc.returncode, err, run) in (2, 3)


# --------------------------------------------------------------------------- a full disk

def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_previous_one(tiny_data, tmp_path, capsys,
                                                                                  monkeypatch):
    """The second checkpoint's write fails with ENOSPC (a patched writer): one line naming
    the file, the bytes this rank needs and the bytes free, exit 1 (it used to be a 32-line
    traceback); the partial file is gone and `latest` still names the first checkpoint,
    which passes every check."""
    import errno

    from ndtrain.checkpoint import store
    from ndtrain.cli import main
    real = store.write_safetensors

    def disk_fills_at_step_4(path, entries, metadata=None):
        if "step_0000004" in str(path):
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, entries, metadata)
    monkeypatch.setattr(store, "write_safetensors", disk_fills_at_step_4)
    run = tmp_path / "run"
    code = main(["train", "--nproc", "1", *TINY, "train.steps=4", "train.save_every=2", f"data.path={tiny_data}",
                 f"run.dir={run}"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    part = run / "checkpoints" / "step_0000004.tmp" / "rank-00000.safetensors"
    assert f"no space left on the device writing {part}: this rank's share of the checkpoint needs " in err
    assert " bytes; when the write failed " in err and " were free; the previous checkpoints are kept" in err and "Traceback" not in err
    assert not part.exists()
    assert store.latest(run).name == "step_0000002" and store.problem(store.latest(run)) is None


def test_a_full_disk_writing_the_metrics_is_one_line_naming_the_file_and_the_last_checkpoint(
        tiny_data, tmp_path, capsys, monkeypatch):
    """metrics.jsonl's write fails with ENOSPC at step 3 (a patched log): one line naming the
    file and the newest checkpoint (exit 1, no traceback), and that checkpoint passes every
    check, so running the command again continues from it."""
    import errno

    from ndtrain.checkpoint import store
    from ndtrain.cli import main
    from ndtrain.observe import metrics
    real = metrics.MetricsLog.write

    def disk_fills_at_step_3(self, record):
        if record["step"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, record)
    monkeypatch.setattr(metrics.MetricsLog, "write", disk_fills_at_step_3)
    run = tmp_path / "run"
    code = main(["train", "--nproc", "1", *TINY, "train.steps=4", "train.save_every=2", f"data.path={tiny_data}",
                 f"run.dir={run}"])
    err = capsys.readouterr().err.strip()
    last = store.latest(run)
    assert code == 1 and err == (f"ndtrain: error: step 3: writing {run / 'metrics.jsonl'} failed (No space left on "
                                 f"device); last good checkpoint: {last}; free space and run the command again to "
                                 "continue"), err
    assert store.problem(last) is None and last.name == "step_0000002"  # step 3's line would be lost after step 4


# --------------------------------------------------------------------------- a user's folder

@pytest.mark.parametrize("command", ["train", "sft", "rl", "convert"])
def test_a_folder_that_is_not_an_ndtrain_run_is_refused_untouched(command, tmp_path, capsys, monkeypatch):
    """A user's folder holding their own config.toml: one line, exit 2, nothing written
    (train used to overwrite the config.toml and write checkpoints beside it)."""
    from ndtrain.cli import main
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.toml").write_text("# my own notes\n")
    common = ["model.preset=tiny", "run.device=cpu", f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={mine}"]
    argv = {"train": ["train", *common], "sft": ["sft", "model.init_from=scratch", *common],
            "rl": ["rl", "model.init_from=scratch", *common],
            "convert": ["convert", "--from-hf", str(tmp_path), "--to", str(mine)]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    key = "--to" if command == "convert" else "run.dir"
    assert err == (f"ndtrain: error: {key} = {str(mine)!r}: is a folder that is neither empty nor an ndtrain run "
                   "(it holds config.toml); choose a new or empty folder"), err
    assert [p.name for p in mine.iterdir()] == ["config.toml"]
    assert (mine / "config.toml").read_text() == "# my own notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


# --------------------------------------------------------------------------- strict JSON

def _strict(text: str):
    """json.loads that refuses NaN and Infinity, as strict parsers do."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_plan_json_is_strict_and_a_non_finite_token_count_is_refused(capsys):
    from ndtrain.cli import main
    assert main(["plan", "--cluster", "H100-SXM", "--tokens", "1e400", "--json"]) == 2  # it printed "days": Infinity
    err = capsys.readouterr().err.strip()
    assert err == "ndtrain: error: --tokens = '1e400': expected a positive, finite number of tokens, e.g. 2e12, 300B " \
                  "or 15T", err
    assert main(["plan", "--cluster", "H100-SXM", "--tokens", "1e300", "--json"]) == 0
    assert _strict(capsys.readouterr().out)["days"] > 0


def test_a_nan_loss_is_a_null_named_in_nonfinite_and_the_run_stops_in_one_line(tiny_data, tmp_path, capsys):
    """A diverging run (a huge learning rate, no clipping): every metrics line is strict JSON,
    the diverged step's line holds "loss": null and names it in "nonfinite", and the run
    stops with one line, exit 1 (in the command's own process it used to be a traceback)."""
    from ndtrain.cli import main
    run = tmp_path / "run"
    code = main(["train", "--nproc", "1", *TINY, "train.steps=30", "train.log_every=1", "train.lr=1e6",
                 "train.grad_clip=0", "train.warmup=0", f"data.path={tiny_data}", f"run.dir={run}"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "loss is nan; stopping" in err, err
    lines = [_strict(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["loss"] is None and "loss" in lines[-1]["nonfinite"]
    assert all(isinstance(r["loss"], float) and "loss" not in r.get("nonfinite", []) for r in lines[:-1])
    assert f"step {lines[-1]['step']}: loss is nan" in err
