"""`ndtrain bench rl`: the synchronous RL job against the asynchronous one on as many processes.

Synchronous: --nproc ranks generate every rollout (dealt in shares), then train on it.
Asynchronous: --nproc − 1 ranks train while one generator process (rl.generate_ranks = 1)
samples the next rollout with the weights one rollout old (rl.max_staleness = 1). The same
model (random weights), task, batch, sampling and updates on both sides, and a prompt mix
whose completions have a long tail (rl.long_tail = 0.1: a tenth of the prompts may run to
rl.max_new_tokens, the others are cut at an eighth of it). The two cannot share processes
(their process layouts differ), so each round launches one whole job of each, alternating
(A B, then B A), after a warm-up round. Timed: the updates after the first of each job (the
first carries the generator's start and the first weights). Reported per side: the median
seconds per update, and the idle fractions from each rank's recorded times (RL.timeline):
the training ranks' share of an update not training (synchronously: generating and waiting
for the longest share; asynchronously: sending the weights and waiting for the rollout), and
the generation's share idle (synchronously: the ranks' time not sampling their share;
asynchronously: the generator's wait for weights), and the asynchronous side's weight move
(seconds and bytes per update, parallel/weight_bridge.py). Then the peak memory of the output head
and loss at vocabulary 32,768, whole logits against chunks (bench/logits.py). With
rl.eval_prompts > 0 (and a model that can answer: model.init_from), each side also trains 3
seeds and reports held-out pass@1 after the updates and the difference. The last line is
the ratio of the asynchronous median over the synchronous.
"""

from __future__ import annotations

import copy
import statistics

from ndtrain.bench.common import TRAINING, Bench, announce, bench_config, describe

