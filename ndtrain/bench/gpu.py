"""`ndtrain bench gpu`: the first run on GPUs, as one command (run it from the repository root).

It runs `steps()` in order, each in a process of its own with its own time limit, so a
crash, a hang or a timeout is one failed row and the next step still runs.

One GPU (within `TOTAL_BUDGET_S`): the probe of every CUDA-only call (bench/gpu_probe.py),
the CUDA-marked tests (one line per test in the log, so a step killed at its limit still
says what passed), the 1B preset at seq 2048 in bf16 and fp8, eager and compiled (tokens/s
and MFU, bench/mfu.py), generation with and without the KV cache, and the frontier features
(DeepSeek-V3, gpt-oss, Muon, MXFP8, NVFP4) on the device against the CPU
(bench/gpu_features.py).

Two or more GPUs add a stage (within `MULTI_BUDGET_S`): 3 bf16 steps of the small model on
one GPU, then the same under dp2, tp2, pp2 with every schedule, cp2 (ring), ZeRO-3, and
(the MoE preset against its own one-GPU run) ep2; a row is ok when every loss is within
`LOSS_RTOL` of the one-GPU run's.

It writes a markdown table (device, driver, torch and CUDA versions, each step's time,
status and figures) to runs/bench-gpu-<time>/report.md beside each step's output, and
prints it; docs/benchmarks-gpu.md keeps the tables of the runs so far. `--dry-run` prints
the steps and their budgets and runs nothing (it needs no GPU); without a CUDA device the
command says so in one line and exits 2.

Budgets: what each step took on an H200 (docs/benchmarks-gpu.md: the probe over 80 s with
its compiled fp8 linears, the CUDA tests 75 s, the 1B steps 18-22 s eager and 30 s compiled
in bf16, generation over 35 s) with room for a slower machine; fp8 compiled gets what bf16
compiled gets (it compiles the quantizers too). The features step has not run on a GPU yet:
its 60 s are five tiny models' CPU runs (~3 s each on the H200 machine's 16 cores, estimated
from 10-14 s on 2 loaded cores here) and two device runs each.
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

TOTAL_BUDGET_S = 540  # the one-GPU steps, all killed at their limits
MULTI_BUDGET_S = 600  # the multi-GPU stage, likewise
# bf16 against fp32 moves the small model's losses by <= 2e-3 over 10 steps in every layout
# (tests/test_precision.py LOSS_RTOL); two bf16 runs each within it of fp32 differ by <= 2×.
LOSS_RTOL = 4e-3


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


def _probe_summary(out: str) -> str:
    data = json.loads(_last_line(out))
    failed = [name for name, status in data["status"].items() if status != "ok"]
    return f"{data['probes_ok']}/{data['probes']} calls ok" + (f"; failed: {'; '.join(failed)}" if failed else "")


def _features_summary(out: str) -> str:
    data = json.loads(_last_line(out))
    bad = [f"{name}: {r['status']}" for name, r in data["rows"].items() if r["status"] != "ok"]
    return f"{len(data['rows']) - len(bad)}/{len(data['rows'])} features ok" + (f"; {'; '.join(bad)}" if bad else "")


def _pytest_summary(out: str) -> str:
    found = re.findall(r"=+ (.*(?:passed|failed|skipped|error|deselected).*) =+", out)
    if not found:
        raise ValueError("no pytest summary")
    return found[-1] + _failures(out)


def _pytest_progress(out: str) -> str:
    """What a killed pytest run had done: its per-test lines (-v) counted."""
    outcomes = re.findall(r"^(tests/\S+) (PASSED|FAILED|SKIPPED|ERROR)", out, re.M)
    counts = {k: sum(o == k for _, o in outcomes) for k in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
    done = ", ".join(f"{n} {k.lower()}" for k, n in counts.items() if n)
    running = re.findall(r"^(tests/\S+) *$", out, re.M)
    return (done or "no test finished") + (f"; running {running[-1]}" if running else "") + _failures(out)


def _failures(out: str) -> str:
    failed = re.findall(r"^(tests/\S+) (?:FAILED|ERROR)", out, re.M)
    return f"; failed: {', '.join(failed)}" if failed else ""


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    argv: tuple[str, ...]  # after `python -m`
    result: Callable[[str], str]  # the figures, from the step's output
    progress: Callable[[str], str] | None = None  # what a step killed at its limit had done
    multi_gpu: bool = False


def _mfu(name: str, budget_s: int, *overrides: str) -> Step:
    return Step(name, budget_s, ("ndtrain.bench.mfu", "model.preset=1B", "train.seq_len=2048", *overrides), _last_json)


def one_gpu_steps() -> list[Step]:
    return [
        Step("CUDA calls (bench/gpu_probe.py)", 110, ("ndtrain.bench.gpu_probe",), _probe_summary),
        Step("CUDA tests (pytest -m cuda)", 90, ("pytest", "-m", "cuda", "-v", "-p", "no:cacheprovider", "tests"),
             _pytest_summary, _pytest_progress),
        _mfu("1B, seq 2048, bf16, eager", 40, "train.precision=bf16"),
        _mfu("1B, seq 2048, bf16, compiled", 75, "train.precision=bf16", "train.compile=true"),
        _mfu("1B, seq 2048, fp8 tensorwise, eager", 40, "train.precision=fp8"),
        _mfu("1B, seq 2048, fp8 tensorwise, compiled", 75, "train.precision=fp8", "train.compile=true"),
        Step("bench generate (KV cache vs none)", 50,
             ("ndtrain.cli", "bench", "generate", "--rounds", "3", "train.precision=bf16"), _last_line),
        Step("frontier features vs the CPU (bench/gpu_features.py)", 60, ("ndtrain.bench.gpu_features",),
             _features_summary),
    ]


# The multi-GPU stage: the small model, 3 steps of 8 rows of 256 tokens in 4 micro-batches.
MULTI_COMMON = ("model.preset=small", "train.steps=3", "train.precision=bf16", "train.seq_len=256",
                "train.global_batch=8", "train.micro_batch=2", "train.eval_every=0", "train.eval_batches=1",
                "run.progress=false", "run.plot=false")
LAYOUTS = {  # name: (processes, overrides, reference)
    "1 GPU": (1, (), None),
    "dp2": (2, (), "1 GPU"),
    "tp2 + SP": (2, ("parallel.tp=2",), "1 GPU"),
    **{f"pp2 {s}": (2, ("parallel.pp=2", f"parallel.pp_schedule={s}"), "1 GPU") for s in ("afab", "1f1b", "zb")},
    **{f"pp2 {s} (2 chunks a rank)": (2, ("parallel.pp=2", f"parallel.pp_schedule={s}", "parallel.pp_virtual=2"),
                                      "1 GPU") for s in ("interleaved", "zbv", "dualpipev")},
    "cp2 ring": (2, ("parallel.cp=2",), "1 GPU"),
    "ZeRO-3": (2, ("parallel.zero=3",), "1 GPU"),
    "MoE, 1 GPU": (1, ("model.preset=tiny-moe",), None),
    "MoE, ep2": (2, ("model.preset=tiny-moe", "parallel.ep=2"), "MoE, 1 GPU"),
}


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


def _compare(run_dir: Path, reference: Path | None) -> Callable[[str], str]:
    def result(out: str) -> str:
        losses = _losses(run_dir)
        if not losses:
            raise ValueError("no losses")
        shown = ", ".join(f"{x:.4f}" for x in losses)
        if reference is None:
            return f"losses {shown}"
        ref = _losses(reference)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        if len(ref) != len(losses) or worst > LOSS_RTOL:
            raise ValueError(f"losses {shown} against {', '.join(f'{x:.4f}' for x in ref)}: "
                             f"worst relative difference {worst:.1e} > {LOSS_RTOL:g}")
        return f"losses {shown}; worst relative difference from one GPU {worst:.1e} (≤ {LOSS_RTOL:g})"
    return result


def multi_gpu_steps(logs: Path, extra: tuple[str, ...] = ()) -> list[Step]:
    """`extra`: overrides for every row (the CPU check of this stage runs it on gloo)."""
    def folder(name: str) -> Path:
        return logs / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")

    out = []
    for name, (nproc, overrides, reference) in LAYOUTS.items():
        argv = ("ndtrain.cli", "train", "--nproc", str(nproc), *MULTI_COMMON, *overrides, *extra,
                "run.resume=false", f"run.dir={folder(name)}")
        out.append(Step(name, 45, argv, _compare(folder(name), reference and folder(reference)), multi_gpu=True))
    return out


def steps(logs: Path = Path("runs/bench-gpu-<time>")) -> list[Step]:
    return one_gpu_steps() + multi_gpu_steps(logs)


def select(chosen: list[Step], only: str | None) -> list[Step]:
    """--only PREFIX[,PREFIX]: the steps whose name starts with one of them, e.g. a step that
    failed, run again after a fix without the others' minutes."""
    if not only:
        return chosen
    from ndtrain.config import ConfigError
    names = [s.name for s in chosen]
    prefixes: list[str] = []
    for part in only.split(","):  # a step's name has commas: "1B, seq 2048, bf16" stays one prefix
        joined = f"{prefixes[-1]},{part}" if prefixes else None
        if joined is not None and any(n.startswith(joined) for n in names):
            prefixes[-1] = joined
        else:
            prefixes.append(part.strip())
    kept = [s for s in chosen if any(p and s.name.startswith(p) for p in prefixes)]
    if not kept:
        raise ConfigError("--only", only, f"matches no step; names: {'; '.join(s.name for s in chosen)}")
    return kept


