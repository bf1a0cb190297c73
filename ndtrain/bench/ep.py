"""`ndtrain bench ep`: experts split over the ranks (ep = --nproc) against experts
replicated on every rank (ep = 1), on the same ranks, model, weights and global batch.

Both layouts are data parallel over the same --nproc ranks; only where the experts live
differs. With ep = 1 every rank runs all experts on its own tokens and all-reduces every
expert gradient; with ep = n a rank holds E/n experts, sends each token to the ranks of its
experts and back (two all-to-alls forward, two backward) and all-reduces nothing for them.
The model is chosen so that experts hold most parameters, where splitting them pays. One
training step each (forward, backward, AdamW), alternated round by round; then one more
step of each, untimed, measures the peak memory per rank (observe/memory.py). The
all-to-all time is what the ep side spent launching and waiting for its all-to-alls
(parallel/expert.A2AMeter), per step.
"""

from __future__ import annotations

import statistics

from ndtrain.bench.common import TRAINING, Bench, Contest, alternate, announce, bench_config, describe, report
from ndtrain.config import ConfigError
from ndtrain.launch import launch_local, shutdown
from ndtrain.model.args import expert_params, param_count
from ndtrain.observe.memory import format_bytes, per_rank

MODEL = ("model.preset=tiny-moe", "model.dim=256", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=512",
         "model.moe_experts=16", "model.moe_top_k=2", "model.moe_ffn_dim=512", "model.vocab_size=4096")
SETTINGS = ("train.seq_len=128", "train.global_batch=8", "run.progress=false")
# Both sides are ours: every training key, the balancing, and the data-parallel layout reach both.
BENCH = Bench("ep", MODEL, SETTINGS, TRAINING + ("train.moe_aux_loss", "train.moe_bias_rate", "parallel.dp",
                                                 "parallel.zero", "parallel.bucket_mb", "train.reduce_fp32"))


def _contender(cfg, env, ep: int):
    """A TrainStep of the config's model with experts over `ep` ranks."""
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.step import TrainStep
    from ndtrain.train.worker import mesh_shape

    cfg = cfg.copy()
    cfg.parallel.ep = ep
    return TrainStep(build(cfg.model_args(), ParallelMesh.build(mesh_shape(cfg), env.device), cfg), cfg)


def _worker(cfg_dict: dict, rounds: int, steps: int) -> str:
    c = Contest.start(cfg_dict)  # ours: experts split (ep = nproc)
    try:
        t, device, n = c.cfg.train, c.env.device, c.cfg.parallel.ep
        replicated = _contender(c.cfg, c.env, 1)
        a2a: list[float] = []

        def step(stepper, measure: bool = False):
            stepper.forward_backward(c.micro, c.n_targets, measure_memory=measure)
            if t.grad_clip:
                stepper.clip_grad_norm(t.grad_clip)
            stepper.optimizer_step(t.lr)
            stats = stepper.par.routing_stats.value()
            if "a2a_seconds" in stats and not measure:
                a2a.append(sum(stats["a2a_seconds"]))

        names = (f"ep{n}", "ep1")
        times = alternate({names[0]: lambda: step(c.ours), names[1]: lambda: step(replicated)}, rounds, steps, device)
        a2a_per_step = statistics.median(a2a[len(a2a) // (rounds + 1):])  # after the warm-up round
        peaks = []
        for stepper in (c.ours, replicated):
            step(stepper, measure=True)
            peaks.append(stepper.memory.peak)
        memory = "\n".join(f"peak memory rank {r}: {names[0]} {format_bytes(a)} · {names[1]} {format_bytes(b)}"
                           for r, (a, b) in enumerate(per_rank(peaks, device)))
        median = statistics.median(times[names[0]])
        a2a_line = (f"all-to-all time {names[0]}: {1e3 * a2a_per_step:.1f} ms per step "
                    f"({100 * a2a_per_step / median:.0f}% of its median step)")
        return "\n".join([memory, a2a_line, report(times, c.tokens, "tok/s", f"ndtrain {names[0]}/ep1",
                                                   numerator=names[0], denominator="ep1")])
    finally:
        shutdown()


def run(args) -> int:
    cfg = bench_config(args, BENCH)
    a = cfg.model_args()
    if not a.is_moe:
        raise ConfigError("model.preset", cfg.model.preset, "bench ep needs a model with experts (tiny-moe, olmoe-1b-7b)")
    if a.moe_experts % args.nproc:
        raise ConfigError("--nproc", args.nproc, f"bench ep splits the experts over every rank: it must divide "
                          f"model.moe_experts = {a.moe_experts}")
    cfg.parallel.ep = args.nproc
    total = param_count(a)
    announce(args, cfg, f"bench ep: ep={cfg.parallel.ep} vs ep=1 · {args.nproc} ranks · {describe(cfg)} · "
                        f"experts={a.moe_experts} top-{a.moe_top_k} expert dim={a.expert_dim}, "
                        f"{100 * expert_params(a) / total:.0f}% of parameters in experts · "
                        f"{args.rounds} rounds × {args.steps} steps, alternating")
    out = launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps)[0]
    print(out)
    return 0
