"""`ndtrain bench fp8`: training steps in bf16 against the same steps in fp8, each recipe.

Six contenders on the same ranks, model, weights and micro-batches, each a full training
step (forward, backward, clip, AdamW) on our own layout: `train.precision=bf16`,
`train.precision=fp8` with `fp8_recipe` tensorwise, rowwise, blockwise and mxfp8, and
`train.precision=nvfp4` (bf16 outside the block linears, fp32 masters alike). Rounds
alternate between the six; tokens/s per round, the medians, and one ratio per recipe,
tensorwise last. MXFP8 and NVFP4 run the emulation everywhere but sm100 (kernels/mx.py).

What it measures depends on the device. On a GPU with fp8 tensor cores (sm89+) the fp8
matmuls are `torch._scaled_mm`, and the ratio is fp8's speed-up (or slowdown: small matmuls
lose to the quantization's extra passes, torchao's roofline tables show the same). On a CPU
it measures the emulation: `_scaled_mm`'s CPU kernel for tensorwise and rowwise, an fp32
matmul per 128-wide run for blockwise, plus every quantization pass; it says how much the
CPU path costs, nothing about a GPU.
"""

from __future__ import annotations

import statistics

import torch

from ndtrain.bench.common import TRAINING, Bench, Contest, alternate, announce, bench_config, describe, report
from ndtrain.config import ConfigError
from ndtrain.launch import launch_local, shutdown

MODEL = ("model.preset=small",)
SETTINGS = ("train.seq_len=128", "train.global_batch=8", "run.progress=false")
# Every training key reaches all four (both sides are ours), except the precision, which is
# what differs; the data-parallel layout too.
BENCH = Bench("fp8", MODEL, SETTINGS, tuple(k for k in TRAINING if k != "train.precision")
              + ("parallel.dp", "parallel.zero", "train.reduce_fp32"))
RECIPES = ("rowwise", "blockwise", "mxfp8", "nvfp4", "tensorwise")  # tensorwise last: the headline ratio


def _name(recipe: str) -> str:
    return recipe if recipe == "nvfp4" else f"fp8-{recipe}"


def _contender(cfg, env, recipe: str | None):
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.step import TrainStep
    from ndtrain.train.worker import mesh_shape

    cfg = cfg.copy()
    if recipe == "nvfp4":
        cfg.train.precision = "nvfp4"
    elif recipe is not None:
        cfg.train.precision, cfg.train.fp8_recipe = "fp8", recipe
    return TrainStep(build(cfg.model_args(), ParallelMesh.build(mesh_shape(cfg), env.device), cfg), cfg)


def _worker(cfg_dict: dict, rounds: int, steps: int) -> str:
    c = Contest.start(cfg_dict)  # bf16
    try:
        steppers = {"bf16": c.ours, **{_name(r): _contender(c.cfg, c.env, r) for r in RECIPES}}
        times = alternate({name: c.step_of(s) for name, s in steppers.items()}, rounds, steps, c.env.device)
        body = report(times, c.tokens, "tok/s", "fp8 tensorwise/bf16", numerator="fp8-tensorwise", denominator="bf16")
        table, last = body.rsplit("\n", 1)
        median = {n: statistics.median(v) for n, v in times.items()}
        ratios = [f"{_name(r).replace('-', ' ')}/bf16 throughput ratio: {median['bf16'] / median[_name(r)]:.2f}"
                  for r in RECIPES[:-1]]
        return "\n".join([table, *ratios, last])
    finally:
        shutdown()


def run(args) -> int:
    cfg = bench_config(args, BENCH)
    cfg.train.precision = "bf16"
    gpu = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    device = "a GPU: torch._scaled_mm" if gpu else (
        "the CPU: this measures the emulation (_scaled_mm's CPU kernel; blockwise in fp32 runs of 128)")
    if cfg.parallel.tp > 1 or cfg.parallel.cp > 1:
        raise ConfigError("parallel.tp", cfg.parallel.tp, "bench fp8 runs data parallel only")
    announce(args, cfg, f"bench fp8: bf16 vs fp8 tensorwise, rowwise, blockwise, mxfp8 and nvfp4 on {device} · "
                        f"{args.nproc} rank{'s' if args.nproc > 1 else ''} · {describe(cfg)} · {args.rounds} rounds × "
                        f"{args.steps} steps of 6 contenders, alternating")
    print(launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps)[0])
    return 0
