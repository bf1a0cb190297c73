"""`ndtrain bench gpu`: its steps fit 8 minutes (with fp8 too, once it exists), a missing GPU is
one line and exit 2, and a step that crashes or hangs is a row of the table, not the end of
the run."""

import pytest
import torch

from ndtrain.bench import gpu


def test_dry_run_lists_every_step_within_the_budget(monkeypatch, capsys):
    from ndtrain.cli import main

    assert main(["bench", "gpu", "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
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
def test_without_a_gpu_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from ndtrain.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["bench", "gpu"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and "CUDA" in out.err
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