def plan(chosen: list[Step]) -> str:
    lines = [f"{'step':<40} {'budget':>8}  command"]
    for stage, limit, title in ((False, TOTAL_BUDGET_S, "one GPU"), (True, MULTI_BUDGET_S, "2+ GPUs only")):
        part = [s for s in chosen if s.multi_gpu == stage]
        lines += [f"{s.name:<40} {s.budget_s:>6} s  python -m {' '.join(s.argv)}" for s in part]
        lines.append(f"{'total, ' + title:<40} {sum(s.budget_s for s in part):>6} s  (limit {limit} s)")
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
        done = f": {step.progress(out)}" if step.progress else ""
        return {"status": "timeout", "took": took, "result": f"killed after {step.budget_s} s{done}"}
    try:
        result = step.result(out)
    except (ValueError, KeyError, IndexError, OSError, json.JSONDecodeError) as e:
        result = str(e) if isinstance(e, ValueError) and code == 0 else \
            (out.strip().splitlines() or ["no output"])[-1][:200]
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
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    props = torch.cuda.get_device_properties(0)
    return {"device": f"{torch.cuda.device_count()} × {props.name} ({props.total_memory / 2**30:.0f} GiB)",
            "driver": driver, "torch": torch.__version__, "CUDA": torch.version.cuda or "?",
            "commit": commit or "?", "date": time.strftime("%Y-%m-%d %H:%M")}


