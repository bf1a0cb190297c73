"""`ndtrain bench gpu`: its steps fit 8 minutes (with fp8 too, once it exists), a missing GPU is
one line and exit 2, and a step that crashes or hangs is a row of the table, not the end of
the run."""

import json
from pathlib import Path

import pytest
import torch

from ndtrain.config.sections import PP_SCHEDULES

from ndtrain.bench import gpu


def test_dry_run_lists_every_step_within_the_budgets(capsys):
    from ndtrain.cli import main

    assert main(["bench", "gpu", "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    one, multi = gpu.one_gpu_steps(), [s for s in gpu.steps() if s.multi_gpu]
    assert len(lines) == 1 + len(one) + 1 + len(multi) + 1
    assert lines[len(one) + 1].split()[3] == str(sum(s.budget_s for s in one))
    assert sum(s.budget_s for s in one) <= gpu.TOTAL_BUDGET_S and sum(s.budget_s for s in multi) <= gpu.MULTI_BUDGET_S
    for what in ("gpu_probe", "pytest -m cuda -v", "precision=bf16 train.compile=true",
                 "precision=fp8 train.compile=true", "pp_schedule=dualpipev", "parallel.cp=2", "parallel.ep=2"):
        assert any(what in line for line in lines), what
    compiled = {s.name: s.budget_s for s in one if "compiled" in s.name}
    assert len(set(compiled.values())) == 1, compiled  # fp8 compiles the quantizers too: never less time than bf16


def test_only_reruns_the_steps_named_and_refuses_a_prefix_that_names_none(capsys, monkeypatch):
    """--only PREFIX[,PREFIX]: a failed step run again alone. A prefix may hold a step name's
    own commas; a prefix matching nothing is one line and exit 2, before any step (and
    before the check for a GPU)."""
    from ndtrain.cli import main

    assert main(["bench", "gpu", "--dry-run", "--only", "1B, seq 2048, fp8,CUDA tests"]) == 0
    listed = [line.split("  ")[0].strip() for line in capsys.readouterr().out.splitlines()[1:]
              if not line.startswith("total")]
    assert listed == ["CUDA tests (pytest -m cuda)", "1B, seq 2048, fp8 tensorwise, eager",
                      "1B, seq 2048, fp8 tensorwise, compiled"]
    assert main(["bench", "gpu", "--dry-run", "--only", "1B"]) == 0
    assert capsys.readouterr().out.count("model.preset=1B") == 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked for a GPU before refusing --only"))
    assert main(["bench", "gpu", "--only", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ndtrain: error: --only = 'nope': matches no step; names: CUDA calls")
    assert main(["bench", "dp", "--only", "x"]) == 2
    assert "only bench plan (its layouts) and bench gpu (its steps) take it" in capsys.readouterr().err


def test_every_multi_gpu_row_is_a_valid_layout_with_a_reference():
    """Each row of the multi-GPU stage passes the config validation `train` runs, for its
    process count, and names a one-process run as its reference."""
    from ndtrain.config import load_config, validate

    rows = gpu.multi_gpu_steps(Path("runs/x"))
    names = {s.name: s for s in rows}
    assert {"dp2", "tp2 + SP", "cp2 ring", "ZeRO-3", "MoE, ep2"} <= names.keys()
    assert {n.split()[1] for n in names if n.startswith("pp2")} == set(PP_SCHEDULES)
    for step in rows:
        nproc, overrides, reference = gpu.LAYOUTS[step.name]
        assert reference is None or gpu.LAYOUTS[reference][0] == 1 and reference in names
        keys = list(step.argv[step.argv.index(str(nproc)) + 1:])
        validate(load_config(None, keys + ["run.device=cpu"]), world=nproc, check_paths=False)


def _write_losses(folder: Path, losses: list[float]) -> None:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": x}) + "\n"
                                                  for i, x in enumerate(losses)))


def test_a_row_is_ok_only_within_the_loss_tolerance(tmp_path):
    _write_losses(tmp_path / "ref", [8.0, 7.0, 6.0])
    _write_losses(tmp_path / "near", [8.0, 7.0 * (1 + gpu.LOSS_RTOL / 2), 6.0])
    _write_losses(tmp_path / "far", [8.0, 7.0 * (1 + 2 * gpu.LOSS_RTOL), 6.0])
    assert "worst relative difference" in gpu._compare(tmp_path / "near", tmp_path / "ref")("")
    with pytest.raises(ValueError, match="worst relative difference"):
        gpu._compare(tmp_path / "far", tmp_path / "ref")("")


def test_a_killed_pytest_step_says_what_it_had_done():
    out = ("tests/test_a.py::test_one PASSED\ntests/test_a.py::test_two FAILED\n"
           "tests/test_b.py::test_three SKIPPED (needs two GPUs)\ntests/test_c.py::test_slow \n")
    assert gpu._pytest_progress(out) == ("1 passed, 1 failed, 1 skipped; running tests/test_c.py::test_slow; "
                                         "failed: tests/test_a.py::test_two")


@pytest.mark.slow
def test_the_multi_gpu_stage_runs_on_gloo(tmp_path):
    """Three rows of the stage on CPU processes (gloo, bf16): the reference, dp2 and a
    pipeline with two chunks a rank, each within the tolerance of the one-process run."""
    rows = {s.name: s for s in gpu.multi_gpu_steps(tmp_path, ("run.device=cpu",))}
    for name in ("1 GPU", "dp2", "pp2 zbv (2 chunks a rank)"):
        r = gpu.run_step(rows[name], tmp_path / f"{len(name)}.log")
        assert r["status"] == "ok", (name, r)


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


def test_the_features_step_says_which_rows_failed():
    from ndtrain.bench.gpu import _features_summary
    rows = {"a": {"status": "ok"}, "b": {"status": "FAILED fp32 first-step gradients 3.0e-02 > 1e-04 (w)"},
            "c": {"status": "ERROR RuntimeError: no kernel"}}
    out = "a: ok\n" + json.dumps({"rows": rows, "ok": False})
    assert _features_summary(out) == ("1/3 features ok; b: FAILED fp32 first-step gradients 3.0e-02 > 1e-04 (w); "
                                      "c: ERROR RuntimeError: no kernel")


def test_gradient_comparison_is_relative_to_each_tensor_and_a_nan_fails():
    import torch
    from ndtrain.bench.gpu_features import grad_gap
    ref = {"big": torch.tensor([100.0, 1.0]), "small": torch.tensor([1e-3, 0.0])}
    assert grad_gap({"big": torch.tensor([100.0, 1.01]), "small": ref["small"]}, ref) == (pytest.approx(1e-4), "big")
    assert grad_gap({"big": ref["big"], "small": torch.tensor([1e-3, 1e-4])}, ref) == (pytest.approx(0.1), "small")
    assert grad_gap({"big": torch.tensor([float("nan"), 1.0]), "small": ref["small"]}, ref)[0] == float("inf")
    assert grad_gap({"big": ref["big"]}, ref)[0] == float("inf")


@pytest.mark.slow
def test_the_features_step_passes_on_the_cpu_and_finds_a_wrong_rotary():
    """On a machine without a GPU the step's script runs with the CPU as the device (every row
    ok: the same path twice); a rotary base the device side gets wrong (the kind of fault a
    fused kernel makes) fails the fp32 gradient comparison of the row."""
    import subprocess
    import sys
    from ndtrain.bench.gpu_features import GRAD_TOL, compare
    out = subprocess.run([sys.executable, "-m", "ndtrain.bench.gpu_features", "--device", "cpu"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["ok"] and all(r["status"] == "ok" for r in data["rows"].values())
    wrong = compare("gpt-oss tiny: sinks, windows, YaRN, biased experts", "cpu", device_extra=("model.rope_theta=5000",))
    assert wrong["status"].startswith("FAILED") and wrong["grad_gap"] > 10 * GRAD_TOL, wrong


@pytest.mark.parametrize("argv, line", [
    ([], "ndtrain: run.device = 'cuda': no CUDA device is available"),
    (["--device", "cpu", "--precision", "fp99"], "ndtrain: --precision = 'fp99': choose one of bf16, fp32, fp64"),
    (["--device", "tpu"], "ndtrain: run.device = 'tpu': choose auto, cpu or cuda")])
def test_the_features_step_refuses_bad_input_in_one_line_before_any_row(argv, line, capsys):
    from ndtrain.bench.gpu_features import main
    if not argv and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.strip() == line and out == ""
