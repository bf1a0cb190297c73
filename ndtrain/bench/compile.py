"""`ndtrain bench compile`: the same training step eager and with regional compilation
(`train.compile`, parallel/compile.py), side by side.

Both sides are ndtrain on the same layout, model, weights, batch and optimizer; the only
difference is `train.compile=true` on one of them (Inductor by default; the backend is
`train.compile_backend`). The first step of each is timed on its own: the compiled side's
first step holds the compilation, reported apart as "compile time" (its first step minus
the eager first step). Then rounds alternate as every benchmark's do; the last line is the
ratio of the median throughputs, compiled over eager.
"""

from __future__ import annotations

from ndtrain.bench.common import Bench, Contest, alternate, announce, bench_config, describe, report
from ndtrain.launch import launch_local, shutdown

# The default job's shape and batch (`ndtrain train` with no arguments).
MODEL = ("model.preset=small",)
SETTINGS = ("train.seq_len=128", "train.global_batch=16", "run.progress=false")
BENCH = Bench("compile", MODEL, SETTINGS, ("model.", "train.", "parallel.", "run.device", "run.threads"))


def _compiled_side(c: Contest):
    from ndtrain.config import from_dict
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.step import TrainStep

    cfg = from_dict(c.cfg.to_dict())
    cfg.train.compile = True
    return TrainStep(build(c.args, c.ours.par.mesh, cfg), cfg)


def _timed(fn, device) -> float:
    """Seconds of one call (barriers and device syncs around, as in the rounds)."""
    return alternate({"once": fn}, 1, 1, device, warmup_rounds=0)["once"][0]


def _worker(cfg_dict: dict, rounds: int, steps: int) -> str:
    c = Contest.start(cfg_dict)
    try:
        device, t = c.env.device, c.cfg.train
        compiled = _compiled_side(c)

        def step_compiled():
            compiled.forward_backward(c.micro, c.n_targets)
            if t.grad_clip:
                compiled.clip_grad_norm(t.grad_clip)
            compiled.optimizer_step(t.lr)

        first_eager = _timed(c.step_ours, device)
        first_compiled = _timed(step_compiled, device)
        times = alternate({"compiled": step_compiled, "eager": c.step_ours}, rounds, steps, device)
        head = (f"first step: eager {first_eager:.1f} s, compiled {first_compiled:.1f} s "
                f"(compile time {max(0.0, first_compiled - first_eager):.1f} s, not in the rounds)")
        return "\n".join([head, report(times, c.tokens, "tok/s", "ndtrain compile/eager",
                                       numerator="compiled", denominator="eager")])
    finally:
        shutdown()


def run(args) -> int:
    cfg = bench_config(args, BENCH)
    if cfg.train.compile:
        from ndtrain.config import ConfigError
        raise ConfigError("train.compile", True, "bench compile sets it on one side itself; leave it out")
    p = cfg.parallel
    announce(args, cfg, f"bench compile: {args.nproc} ranks (dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}) · "
                        f"{describe(cfg)} · backend {cfg.train.compile_backend} · "
                        f"{args.rounds} rounds × {args.steps} steps, alternating")
    out = launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps)[0]
    print(out)
    return 0
