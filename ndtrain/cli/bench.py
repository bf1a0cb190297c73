"""`ndtrain bench <what>`: a benchmark of ndtrain against its PyTorch-native anchor
(ndtrain/bench/), after the flags common to all of them are checked."""

from __future__ import annotations


# Benchmarks whose steps are long on a CPU take fewer rounds by default: one generation of
# 256 new tokens without a cache is about 20 s there (docs/benchmarks.md); bench plan times
# nine layouts and calibrates the machine in every round.
BENCH_ROUNDS_STEPS = {"generate": (5, 1), "plan": (5, 2), "prepare": (5, 1), "ft": (2, 1), "rl": (3, 1)}
CALIBRATING = ("matmul", "comm", "plan")  # benchmarks that save a calibration in data.cache_dir


def cmd_bench(args) -> int:
    from ndtrain import supervisor
    from ndtrain.config import ConfigError, check_out_folder, check_writable_dir
    supervisor.STOP_SAVES = False  # a benchmark has nothing to save: SIGINT/SIGTERM end it at once
    rounds, steps = BENCH_ROUNDS_STEPS.get(args.what, (10, 3))
    args.rounds = rounds if args.rounds is None else args.rounds
    args.steps = steps if args.steps is None else args.steps
    for flag, value in (("--nproc", args.nproc), ("--rounds", args.rounds), ("--steps", args.steps)):
        if value <= 0:
            raise ConfigError(flag, value, "must be > 0")
    if args.only is not None and args.what not in ("plan", "gpu"):
        raise ConfigError("--only", args.only, "only bench plan (its layouts) and bench gpu (its steps) take it")
    if args.out:
        check_out_folder("--out", args.out, args.overwrite)
    if args.what in CALIBRATING:  # they save what they measure there: refused before measuring for minutes
        from ndtrain.config import load_config
        given = [o for o in getattr(args, "overrides", []) if o.partition("=")[0].strip() == "data.cache_dir"]
        check_writable_dir("data.cache_dir", load_config(args.config, given).data.cache_dir)
    if args.what == "matmul":
        from ndtrain.bench.matmul import run_matmul_bench
        return run_matmul_bench(args)
    if args.what == "gpu":
        from ndtrain.bench.gpu import run as run_gpu
        return run_gpu(args)
    from ndtrain.bench import (checkpoint, comm, compile, cp, dp, ep, fp8, ft, generate, lora, muon, plan, pp,
                               prepare, rl, sft, tp, zero)
    return {"ft": ft, "dp": dp, "tp": tp, "zero": zero, "pp": pp, "cp": cp, "comm": comm, "sft": sft, "lora": lora,
            "checkpoint": checkpoint, "ep": ep, "generate": generate, "plan": plan, "fp8": fp8, "muon": muon,
            "compile": compile, "prepare": prepare, "rl": rl}[args.what].run(args)
