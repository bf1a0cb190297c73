"""`ndtrain bench plan`: the planner's step time against the engine's, on this machine.

For each layout of N ranks (dp, ZeRO-3 dp, tp, pp with every schedule, cp, and ep on a
mixture of experts), the same processes build the engine's training step (train/step.py:
forward and backward of every micro-batch, the clip, AdamW, the loss reduced) on random
tokens, and `ndtrain plan --cluster this-machine` predicts its step time (the ep layout with
the routing imbalance the engine's own counts show for those steps, `--moe-imbalance`). Rounds alternate:
each round first calibrates this machine as the planner reads it (bench/compute.py: matmul
rates by size, elementwise bandwidth, the cost of an operation, the optimizer per
parameter; bench/comm.py: every collective the layouts use, by size, each issued after a
computation as a step issues it), then times every
layout in turn, so the load the machine carries falls on the calibration and on the steps
alike. After warm-up steps, the median over rounds of each layout's step time (the slowest
rank's) is compared with the plan made from the median calibration. Nothing is fitted to
the steps: the planner composes them from the calibration's parts.

The last line: `ndtrain plan worst predicted/measured step time ratio: X`, X the largest of
r and 1/r over the layouts (r = predicted / measured). The calibration is saved where
`ndtrain plan --cluster this-machine` reads it (`cpu_compute.json` in `data.cache_dir`, and
the collectives' fits for N ranks, measured between computations, in
`comm_calibration.json`, replacing those `bench comm` measured back to back).
"""

from __future__ import annotations

import os
import statistics
import time

from ndtrain.config import ConfigError, load_config, validate

MODEL = ("model.preset=small", "model.dim=384", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4",
         "model.ffn_dim=1024", "model.vocab_size=4096", "model.tie_embeddings=false")
MOE = ("model.preset=olmoe-1b-7b", "model.dim=384", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
       "model.ffn_dim=1024", "model.vocab_size=4096", "model.moe_experts=8", "model.moe_top_k=2",
       "model.moe_ffn_dim=512")
SETTINGS = ("train.seq_len=128", "train.global_batch=8", "train.precision=fp32", "run.device=cpu",
            "run.progress=false")
COMM_SIZES = [2**10 * 4**k for k in range(9)]  # 1 KB … 64 MB
COMM_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv")
WARMUP_STEPS = 2


