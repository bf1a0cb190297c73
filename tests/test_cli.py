"""The command line end to end: train on 2 local processes, the run directory, generate,
and a rank that dies."""

import importlib.util
import json
import time

import pytest

from helpers import make_tiny_corpus, unwritable_dir
from ndtrain.cli import main


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    corpus = make_tiny_corpus(root)
    run = root / "run"
    code = main(["train", "--nproc", "2", f"data.path={corpus}", "data.vocab_size=400",
                 f"data.cache_dir={root / 'cache'}", "model.preset=tiny", "train.steps=6",
                 "train.global_batch=4", "train.seq_len=32", "train.eval_every=3", "train.eval_batches=1",
                 f"run.dir={run}", "run.device=cpu"] + DASHBOARD)
    assert code == 0
    return run


# TensorBoard events from the 2-process run when the package is there (the test extra has it).
DASHBOARD = ["run.tensorboard=true"] if importlib.util.find_spec("tensorboard") else []


@pytest.mark.skipif(not DASHBOARD, reason="tensorboard is not installed")
def test_only_rank_0_writes_tensorboard_events(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (events,) = (trained_run / "tensorboard").iterdir()  # one file: rank 1 writes none
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(6))


def test_train_writes_the_run_directory(trained_run, capsys):
    run = trained_run
    for name in ("config.toml", "metrics.jsonl", "loss.png", "summary.json", "tokenizer.json"):
        assert (run / name).is_file(), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6))
    # memory per rank is gathered on log steps only (train.log_every = 10, and the last step)
    assert [r["step"] for r in records if "memory" in r] == [0, 5]
    for r in records:
        assert {"step", "loss", "tokens_per_s", "mfu", "comm_bytes"} <= r.keys()
        assert r["comm"]["dp_cp.all_reduce"] > 0
        if "memory" not in r:
            continue
        memory = r["memory"]  # bytes per rank
        assert set(memory) == {"params", "grads", "optimizer", "activations", "peak"}
        assert all(len(v) == 2 and min(v) > 0 for v in memory.values())
        assert memory["optimizer"][0] == pytest.approx(2 * memory["params"][0], rel=1e-3)  # Adam: m and v
    assert [r["step"] for r in records if "val_loss" in r] == [2, 5]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000006"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["layout"] == "dp=2" and summary["val_loss"] > 0


