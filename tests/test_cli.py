"""The command line end to end: train on 2 local processes, the run directory, generate,
and a rank that dies."""

import json
import time

import pytest

from helpers import make_tiny_corpus
from ndtrain.cli import main


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    corpus = make_tiny_corpus(root)
    run = root / "run"
    code = main(["train", "--nproc", "2", f"data.path={corpus}", "data.vocab_size=400",
                 f"data.cache_dir={root / 'cache'}", "model.preset=tiny", "train.steps=6",
                 "train.global_batch=4", "train.seq_len=32", "train.eval_every=3", "train.eval_batches=1",
                 f"run.dir={run}", "run.device=cpu"])
    assert code == 0
    return run


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
                 "run.device=cpu"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
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


def test_under_torchrun_ndtrain_is_one_rank(tmp_path):
    """torchrun starts the processes; ndtrain reads RANK/WORLD_SIZE and writes a full run dir."""
    import subprocess
    import sys

    from helpers import make_tiny_corpus
    corpus = make_tiny_corpus(tmp_path)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "-m", "ndtrain.cli", "train", "model.preset=tiny",
           "train.steps=2", "train.global_batch=4", "train.seq_len=32", "train.eval_batches=1",
           f"data.path={corpus}", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
           f"run.dir={run}", "run.device=cpu", "run.plot=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "validation loss" in out.stdout
    for name in ("config.toml", "tokenizer.json", "metrics.jsonl", "checkpoints/latest"):
        assert (run / name).is_file(), name
    assert "dp = 2" in (run / "config.toml").read_text()