BENCH = Bench("rl", ("model.preset=tiny",),
              ("train.global_batch=48", "rl.group_size=8", "rl.max_new_tokens=32", "rl.long_tail=0.1", "train.steps=6",
               "train.lr=1e-4",
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
        trainer.start()  # model.init_from's weights, if any (no run folder: nothing to resume)
        trainer.fit()
        task.close()  # the generators (their last rollout's times are in the timeline)
        passed = task.evaluate(trainer).get("pass@1") if cfg.rl.eval_prompts else None
        return {"history": [{k: r.get(k) for k in ("step_time_s", "rollout_time_s", "trainer_wait_s",
                                                    "generator_idle", "weight_sync_s", "weight_sync_bytes")}
                            for r in trainer.history],
                "timeline": task.timeline, "pass@1": passed}
    finally:
        task.close()
        shutdown()


def _measure(ranks: list[dict]) -> tuple[float, float, float]:
    """(seconds per update, the training ranks' idle share, the generation's idle share)
    over the updates after the first (each update's span: from its rollout phase's start
    to the next one's, so the last update is left out of the shares)."""
    history = ranks[0]["history"]
    step = sum(r["step_time_s"] for r in history[1:]) / len(history[1:])
    spans = idle = sampling = 0.0
    for rank in ranks:
        tl = rank["timeline"]
        for a, b in zip(tl[1:], tl[2:]):
            span = b["begin"] - a["begin"]
            spans += span
            idle += (a["received"] if "received" in a else a["end"]) - a["begin"]
            if a.get("sampled") is not None:
                sampling += a["sampled"] - a["begin"]
    generator = [r["generator_idle"] for r in history[1:] if r.get("generator_idle") is not None]
    gen_idle = sum(generator) / len(generator) if generator else 1.0 - sampling / spans
    return step, idle / spans, gen_idle


def _pass_rates(args, cfgs: dict, seeds=(0, 1, 2)) -> list[str]:
    """Held-out pass@1 after the updates, each side, each seed; the mean difference."""
    from ndtrain.launch import launch_local
    rates = {side: [] for side in cfgs}
    for seed in seeds:
        for side, (world, cfg) in cfgs.items():
            cfg = copy.deepcopy(cfg)
            cfg.train.seed = seed
            rates[side].append(launch_local(world, _worker, cfg.to_dict(), _template())[0]["pass@1"])
    lines = ["seed   sync pass@1   async pass@1"]
    lines += [f"{s:>4}   {a:>11.3f}   {b:>12.3f}" for s, a, b in zip(seeds, rates["sync"], rates["async"])]
    diff = 100 * (statistics.mean(rates["async"]) - statistics.mean(rates["sync"]))
    lines.append(f"held-out pass@1 after {cfgs['sync'][1].train.steps} updates, async − sync over {len(seeds)} seeds: "
                 f"{diff:+.1f} points (target: within 2)")
    return lines


def _template():
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.data.verifiable import char_tokenizer
    return BuiltinTemplate(char_tokenizer())


def run(args) -> int:
    from ndtrain.bench.logits import VOCAB, peaks
    from ndtrain.config import ConfigError
    from ndtrain.launch import launch_local
    from ndtrain.train.rl import job

    if args.nproc < 2:
        raise ConfigError("--nproc", args.nproc, "bench rl needs at least 2 processes (one generates "
                                                 "asynchronously while the others train)")
    template = _template()
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
                         f"{base.rl.group_size}, up to {base.rl.max_new_tokens} new tokens (rl.long_tail = "
                         f"{base.rl.long_tail:g} of the prompts; the others up to {max(1, base.rl.max_new_tokens // 8)}) "
                         f"· {args.rounds} rounds, alternating")
    per = {side: [] for side in SIDES}
    weights = []  # the asynchronous side's weight moves after the first update: (seconds, bytes)
    for r in range(1 + args.rounds):
        order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
        for side in order:
            world, cfg = cfgs[side]
            ranks = launch_local(world, _worker, cfg.to_dict(), template)
            if r:  # round 0 warms the caches and the page cache up
                per[side].append(_measure(ranks))
                if side == "async":
                    weights += [(h["weight_sync_s"] or 0.0, h["weight_sync_bytes"] or 0)
                                for h in ranks[0]["history"][1:]]
    lines = ["round   sync s/update (idle: trainer, generation)   async s/update (idle: trainer, generator)"]
    for i, (s, a) in enumerate(zip(per["sync"], per["async"])):
        lines.append(f"{i + 1:>5}   {s[0]:>13.3f} ({s[1]:.2f}, {s[2]:.2f})                 {a[0]:>14.3f} "
                     f"({a[1]:.2f}, {a[2]:.2f})")
    med = {side: [statistics.median(x[i] for x in v) for i in range(3)] for side, v in per.items()}
    (s_t, s_idle, s_gen), (a_t, a_idle, a_gen) = med["sync"], med["async"]
    lines.append(f"median  {s_t:>13.3f} ({s_idle:.2f}, {s_gen:.2f})                 {a_t:>14.3f} ({a_idle:.2f}, "
                 f"{a_gen:.2f})")
    lines.append(f"idle fractions (medians): sync: the training ranks do not train {s_idle:.0%} of an update, "
                 f"generation idles {s_gen:.0%} · async: the training ranks wait {a_idle:.0%}, the generator idles "
                 f"{a_gen:.0%}")
    if weights:
        seconds, size = (statistics.median(w[i] for w in weights) for i in (0, 1))
        lines.append(f"weights to the generator (async, over the weight bridge): {seconds:.4f} s and "
                     f"{size / 2**10:.1f} KiB per update (medians of {len(weights)} updates, the training ranks' side)")
    rows, seq, dim = 8, 256, 256
    peak = peaks(rows, seq, dim, (0, 128))
    lines.append(f"logits peak (head + loss, forward and backward, {rows} rows × {seq} positions, dim {dim}, vocab "
                 f"{VOCAB}, fp32): whole {peak[0] / 2**20:.1f} MiB, chunks of 128 {peak[128] / 2**20:.1f} MiB: "
                 f"{peak[128] / peak[0]:.2f}× (target ≤ 0.3×)")
    if base.rl.eval_prompts:
        lines += _pass_rates(args, cfgs)
    lines.append(f"ndtrain rl async/sync wall-time ratio: {a_t / s_t:.2f}")
    print("\n".join(lines), flush=True)
    return 0
