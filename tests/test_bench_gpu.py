"""`ndtrain bench gpu`: its steps fit 8 minutes (with fp8 too, once it exists), a missing GPU is
one line and exit 2, and a step that crashes or hangs is a row of the table, not the end of
the run."""

import subprocess
import sys

import pytest
import torch

from ndtrain.bench import gpu


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ndtrain.cli", "bench", "gpu", *args], capture_output=True,
                          text=True, timeout=120)


def test_dry_run_lists_every_step_within_the_budget(monkeypatch):
    out = _cli("--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    steps = gpu.steps()
    assert len(lines) == len(steps) + 2 and lines[-1].split()[1] == str(sum(s.budget_s for s in steps))
    assert any("pytest -m cuda" in line for line in lines) and any("train.compile=true" in line for line in lines)
    assert sum(s.budget_s for s in steps) <= gpu.TOTAL_BUDGET_S
    # fp8 joins as soon as train.precision accepts it, and the whole still fits
    import ndtrain.config
    monkeypatch.setattr(ndtrain.config, "PRECISIONS", (*ndtrain.config.PRECISIONS, "fp8"))
    with_fp8 = gpu.steps()
    assert any("fp8" in s.name for s in with_fp8) and sum(s.budget_s for s in with_fp8) <= gpu.TOTAL_BUDGET_S


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ndtrain.cli", "bench", "gpu"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={**__import__("os").environ})
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "CUDA" in out.stderr
    assert not (tmp_path / "docs").exists() and not (tmp_path / "runs").exists()  # nothing written


def test_a_failing_or_hanging_step_is_a_row(tmp_path):
    """Each step runs in its own process group with its own limit: a hang is killed at its
    budget, a crash is recorded with its exit status and last line, and the table has a row
    for every step."""
    steps = [gpu.Step("prints", 30, ("platform",), gpu._last_line),
             gpu.Step("crashes", 30, ("json.tool", str(tmp_path / "missing.json")), gpu._last_line),
             gpu.Step("hangs", 2, ("timeit", "-n", "1", "import time; time.sleep(60)"), gpu._last_line)]
    rows = [(s, gpu.run_step(s, tmp_path / f"{i}.log")) for i, s in enumerate(steps)]
    status = {s.name: r["status"] for s, r in rows}
    assert status == {"prints": "ok", "crashes": "failed (exit 2)", "hangs": "timeout"}, rows
    assert rows[2][1]["took"] < 30
    table = gpu.table({"device": "test"}, rows, tmp_path)
    assert all(f"| {s.name} |" in table for s in steps)
