"""`ndtrain bench rl`: the synchronous RL job against the asynchronous one on as many processes.

Synchronous: --nproc ranks generate every rollout (dealt in shares), then train on it.
Asynchronous: --nproc − 1 ranks train while one generator process (rl.generate_ranks = 1)
samples the next rollout with the weights one rollout old (rl.max_staleness = 1). The same
model (random weights), task, batch, sampling and updates on both sides; the two cannot share
processes (their process layouts differ), so each round launches one whole job of each,
alternating (A B, then B A), after a warm-up round. Timed: the updates after the first of
each job (the first carries the generator's start and the first weights). Reported per
side: the median seconds per update, the share of an update the training ranks spent
waiting for (or making) the rollout, and, asynchronously, the share the generator waited
for weights; the last line is the ratio of the asynchronous median over the synchronous.
"""

from __future__ import annotations

import copy
import statistics

from ndtrain.bench.common import TRAINING, Bench, announce, bench_config, describe

BENCH = Bench("rl", ("model.preset=tiny",),
              ("train.global_batch=48", "rl.group_size=8", "rl.max_new_tokens=32", "train.steps=6", "train.lr=1e-4",
               "rl.eval_prompts=0", "rl.pass_k=0", "train.eval_every=0", "run.progress=false", "run.plot=false"),
              TRAINING + ("rl.", "train.steps"))
SIDES = {"sync": ["rl.generate_ranks=0", "rl.max_staleness=0"], "async": ["rl.generate_ranks=1", "rl.max_staleness=1"]}


def _worker(cfg_dict: dict, template) -> dict:
    from ndtrain.config import from_dict
    from ndtrain.launch import init_process, shutdown
    from ndtrain.mesh import ParallelMesh
    from ndtrain.train.rl.task import RL, Environment
    from ndtrain.train.trainer import Trainer
    from ndtrain.train.worker import mesh_shape

    cfg = from_dict(cfg_dict)
    env = init_process(cfg.run.device, cfg.run.threads)
    task = RL(cfg, Environment(cfg, template))
    try:
        trainer = Trainer(cfg, ParallelMesh.build(mesh_shape(cfg), env.device), task, None)
        trainer.meter_steps = 0
        trainer.fit()
        return {"history": [{k: r.get(k) for k in ("step_time_s", "rollout_time_s", "trainer_wait_s",
                                                    "generator_idle")} for r in trainer.history]}
    finally:
        task.close()
        shutdown()


def _measure(history: list[dict]) -> tuple[float, float, float | None]:
    """(seconds per update, the training ranks' rollout share, the generator's idle share)
    over the updates after the first."""
    timed = history[1:]
    step = sum(r["step_time_s"] for r in timed)
    wait = sum(r["trainer_wait_s"] if r.get("trainer_wait_s") is not None else r["rollout_time_s"] for r in timed)
    idle = [r["generator_idle"] for r in timed if r.get("generator_idle") is not None]
    return step / len(timed), wait / step, (sum(idle) / len(idle) if idle else None)


def run(args) -> int:
    from ndtrain.config import ConfigError
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.data.verifiable import char_tokenizer
    from ndtrain.launch import launch_local
    from ndtrain.train.rl import job

    if args.nproc < 2:
        raise ConfigError("--nproc", args.nproc, "bench rl needs at least 2 processes (one generates "
                                                 "asynchronously while the others train)")
    template = BuiltinTemplate(char_tokenizer())
    cfgs = {}
    for side, keys in SIDES.items():  # each side validated for its own training ranks
        world = args.nproc if side == "sync" else args.nproc - 1
        cfg = bench_config(copy.copy(args).__class__(**dict(vars(args), nproc=world,
                                                            overrides=list(args.overrides) + keys)), BENCH)
        cfg.train.seq_len = job.row_length(cfg)
        cfgs[side] = (world, cfg)
    base = cfgs["sync"][1]
    if base.train.steps < 2:
        raise ConfigError("train.steps", base.train.steps, "bench rl times the updates after the first: at least 2")
    announce(args, base, f"bench rl: synchronous ({args.nproc} ranks generate, then train) vs asynchronous "
                         f"({args.nproc - 1} train, 1 generator, staleness 1) · {describe(base)} · "
                         f"{base.train.steps} updates of {base.train.global_batch // base.rl.group_size} prompts × "
                         f"{base.rl.group_size}, up to {base.rl.max_new_tokens} new tokens · {args.rounds} rounds, "
                         "alternating")
    per = {side: [] for side in SIDES}
    for r in range(1 + args.rounds):
        order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
        for side in order:
            world, cfg = cfgs[side]
            history = launch_local(world, _worker, cfg.to_dict(), template)[0]["history"]
            if r:  # round 0 warms the caches and the page cache up
                per[side].append(_measure(history))
    lines = ["round   sync s/update (rollout share)   async s/update (wait share, generator idle)"]
    for i, (s, a) in enumerate(zip(per["sync"], per["async"])):
        lines.append(f"{i + 1:>5}   {s[0]:>13.3f} ({s[1]:.2f})              {a[0]:>13.3f} ({a[1]:.2f}, {a[2]:.2f})")
    med = {side: statistics.median(x[0] for x in v) for side, v in per.items()}
    share = {side: statistics.median(x[1] for x in v) for side, v in per.items()}
    idle = statistics.median(x[2] for x in per["async"])
    lines.append(f"median  {med['sync']:>13.3f} ({share['sync']:.2f})              {med['async']:>13.3f} "
                 f"({share['async']:.2f}, {idle:.2f})")
    lines.append(f"sync: the training ranks spend {share['sync']:.0%} of an update generating · async: the training "
                 f"ranks wait {share['async']:.0%} of an update for the rollout, the generator idles {idle:.0%}")
    lines.append(f"ndtrain rl async/sync wall-time ratio: {med['async'] / med['sync']:.2f}")
    print("\n".join(lines), flush=True)
    return 0

