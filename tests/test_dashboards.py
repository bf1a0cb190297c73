"""TensorBoard and W&B (run.tensorboard, run.wandb): the events read back equal metrics.jsonl,
a resumed run's events read like an uninterrupted run's, W&B offline writes its run folder,
and a dashboard whose package is missing is a config error naming the extra."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ckpt_helpers import copy_checkpoint, make_trainer
from ndtrain.observe.dashboards import scalars
from ndtrain.observe.metrics import read_metrics

ONE = ["run.nproc=1", "train.eval_every=2", "train.eval_batches=1"]


def _fit(overrides: list[str], data: str, run: Path) -> None:
    trainer = make_trainer(ONE + overrides, data, str(run))
    trainer.meter_steps = 1  # one step carries memory per rank: nested scalars
    trainer.start()
    trainer.fit()


def _events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _expected(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as TensorBoard holds it: every number at its step, as float32 (TensorBoard's
    scalar type: the one rounding allowed, so the comparison is exact equality after it)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for name, value in scalars(r).items():
            out.setdefault(name, []).append((r["step"], float(np.float32(value))))
    return out


def test_tensorboard_events_equal_metrics_jsonl_also_after_a_resume(tiny_data, tmp_path):
    """A run of 5 steps, then a run that crashed after step 4 and resumes from its step-3
    checkpoint: the resumed run's events (the stale steps 3 and 4 purged) equal its own
    metrics.jsonl, which equals the uninterrupted run's steps."""
    pytest.importorskip("tensorboard")
    straight = tmp_path / "straight"
    _fit(["run.tensorboard=true", "train.save_every=3", "train.steps=5"], tiny_data, straight)
    records = read_metrics(straight / "metrics.jsonl")
    events = _events(straight / "tensorboard")
    assert events == _expected(records)
    for name in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "comm_bytes", "memory/peak/0"):
        assert name in events, name
    assert [s for s, _ in events["val_loss"]] == [1, 3, 4]

    resumed = tmp_path / "resumed"  # step 3's checkpoint, and what the crashed run had logged
    copy_checkpoint(str(straight), 3, str(resumed))
    shutil.copy(straight / "metrics.jsonl", resumed / "metrics.jsonl")
    shutil.copytree(straight / "tensorboard", resumed / "tensorboard")
    _fit(["run.tensorboard=true", "train.save_every=3", "train.steps=5"], tiny_data, resumed)
    again = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in again] == list(range(5))
    assert [r["loss"] for r in again] == [r["loss"] for r in records]
    events = _events(resumed / "tensorboard")
    assert events == _expected(again)
    assert [s for s, _ in events["loss"]] == list(range(5))


def test_wandb_offline_writes_its_run_folder(tiny_data, tmp_path, monkeypatch):
    """run.wandb = offline: a W&B run folder under run.dir/wandb/ whose record file holds
    every scalar name of metrics.jsonl (its history records; W&B's reader is not public, the
    names are plain bytes in its protobuf records)."""
    pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    _fit(["run.wandb=offline", "run.wandb_name=tiny", "train.steps=2"], tiny_data, run)
    (folder,) = (run / "wandb").glob("offline-run-*")
    (log,) = folder.glob("run-*.wandb")
    raw = log.read_bytes()
    run_id = (run / "wandb" / "run_id").read_text().strip()
    assert log.name == f"run-{run_id}.wandb"
    names = set().union(*(scalars(r) for r in read_metrics(run / "metrics.jsonl")))
    assert {"loss", "val_loss", "lr", "grad_norm"} <= names
    assert all(name.encode() in raw for name in names), [n for n in names if n.encode() not in raw]
    assert b"tiny" in raw  # run.wandb_name


@pytest.mark.parametrize("key, value, extra", [("run.tensorboard", "true", "tensorboard"),
                                               ("run.wandb", "offline", "wandb")])
def test_a_missing_dashboard_package_is_a_config_error_naming_the_extra(key, value, extra, monkeypatch, tmp_path,
                                                                        capsys):
    import importlib.util

    from ndtrain.cli import main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == extra else real(name, *a))
    run = tmp_path / "run"
    assert main(["train", f"{key}={value}", f"run.dir={run}", "run.device=cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f'{key} = ' in err and f'pip install -e ".[{extra}]"' in err, err
    assert not run.exists()


def test_an_unknown_wandb_mode_is_refused(capsys):
    from ndtrain.cli import main
    assert main(["train", "run.wandb=cloud", "run.device=cpu"]) == 2
    assert "run.wandb = 'cloud': choose \"\" (off), offline or online" in capsys.readouterr().err


def test_scalar_names_are_metrics_text_keys_nested_with_a_slash():
    """A mixture's record (issue 23's source_tokens and val_loss.<name>), per-group comm bytes
    and memory per rank: each number under its metrics.jsonl name; nulls and flags left out."""
    record = {"step": 7, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 900.0, "mfu": None,
              "skipped": False, "val_loss": 2.75, "val_loss.web": 2.5, "source_tokens": {"web": 70, "code": 30},
              "comm": {"dp_cp.all_reduce": 4096}, "memory": {"peak": [10, 12]}}
    assert scalars(record) == {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 900.0, "val_loss": 2.75,
                               "val_loss.web": 2.5, "source_tokens/web": 70.0, "source_tokens/code": 30.0,
                               "comm/dp_cp.all_reduce": 4096.0, "memory/peak/0": 10.0, "memory/peak/1": 12.0}