def layouts(n: int) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each row, for n ranks."""
    pp = [f"parallel.pp={n}", "train.micro_batch=1"]
    return [(f"dp{n}", [*MODEL, f"parallel.dp={n}"]),
            (f"zero3 dp{n}", [*MODEL, f"parallel.dp={n}", "parallel.zero=3"]),
            (f"tp{n}", [*MODEL, f"parallel.tp={n}"]),
            *[(f"pp{n} {s}", [*MODEL, *pp, f"parallel.pp_schedule={s}"]) for s in ("afab", "1f1b", "zb")],
            *[(f"pp{n} {s}", [*MODEL, *pp, f"parallel.pp_schedule={s}", "parallel.pp_virtual=2"])
              for s in ("interleaved", "zbv", "dualpipev")],
            (f"cp{n}", [*MODEL, f"parallel.cp={n}"]),
            (f"ep{n}", [*MOE, f"parallel.dp={n}", f"parallel.ep={n}"])]


def configs(args) -> list[tuple[str, dict]]:
    """Each row's configuration, validated for --nproc ranks; the user's keys (model.*,
    train.*) apply to every row (model.moe_* to the mixture of experts only)."""
    rows = []
    only = [x.strip() for x in (getattr(args, "only", None) or "").split(",") if x.strip()]
    chosen = [(name, o) for name, o in layouts(args.nproc) if not only or any(name.startswith(x) for x in only)]
    if not chosen:
        raise ConfigError("--only", args.only, f"matches no layout; names: {', '.join(n for n, _ in layouts(args.nproc))}")
    for name, overrides in chosen:
        moe = "model.preset=olmoe-1b-7b" in overrides
        mine = [o for o in args.overrides if moe or not o.strip().startswith("model.moe_")]
        cfg = load_config(args.config, [*SETTINGS, *overrides, *mine])
        cfg.run.nproc = args.nproc
        rows.append((name, validate(cfg, check_paths=False).to_dict()))
    return rows


class Layout:
    """One row's training step in this process: its mesh, model, optimizer and micro-batches."""

    def __init__(self, cfg_dict: dict):
        import torch

        from ndtrain.config import from_dict
        from ndtrain.data.batch import MicroBatch
        from ndtrain.mesh import ParallelMesh
        from ndtrain.parallel import context
        from ndtrain.parallel.parallelize import build
        from ndtrain.train.step import TrainStep
        from ndtrain.train.worker import mesh_shape

        self.cfg = cfg = from_dict(cfg_dict)
        t = cfg.train
        mesh = ParallelMesh.build(mesh_shape(cfg))
        args = cfg.model_args()
        self.step = TrainStep(build(args, mesh, cfg), cfg)
        g = torch.Generator().manual_seed(t.seed + mesh.dp_rank)
        tokens = torch.randint(0, args.vocab_size, (t.global_batch // mesh.dp_size, t.seq_len + 1), generator=g)
        rows = MicroBatch(tokens[:, :-1], tokens[:, 1:])
        if mesh.shape.cp > 1:
            rows = context.shard(rows, mesh.shape.cp, mesh.coord("cp"), args.mtp_depth)
        self.micro = rows.split(t.micro_batch)
        self.n_targets = float(t.global_batch * t.seq_len)

    def __call__(self) -> None:
        t = self.cfg.train
        loss = self.step.forward_backward(self.micro, self.n_targets)
        self.step.clip_grad_norm(t.grad_clip)
        self.step.optimizer_step(t.lr)
        self.step.par.reduce_loss(loss)

    def imbalance(self) -> float:
        """An MoE layout's routing imbalance in the last step (from the engine's own counts, not
        its time): per block, the slots the busiest expert-parallel rank ran over the mean,
        averaged over the blocks (every rank waits for the busiest at each all-to-all)."""
        lazy = self.step.par.routing_stats
        ep = self.cfg.parallel.ep
        if lazy is None or ep == 1:
            return 1.0
        stats = lazy.value()
        ratios = []
        for counts in stats["tokens_per_expert"]:
            per = len(counts) // ep
            ranks = [sum(counts[r * per:(r + 1) * per]) for r in range(ep)]
            ratios.append(max(ranks) / (sum(ranks) / ep))
        return statistics.fmean(ratios)


def _timed(fn, steps: int) -> float:
    import torch.distributed as dist

    from ndtrain.bench.compute import _slowest
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return _slowest((time.perf_counter() - t0) / steps)


def _worker(rows: list[tuple[str, dict]], rounds: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from ndtrain.bench import comm, compute
    from ndtrain.config import from_dict
    from ndtrain.launch import init_process, shutdown
    from ndtrain.mesh import MeshShape, ParallelMesh

    env = init_process("cpu")
    try:
        world = dist.get_world_size()
        group = ParallelMesh.build(MeshShape(dp_shard=world)).group("dp_shard")
        built = {name: Layout(cfg) for name, cfg in rows}
        train = from_dict(rows[0][1]).train
        for fn in built.values():
            _timed(fn, WARMUP_STEPS)
        times: dict[str, list[float]] = {name: [] for name in built}
        imbalance: dict[str, list[float]] = {name: [] for name in built}
        calibrations, collectives = [], []
        for _ in range(rounds):
            calibrations.append(compute.measure(train, env.local_world, torch.get_num_threads()))
            collectives += comm.measure_between(group, COMM_SIZES, env.device, COMM_KINDS)
            for name, fn in built.items():
                times[name].append(_timed(fn, steps))
                imbalance[name].append(fn.imbalance())
        return {"times": times, "compute": compute.median(calibrations), "comm": collectives, "n": world,
                "imbalance": {name: statistics.median(v) for name, v in imbalance.items()}}
    finally:
        shutdown()


def _cluster(result: dict):
    """This machine as the planner sees it, from the bench's own calibration."""
    from ndtrain.bench.comm import fits_of
    from ndtrain.plan.calibration import nearest
    from ndtrain.plan.cluster import THIS_MACHINE, Cluster, physical_memory

    rows = result["comm"]
    merged = []
    for key in {(r["kind"], r["size"]) for r in rows}:  # the median over rounds of each point
        same = [r for r in rows if (r["kind"], r["size"]) == key]
        merged.append({**same[0], "seconds": statistics.median(r["seconds"] for r in same)})
    n = result["n"]
    fits = {kind: {n: f} for kind, f in fits_of(merged, n).items()}
    model = result["compute"]
    peak = model.rate * model.ranks  # the node's matmul rate, for MFU
    link = nearest(fits["all_reduce"], n)
    return Cluster(THIS_MACHINE, {"fp32": peak, "bf16": peak, "fp16": peak, "fp64": peak / 2},
                   float(physical_memory()), os.cpu_count() or 1, link, link, shared_node=True, fits=fits,
                   source="bench plan", measured={model.ranks: model})


def predict(cfg_dict: dict, cluster, nproc: int, imbalance: float = 1.0):
    from ndtrain.config import from_dict
    from ndtrain.plan.planner import make_plan, plan_config

    cfg, device = plan_config(from_dict(cfg_dict), cluster, nproc)
    return make_plan(cfg, cfg.model_args(), device, imbalance=imbalance)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def report(rows, result: dict, cluster, nproc: int) -> tuple[list[str], float]:
    model = result["compute"]
    e = {d: dict(pts) for d, pts in model.profiles.items()}
    lines = [f"calibration (median of rounds, per rank, {model.threads} thread(s)): 1024³ matmul "
             f"{model.rate / 1e9:,.1f} GFLOP/s; ×{e['m'][128]:.2f} at m=128, ×{e['k'][128]:.2f} at k=128, "
             f"×{e['n'][128]:.2f} at n=128; elementwise {model.bandwidth / 1e9:,.1f} GB/s; an operation "
             f"{model.forward_op_s * 1e6:,.1f} µs forward, {model.backward_op_s * 1e6:,.1f} µs backward; optimizer "
             f"{model.optimizer_s * 1e9:,.2f} ns per parameter",
             f"{'layout':<22} {'predicted':>10} {'measured':>10} {'range':>15} {'pred/meas':>10}   "
             "predicted: compute + recompute / comm / bubble / optimizer"]
    worst = 1.0
    for name, cfg in rows:
        imbalance, times = result["imbalance"][name], result["times"][name]
        plan = predict(cfg, cluster, nproc, imbalance)
        measured = statistics.median(times)
        r = plan.step_time_s / measured
        worst = max(worst, r, 1 / r)
        st = plan.step
        comm = st.tp + st.cp + st.ep + st.pp_messages + st.dp
        label = f"{name} (routing {imbalance:.2f})" if imbalance != 1.0 else name
        low, high = min(times), max(times)
        lines.append(f"{label:<22} {plan.step_time_s:>9.3f}s {measured:>9.3f}s {low:>7.3f}–{high:.3f}s {r:>10.2f}   "
                     f"{st.compute + st.recompute:.3f} / {comm:.3f} / {st.bubble:.3f} / {st.optimizer:.3f}")
    return lines, worst


def run(args) -> int:
    from ndtrain.launch import launch_local, warn
    from ndtrain.plan import calibration
    from ndtrain.plan.compute import save

    if args.nproc < 2:
        raise ConfigError("--nproc", args.nproc, "every layout needs at least 2 ranks")
    for item in args.overrides:
        key = item.split("=", 1)[0].strip()
        if not (key.startswith("train.") or key.startswith("model.") or key == "data.cache_dir"):
            raise ConfigError(key, item.split("=", 1)[-1], "bench plan sets the layouts itself; give model.* "
                              "or train.* keys (they reach every layout), or data.cache_dir")
    rows = configs(args)
    cache_dir = load_config(args.config, [*SETTINGS, *args.overrides]).data.cache_dir
    cores = os.cpu_count() or 1
    warn([f"bench plan: {args.nproc} ranks on {cores} cores: the ranks share them" if args.nproc > cores else None])
    print(f"bench plan: {args.nproc} ranks · {len(rows)} layouts (model dim 384, 8 layers, vocab 4096; the ep row: "
          f"8 experts of 512, top-2, 4 layers) · batch 8×128 fp32 · {WARMUP_STEPS} warm-up steps, then "
          f"{args.rounds} rounds of: calibrate, then {args.steps} steps of each layout in turn · load {_load()}",
          flush=True)
    start = time.perf_counter()
    result = launch_local(args.nproc, _worker, rows, args.rounds, args.steps)[0]
    cluster = _cluster(result)
    path = save(cache_dir, result["compute"])
    calibration.save(cache_dir, calibration.machine_key("cpu", "gloo"), result["n"],
                     {kind: fits[result["n"]] for kind, fits in cluster.fits.items()})
    lines, worst = report(rows, result, cluster, args.nproc)
    print("\n".join(lines))
    print(f"calibration saved to {path} and {calibration.calibration_file(cache_dir)} (ndtrain plan --cluster "
          f"this-machine uses them with {args.nproc} local processes) · {time.perf_counter() - start:,.0f} s · "
          f"load {_load()}")
    print(f"ndtrain plan worst predicted/measured step time ratio: {worst:.2f}", flush=True)
    return 0
