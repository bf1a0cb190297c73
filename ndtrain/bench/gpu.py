"""`ndtrain bench gpu`: the first run on a GPU, as one command (run it from the repository root).

On one CUDA device, within `TOTAL_BUDGET_S` in all, it runs `STEPS` in order, each in a
process of its own with its own time limit, so a crash, a hang or a timeout is one failed
row and the next step still runs: the CUDA-marked tests, the 1B preset at seq 2048 in bf16
eager and compiled (tokens/s and MFU, `bench/mfu.py`), fp8 once `train.precision=fp8`
exists, and the benchmarks that run on one device. It writes a markdown table (device,
driver, torch and CUDA versions, each step's time, status and figures) to
docs/benchmarks-gpu.md and each step's output next to it, under runs/bench-gpu-<time>/.
`--dry-run` prints the steps and their budgets and runs nothing (it needs no GPU); without a
CUDA device the command says so in one line and exits 2.

A step is a command line and a reader of its output: adding one (a precision, a preset) is
one more `Step` in `steps()`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TOTAL_BUDGET_S = 480
REPORT = Path("docs/benchmarks-gpu.md")


def _last_json(out: str) -> str:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            data = json.loads(line)
            mfu = f"{100 * data['mfu']:.1f}% MFU" if data.get("mfu") is not None else "MFU n/a"
            memory = f", {data['peak_memory_gib']:.1f} GiB peak" if data.get("peak_memory_gib") is not None else ""
            return (f"{data['tokens_per_s']:,.0f} tok/s, {mfu}, {data['step_s']:.3f} s/step "
                    f"(first step {data['first_step_s']:.1f} s){memory}")
    raise ValueError("no result line")


def _last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


def _pytest_summary(out: str) -> str:
    found = re.findall(r"=+ (.*(?:passed|failed|skipped|error|deselected).*) =+", out)
    if not found:
        raise ValueError("no pytest summary")
    return found[-1]


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    argv: tuple[str, ...]  # after `python -m`
    result: Callable[[str], str]  # the figures, from the step's output


def _mfu(name: str, budget_s: int, *overrides: str) -> Step:
    return Step(name, budget_s, ("ndtrain.bench.mfu", "model.preset=1B", "train.seq_len=2048", *overrides), _last_json)


def steps() -> list[Step]:
    from ndtrain.config import PRECISIONS

    out = [
        Step("CUDA tests (pytest -m cuda)", 100, ("pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests"),
             _pytest_summary),
        _mfu("1B, seq 2048, bf16, eager", 50, "train.precision=bf16"),
        _mfu("1B, seq 2048, bf16, compiled", 140, "train.precision=bf16", "train.compile=true"),
    ]
    if "fp8" in PRECISIONS:  # another engineer's precision; on the GPU as soon as it exists
        out.append(_mfu("1B, seq 2048, fp8, compiled", 60, "train.precision=fp8", "train.compile=true"))
    out += [
        Step("bench generate (KV cache vs none)", 40,
             ("ndtrain.cli", "bench", "generate", "--rounds", "3", "train.precision=bf16"), _last_line),
        Step("bench compile (125M, bf16, 1 GPU)", 90,
             ("ndtrain.cli", "bench", "compile", "--nproc", "1", "--rounds", "5", "model.preset=125M",
              "train.precision=bf16", "train.seq_len=1024", "train.global_batch=8"), _last_line),
    ]
    return out


def plan(chosen: list[Step]) -> str:
    lines = [f"{'step':<40} {'budget':>8}  command"]
    lines += [f"{s.name:<40} {s.budget_s:>6} s  python -m {' '.join(s.argv)}" for s in chosen]
    total = sum(s.budget_s for s in chosen)
    lines.append(f"{'total':<40} {total:>6} s  (limit {TOTAL_BUDGET_S} s)")
    return "\n".join(lines)


def run_step(step: Step, log: Path) -> dict:
    """The step in a process group of its own, killed whole at its budget."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", *step.argv], stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=step.budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    took = time.perf_counter() - t0
    out = log.read_text(errors="replace")
    if code is None:
        return {"status": "timeout", "took": took, "result": f"killed after {step.budget_s} s"}
    try:
        result = step.result(out)
    except (ValueError, KeyError, IndexError, json.JSONDecodeError):
        result = (out.strip().splitlines() or ["no output"])[-1][:200]
        return {"status": f"failed (exit {code})", "took": took, "result": result}
    return {"status": "ok" if code == 0 else f"failed (exit {code})", "took": took, "result": result}


def environment() -> dict[str, str]:
    import torch

    driver = "unknown"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    props = torch.cuda.get_device_properties(0)
    return {"device": f"{props.name} ({props.total_memory / 2**30:.0f} GiB)", "driver": driver,
            "torch": torch.__version__, "CUDA": torch.version.cuda or "?", "commit": commit or "?",
            "date": time.strftime("%Y-%m-%d %H:%M")}


def table(env: dict[str, str], rows: list[tuple[Step, dict]], logs: Path) -> str:
    head = " · ".join(f"{k} {v}" for k, v in env.items())
    lines = ["# ndtrain on one GPU (`ndtrain bench gpu`)", "", head, "",
             "| step | budget | took | status | result |", "|---|---:|---:|---|---|"]
    for step, r in rows:
        lines.append(f"| {step.name} | {step.budget_s} s | {r['took']:.0f} s | {r['status']} | "
                     f"{r['result'].replace('|', '/')} |")
    lines += ["", f"Each step's output: {logs}/. Commands: `ndtrain bench gpu --dry-run`."]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    chosen = steps()
    if getattr(args, "dry_run", False):
        print(plan(chosen))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("ndtrain: bench gpu needs a CUDA device, and torch sees none (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    logs = Path("runs") / time.strftime("bench-gpu-%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    env = environment()
    print(f"bench gpu: {env['device']} · {len(chosen)} steps within {sum(s.budget_s for s in chosen)} s", flush=True)
    rows = []
    for i, step in enumerate(chosen):
        r = run_step(step, logs / f"{i + 1:02d}.log")
        rows.append((step, r))
        print(f"{step.name}: {r['status']} in {r['took']:.0f} s · {r['result']}", flush=True)
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(table(env, rows, logs))  # after every step: a later crash keeps the rows so far
    ok = sum(r["status"] == "ok" for _, r in rows)
    print(f"ndtrain bench gpu: {ok}/{len(rows)} steps ok, table in {REPORT}")
    return 0 if ok == len(rows) else 1