def table(env: dict[str, str], rows: list[tuple[Step, dict]], logs: Path) -> str:
    head = " · ".join(f"{k} {v}" for k, v in env.items())
    lines = ["# ndtrain on GPUs (`ndtrain bench gpu`)", "", head, "",
             "| step | budget | took | status | result |", "|---|---:|---:|---|---|"]
    for step, r in rows:
        lines.append(f"| {step.name} | {step.budget_s} s | {r['took']:.0f} s | {r['status']} | "
                     f"{r['result'].replace('|', '/')} |")
    lines += ["", f"Each step's output: {logs}/. Commands: `ndtrain bench gpu --dry-run`."]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    only = getattr(args, "only", None)
    if getattr(args, "dry_run", False):
        print(plan(select(steps(), only)))
        return 0
    select(steps(), only)  # a bad --only is refused before anything runs
    import torch
    if not torch.cuda.is_available():
        print("ndtrain: bench gpu needs a CUDA device, and torch sees none (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    logs = Path("runs") / time.strftime("bench-gpu-%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    chosen = select(one_gpu_steps() + (multi_gpu_steps(logs) if torch.cuda.device_count() >= 2 else []), only)
    env = environment()
    print(f"bench gpu: {env['device']} · {len(chosen)} steps within {sum(s.budget_s for s in chosen)} s"
          + ("" if torch.cuda.device_count() >= 2 else " (one GPU: no multi-GPU stage)"), flush=True)
    rows = []
    report = logs / "report.md"
    for i, step in enumerate(chosen):
        r = run_step(step, logs / f"{i + 1:02d}.log")
        rows.append((step, r))
        print(f"{step.name}: {r['status']} in {r['took']:.0f} s · {r['result']}", flush=True)
        report.write_text(table(env, rows, logs))  # after every step: a later crash keeps the rows so far
    ok = sum(r["status"] == "ok" for _, r in rows)
    print(table(env, rows, logs), flush=True)
    print(f"ndtrain bench gpu: {ok}/{len(rows)} steps ok, table in {report} (add it to docs/benchmarks-gpu.md)")
    return 0 if ok == len(rows) else 1
