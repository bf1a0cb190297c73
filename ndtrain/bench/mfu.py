"""`python -m ndtrain.bench.mfu [KEY=VALUE ...]`: one process's training throughput and MFU on
synthetic tokens (a step of `ndtrain bench gpu`, usable alone).

The model is the config's (its preset's vocabulary, not a tokenizer's), the batch random
tokens of `train.global_batch` rows of `train.seq_len`, the step ndtrain's (forward and
backward of every micro-batch, clip, AdamW) on the one-process layout. After `WARMUP`
steps (the first holds any compilation, reported apart), `--steps` steps are timed between
device synchronisations. MFU = the model's training FLOPs per token (model/args.py) ×
tokens/s / the device's peak at the precision (observe/mfu.py). The last line is one JSON
object: tokens_per_s, mfu, step_s, first_step_s, peak_memory_gib.
"""

from __future__ import annotations

import argparse
import sys
import time

WARMUP = 2
# micro-batch 4: what each GPU runs in the 1B recipe (configs/1b-8gpu.toml); the first GPU
# run's figures (docs/benchmarks-gpu.md, 2026-11-28) were taken at 2
DEFAULTS = ["model.preset=1B", "train.seq_len=2048", "train.global_batch=8", "train.micro_batch=4",
            "train.precision=bf16", "run.device=auto", "run.progress=false"]


def measure(overrides: list[str], steps: int) -> dict:
    import torch

    from ndtrain.bench.common import synthetic_batch
    from ndtrain.config import load_config, validate
    from ndtrain.data.batch import MicroBatch
    from ndtrain.launch import configure_numerics, init_process
    from ndtrain.mesh import ParallelMesh
    from ndtrain.model.args import flops_per_token
    from ndtrain.observe.mfu import peak_flops
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.step import TrainStep
    from ndtrain.train.worker import mesh_shape

    cfg = validate(load_config(None, DEFAULTS + overrides), world=1, check_paths=False)
    env = init_process(cfg.run.device, cfg.run.threads)
    configure_numerics(env.device, cfg.train.tf32, cfg.run.deterministic)
    t, args = cfg.train, cfg.model_args()
    stepper = TrainStep(build(args, ParallelMesh.build(mesh_shape(cfg), env.device), cfg), cfg)
    x, y = synthetic_batch(args, t.global_batch, t.seq_len, 0, env.device)
    micro = MicroBatch(x, y).split(t.micro_batch)
    n_targets = float(t.global_batch * t.seq_len)

    def step():
        stepper.forward_backward(micro, n_targets)
        stepper.clip_grad_norm(t.grad_clip)
        stepper.optimizer_step(t.lr)

    def timed(n: int) -> float:
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        return time.perf_counter() - t0

    first = timed(1)
    timed(WARMUP - 1)
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    seconds = timed(steps) / steps
    tokens_per_s = t.global_batch * t.seq_len / seconds
    peak, source = peak_flops(env.device, t.precision, cfg.data.cache_dir, t.tf32)
    memory = torch.cuda.max_memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else None
    return {"tokens_per_s": tokens_per_s, "mfu": flops_per_token(args, t.seq_len) * tokens_per_s / peak if peak else None,
            "step_s": seconds, "first_step_s": first, "peak_memory_gib": memory, "peak_source": source,
            "device": str(env.device), "precision": t.precision, "compile": t.compile}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ndtrain.bench.mfu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    from ndtrain.config import ConfigError
    try:
        result = measure(a.overrides, a.steps)
    except ConfigError as e:
        print(f"ndtrain: {e}", file=sys.stderr)
        return 2
    from ndtrain.observe.metrics import strict_json
    print(strict_json(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