def test_generate_samples_from_the_run(trained_run, capsys):
    assert main(["generate", "--run", str(trained_run), "--prompt", "def ", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out) > len("def ")


def test_resume_false_refuses_existing_run(trained_run, capsys):
    assert main(["train", f"run.dir={trained_run}", "run.resume=false", "model.preset=tiny"]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def test_dry_run_prints_memory_per_rank_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--dry-run", "--nproc", "1", "model.preset=tiny", "train.precision=bf16",
                 "train.recompute=full", "train.seq_len=32", "train.global_batch=2", "data.vocab_size=512",
                 "run.device=cpu", "parallel.reshard_after_forward=false"])
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert code == 0
    # a key that does nothing in this layout (no ZeRO-3) is named, once, and the run goes on
    assert captured.err == ("ndtrain: warning: parallel.reshard_after_forward = False has no effect here: "
                            "only ZeRO-3 (parallel.zero=3) frees gathered parameters\n")
    assert out[0].startswith("dry run: tiny model, single process, zero=0, bf16, recompute=full")
    assert out[1].split()[:4] == ["rank", "parameters", "params", "grads"]
    row = out[2].split()  # rank, parameters, then "value unit" cells
    assert row[0] == "0" and row[1] == "213,568"  # the tiny model's parameters
    assert row[8:10] == row[10:12]  # measured model states == the formula, 16 bytes per parameter
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_generate_bad_input(tmp_path, capsys):
    assert main(["generate", "--run", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "--run" in capsys.readouterr().err


def _dies_on_rank_1():
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("injected fault")
    dist.all_reduce(torch.ones(1))  # rank 0 waits on the dead peer: must not hang
    dist.barrier()


def test_dead_rank_is_named_and_nothing_hangs():
    from ndtrain.launch import RankFailure, launch_local
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        launch_local(2, _dies_on_rank_1)
    assert e.value.rank == 1
    assert "ValueError: injected fault" in e.value.summary
    assert time.monotonic() - t0 < 120


@pytest.mark.slow  # heavy and not a layout proof: the slow tier (issue 19 suite budget)
def test_under_torchrun_ndtrain_is_one_rank_and_resumes_after_an_elastic_restart(tmp_path):
    """torchrun starts the processes; ndtrain reads RANK/WORLD_SIZE and writes a full run dir.
    A worker killed after the first checkpoint makes torchrun restart the group
    (--max-restarts 1); the new ranks resume by themselves, log what the restart cost, and the
    run ends complete."""
    import os
    import random
    import signal
    import subprocess
    import sys

    from helpers import make_tiny_corpus
    from ndtrain.observe.metrics import read_metrics
    from test_faults import descendants, wait_for
    corpus = make_tiny_corpus(tmp_path)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "ndtrain.cli", "train",
           "model.preset=tiny", "train.steps=60", "train.save_every=3", "train.global_batch=4", "train.seq_len=32",
           "train.eval_batches=1", f"data.path={corpus}", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
           f"run.dir={run}", "run.device=cpu", "run.plot=false", "run.progress=false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (run / "checkpoints" / "step_0000003").is_dir(), what="the first checkpoint")
        workers = [p for p in descendants(proc.pid) if b"ndtrain.cli" in open(f"/proc/{p}/cmdline", "rb").read()]
        os.kill(random.Random(0).choice(workers), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "validation loss" in out and "restart 1: resumed step " in err, err[-3000:]
    for name in ("config.toml", "tokenizer.json", "metrics.jsonl", "checkpoints/latest"):
        assert (run / name).is_file(), name
    assert "dp = 2" in (run / "config.toml").read_text()
    restart = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert len(restart) == 1 and restart[0]["restart"] == 1 and restart[0]["resumed_step"] >= 3
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(60))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000060"


# --------------------------------------------------------------------------- bad input (issue 9)

def _refused(argv, tmp_path, capsys, monkeypatch, fragment):
    """`ndtrain argv` exits 2 with one line holding `fragment`, no traceback, nothing written."""
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("ndtrain: error: ") and "Traceback" not in err, err
    assert fragment in err, err
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "dp", "--nproc", "0"], "--nproc = 0: must be > 0"),
    (["bench", "zero", "--rounds", "0"], "--rounds = 0: must be > 0"),
    (["bench", "tp", "--rounds", "-3"], "--rounds = -3: must be > 0"),
    (["bench", "pp", "--steps", "0"], "--steps = 0: must be > 0"),
    (["trace", "--steps", "0", "parallel.pp=2"], "--steps = 0: must be > 0"),
    (["generate", "--run", "x", "--prompt", "def", "--temperature", "nan"], "--temperature = nan: must be a finite"),
    (["generate", "--run", "x", "--prompt", "def", "--temperature", "inf"], "--temperature = inf: must be a finite"),
    (["generate", "--run", "x", "--prompt", "def", "--top-k", "-5"], "--top-k = -5: must be >= 0"),
    (["train", "train.seed=-1"], "train.seed = -1"),
    (["train", "train.eps=-1"], "train.eps = -1.0"),
    (["train", "run.threads=100000"], "run.threads = 100000"),
    (["train", "model.max_seq_len=64", "train.seq_len=128"], "model.max_seq_len = 64"),
])
def test_bad_input_is_one_line_exit_2(argv, fragment, tmp_path, capsys, monkeypatch):
    _refused(argv + (["run.device=cpu"] if argv[0] in ("train", "trace") else []), tmp_path, capsys,
             monkeypatch, fragment)


