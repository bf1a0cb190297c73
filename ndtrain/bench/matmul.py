"""`ndtrain bench matmul`: the achievable fp32 matmul rate of this CPU, saved for CPU MFU."""

from __future__ import annotations

import os

import torch

from ndtrain.config import load_config
from ndtrain.observe.mfu import measure_matmul, save_cpu_peak


def run_matmul_bench(args) -> int:
    cfg = load_config(args.config, args.overrides)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    best = 0.0
    for n in (512, 1024, 2048):
        flops = measure_matmul(n, seconds=1.5)
        print(f"fp32 matmul {n}×{n}: {flops / 1e9:,.1f} GFLOP/s ({threads} threads)")
        if flops > best:
            best, best_n = flops, n
    path = save_cpu_peak(cfg.data.cache_dir, best, best_n, threads)
    print(f"CPU peak for MFU: {best / 1e9:,.1f} GFLOP/s, saved to {path}")
    return 0
