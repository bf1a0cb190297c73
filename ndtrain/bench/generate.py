"""`ndtrain bench generate`: batched generation with a KV cache against recomputing the
prefix at every new token, on one process.

Both sides are `generate/sampler.generate` on the same model, prompts and seeds, so they
produce the same tokens; the only difference is `use_cache`. With the cache one forward
reads the prompts, then each step reads one new token per row; without it each step reads
every position so far. Measured at 64 and 256 new tokens (no stop token: every row runs to
the end), alternating rounds; the figures are new tokens per second. The last line is the
geometric mean of the two lengths' ratios.
"""

from __future__ import annotations

import math
import statistics

import torch

from ndtrain.bench.common import Bench, alternate, announce, bench_config, report

LENGTHS = (64, 256)
BENCH = Bench("generate", ("model.preset=small", "model.vocab_size=4096"),
              ("train.global_batch=16", "train.seq_len=32", "run.progress=false"),
              ("model.", "train.global_batch", "train.seq_len", "train.seed", "train.precision", "run.device",
               "run.threads"))


def run(args) -> int:
    from ndtrain.config import ConfigError
    from ndtrain.generate.sampler import generate
    from ndtrain.launch import init_process, shutdown
    from ndtrain.parallel.parallelize import build_model
    from ndtrain.parallel.precision import compute_dtype

    if args.nproc != 2 and args.nproc != 1:
        raise ConfigError("--nproc", args.nproc, "bench generate runs on one process")
    args.nproc = 1
    cfg = bench_config(args, BENCH)
    t = cfg.train
    a = cfg.model_args()
    if a.max_seq_len < t.seq_len + max(LENGTHS):
        a = a.with_(max_seq_len=t.seq_len + max(LENGTHS))
    from ndtrain.model.args import kv_cache_elements_per_token, param_count
    cached = kv_cache_elements_per_token(a) * compute_dtype(t.precision, t.fp8_base).itemsize
    what = "MLA's latent and rotary key" if a.is_mla else "keys and values"
    announce(args, cfg, f"bench generate: KV cache vs recomputing the prefix · 1 process · model {cfg.model.preset} "
                        f"dim={a.dim} layers={a.n_layers} heads={a.n_heads}/{a.n_kv_heads} vocab={a.vocab_size} "
                        f"({param_count(a) / 1e6:.1f} M parameters) · cache {cached:,} bytes per token ({what}) · "
                        f"{t.precision} · "
                        f"{t.global_batch} prompts of {t.seq_len // 2}..{t.seq_len} tokens · "
                        f"{args.rounds} rounds × {args.steps} generations per length, alternating")
    env = init_process(cfg.run.device, cfg.run.threads)
    try:
        model = build_model(a, t.seed, env.device).to(compute_dtype(t.precision, t.fp8_base))
        g = torch.Generator().manual_seed(t.seed)
        lengths = torch.randint(t.seq_len // 2, t.seq_len + 1, (t.global_batch,), generator=g)
        prompts = [torch.randint(0, a.vocab_size, (int(n),), generator=g).tolist() for n in lengths]
        ratios, blocks = [], []
        for new in LENGTHS:
            def run_with(cache: bool, new=new) -> None:
                generate(model, prompts, new, temperature=1.0, seeds=range(len(prompts)), use_cache=cache)
            times = alternate({"kv-cache": lambda: run_with(True), "no-cache": lambda: run_with(False)},
                              args.rounds, args.steps, env.device)
            work = len(prompts) * new
            table = report(times, work, "tok/s", f"{new} new tokens: kv-cache/no-cache", "kv-cache", "no-cache")
            blocks.append(f"── {new} new tokens per prompt\n{table}")
            med = {k: statistics.median(v) for k, v in times.items()}
            ratios.append(med["no-cache"] / med["kv-cache"])
        print("\n".join(blocks))
        print(f"ndtrain kv-cache/no-cache generation throughput ratio: {math.prod(ratios) ** (1 / len(ratios)):.2f}")
    finally:
        shutdown()
    return 0