def test_bad_files_and_output_dirs_are_one_line_exit_2(tmp_path, capsys, monkeypatch):
    garbage = tmp_path / "garbage.toml"
    garbage.write_bytes(bytes(range(256)) * 16)
    _refused(["train", "--config", str(garbage)], tmp_path, capsys, monkeypatch, "is not a UTF-8 text file")
    nan_file = tmp_path / "nan.toml"
    nan_file.write_text("[train]\nlr = nan\n")
    _refused(["train", "--config", str(nan_file)], tmp_path, capsys, monkeypatch, "train.lr = nan: expected a finite")
    for key in ("run.dir", "data.cache_dir"):
        _refused(["train", f"{key}={garbage}"], tmp_path, capsys, monkeypatch, "exists and is not a directory")
        _refused(["train", f"{key}={unwritable_dir(tmp_path) / 'x'}"], tmp_path, capsys, monkeypatch,
                 "cannot be written")
    out = unwritable_dir(tmp_path) / "out"
    _refused(["trace", "--out", str(out), "parallel.pp=2", "run.device=cpu"], tmp_path, capsys, monkeypatch,
             f"--out = '{out}': cannot be written")
    _refused(["bench", "pp", "--out", str(out)], tmp_path, capsys, monkeypatch, f"--out = '{out}': cannot be written")
    _refused(["bench", "pp", "--out", str(garbage)], tmp_path, capsys, monkeypatch, "exists and is not a directory")


def test_token_ids_outside_the_vocabulary_are_refused_before_launch(tiny_data, tmp_path, capsys, monkeypatch):
    """A shard whose ids the model cannot embed is named before any process starts (it used
    to be an IndexError on a rank, mid-run)."""
    import json
    import shutil

    import numpy as np

    from ndtrain.data.shards import read_shard, write_shard
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    meta = json.loads((data / "meta.json").read_text())
    shard = data / meta["val_shards"][0]
    tokens = np.array(read_shard(shard))
    tokens[len(tokens) // 2] = meta["vocab_size"]  # one id past the end
    write_shard(shard, tokens)
    _refused(["train", f"data.path={data}", "model.preset=tiny", "run.device=cpu", f"run.dir={tmp_path / 'run'}"],
             tmp_path, capsys, monkeypatch, f"shard {shard}: holds token id {meta['vocab_size']}, outside the vocabulary")


def test_a_flipped_byte_in_a_token_shard_is_refused_before_launch(tiny_data, tmp_path, capsys, monkeypatch):
    """A byte changed in place keeps the shard's size and its ids valid; its checksum names it."""
    import json
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shard = data / json.loads((data / "meta.json").read_text())["train_shards"][0]
    raw = bytearray(shard.read_bytes())
    raw[32 + 2 * 1000] ^= 0x01  # token 1000 is another valid id now
    shard.write_bytes(bytes(raw))
    _refused(["train", f"data.path={data}", "model.preset=tiny", "run.device=cpu", f"run.dir={tmp_path / 'run'}"],
             tmp_path, capsys, monkeypatch, f"shard {shard}: its tokens do not match the checksum in its header")


def test_more_cpu_processes_than_cores_is_one_warning(monkeypatch):
    import os

    from ndtrain.launch import oversubscribed
    cores = os.cpu_count()
    assert oversubscribed(cores, "cpu") is None
    line = oversubscribed(64 * cores, "cpu")
    assert line.startswith(f"{64 * cores} processes on {cores} CPU cores") and "\n" not in line


def test_run_threads_zero_takes_omp_num_threads_else_cores_per_local_rank(monkeypatch):
    import os

    from ndtrain.launch import default_threads
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads(2) == 3
    for unset in ("", "lots"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert default_threads(1) == max(1, os.cpu_count() or 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads(64 * (os.cpu_count() or 1)) == 1


def _train_with_own_clock(cfg_dict: dict, root: str, data_dir: str) -> list[str]:
    """Every rank enters train_worker with a run directory of its own, as ranks under torchrun
    whose clocks tick apart derive them; rank 0's must win."""
    import os
    from pathlib import Path

    import torch.distributed as dist

    from ndtrain.train.worker import train_worker
    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    train_worker(cfg_dict, str(Path(root) / f"train-clock-of-rank-{rank}"), data_dir)
    return sorted(p.name for p in Path(root).iterdir())


def test_ranks_agree_on_rank_0s_run_directory(tiny_data, tmp_path):
    from helpers import TINY

    from ndtrain.config import load_config, validate
    from ndtrain.testing import run_ranks
    cfg = validate(load_config(None, TINY + ["train.steps=1"]), world=2)
    listings = run_ranks(_train_with_own_clock, 2, cfg.to_dict(), str(tmp_path), tiny_data)
    assert listings == [["train-clock-of-rank-0"]] * 2
    assert (tmp_path / "train-clock-of-rank-0" / "checkpoints" / "latest").is_file()


def test_eval_batches_0_skips_evaluation(tiny_data, tmp_path):
    """No validation loss at all, rather than a validation loss of 0.0."""
    import json

    from helpers import train_in_rank
    _, _, trainer = train_in_rank(["train.steps=2", "train.eval_every=1", "train.eval_batches=0"], tiny_data,
                                  run_dir=str(tmp_path / "run"))
    assert all("val_loss" not in r for r in trainer.history)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["val_loss"] is None


def test_default_run_dir_in_an_unwritable_folder_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    folder = unwritable_dir(tmp_path)
    monkeypatch.chdir(folder)
    code = main(["train", "run.device=cpu", "model.preset=tiny"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("ndtrain: error: run.dir = 'runs/train-") and "cannot be written" in err


@pytest.mark.parametrize("mfu, noted", [(0.42, False), (1.25, True)])
def test_summary_flags_an_mfu_above_100_percent(mfu, noted, capsys):
    """A CPU peak measured while other work shared the cores makes MFU read above 100%: the
    summary says so and how to fix it, instead of printing the figure alone."""
    from ndtrain.cli import print_summary
    print_summary({"run_dir": "runs/x", "checkpoint": "runs/x/checkpoints/step_0000001", "tokens_per_s": 1000.0,
                   "mfu": mfu, "mfu_peak_source": "peak = CPU matmul rate measured by `ndtrain bench matmul`"})
    out = capsys.readouterr().out
    assert f"MFU {100 * mfu:.1f}%" in out
    assert ("rerun `ndtrain bench matmul` on an idle machine" in out) == noted


def _train_until_one_clock_runs_out(run_dir: str, data_dir: str) -> tuple[int, bool, list[str]]:
    """run.stop_after_s = 60 on 2 ranks; rank 1's clock jumps 100 s at each reading, so only
    rank 1 runs out of time, at the end of the first step: both must stop there, save, and
    not call it a stop by a signal."""
    import itertools

    import torch.distributed as dist

    from helpers import train_in_rank
    from ndtrain.train import trainer as trainer_mod
    if dist.get_rank() == 1:
        ticks = itertools.count()
        trainer_mod.time.monotonic = lambda: 100.0 * next(ticks)
    try:
        _, _, trainer = train_in_rank(["train.steps=6", "run.stop_after_s=60"], data_dir, run_dir=run_dir)
    finally:
        import time
        trainer_mod.time.monotonic = time.monotonic
    return trainer.step, trainer.stopped, sorted(p.name for p in (trainer.run_dir / "checkpoints").iterdir())


def test_stop_after_s_stops_every_rank_at_the_same_step_with_a_checkpoint(tiny_data, tmp_path):
    from ndtrain.testing import run_ranks
    results = run_ranks(_train_until_one_clock_runs_out, 2, str(tmp_path / "run"), tiny_data)
    assert results[0] == results[1] and results[0][:2] == (1, False), results
    assert "step_0000001" in results[0][2]


def test_stop_after_s_must_be_a_nonnegative_number(tmp_path, capsys, monkeypatch):
    _refused(["train", "run.stop_after_s=nan", "run.device=cpu"], tmp_path, capsys, monkeypatch,
             "run.stop_after_s = 'nan': expected a number")
    _refused(["train", "run.stop_after_s=-1", "run.device=cpu"], tmp_path, capsys, monkeypatch,
             "run.stop_after_s = -1.0: must be >= 0")


@pytest.mark.slow  # heavy and not a layout proof: the slow tier (issue 19 suite budget)
def test_resuming_with_model_init_from_warns_that_the_checkpoint_wins(trained_run, tmp_path, capsys):
    """A run started from another run's weights and stopped is resumed by the same command:
    its own checkpoint wins, and model.init_from is named as having no effect."""
    root = trained_run.parent
    command = ["train", "--nproc", "1", f"data.cache_dir={root / 'cache'}", "train.steps=2", "train.global_batch=4",
               "train.seq_len=32", "train.eval_every=0", "train.eval_batches=1", f"run.dir={tmp_path / 'run'}",
               "run.device=cpu", f"model.init_from=run:{trained_run}"]
    assert main(command + ["run.stop_after=1"]) == 0
    capsys.readouterr()
    code = main(command)
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"model.init_from = 'run:{trained_run}' has no effect here: run.dir holds a checkpoint" in err
