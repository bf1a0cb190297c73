"""`ndtrain bench pp`: our 1F1B, interleaved 1F1B, zero bubble, ZB-V and DualPipeV against
torch.distributed.pipelining's Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV, and the bubble
of each of our schedules next to its theory.

Same model, same split and weights, same micro-batches, same ranks: one training step's
forward and backward through the pipeline each (no optimizer: the schedule is what differs),
all ten contenders alternated round by round. Each pair runs the same chunks: interleaved
with v chunks per rank on both sides (`parallel.pp_virtual`, default 2), zero bubble with
one (torch's ScheduleInterleavedZeroBubble with one stage per rank is ZB-H1, as ours), ZB-V
and DualPipeV with two per rank in a V. The model's stages cost about the same (the
cost-balanced split; a small vocabulary keeps the head light by default) and each
micro-batch carries enough work for the timings to mean something. In bf16 both sides hold
the chunks in bf16 (no optimizer step, so no fp32 masters); `train.recompute` wraps the same
regions on both sides (torch's `checkpoint` on the anchor). A torch without one of the
anchors (DualPipeV came in torch 2.9) skips that pair and says so. Then bench/bubbles.py
measures each of our schedules' bubble.
"""

from __future__ import annotations

import inspect

from ndtrain.bench.bubbles import BUBBLE_STEPS, PACE_S, bubble_table, measure_bubbles, slowdown_when_sharing
from ndtrain.bench.common import (Bench, alternate, anchor_recompute, announce, bench_config, describe, report,
                                  synthetic_batch)
import torch

from ndtrain.config import ConfigError, validate
from ndtrain.data.batch import MicroBatch
from ndtrain.launch import init_process, launch_local, shutdown
from ndtrain.mesh import ParallelMesh
from ndtrain.model.loss import token_loss_sum
from ndtrain.parallel.parallelize import build, decoder, materialized
from ndtrain.parallel.pipeline.schedules import vshape
from ndtrain.parallel.pipeline.stage import build_chunks
from ndtrain.parallel.precision import compute_dtype
from ndtrain.train.worker import mesh_shape

MODEL = ("model.preset=small", "model.n_layers=8", "model.dim=256", "model.ffn_dim=768", "model.vocab_size=512")
SETTINGS = ("model.tie_embeddings=false", "train.seq_len=128", "train.global_batch=16", "train.micro_batch=2",
            "parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "run.progress=false")
BENCH = Bench("pp", MODEL, SETTINGS, ("model.", "train.seq_len", "train.global_batch", "train.micro_batch",
                                      "train.seed", "train.precision", "train.recompute", "parallel.pp",
                                      "parallel.pp_virtual", "run.device", "run.threads"))
# (our schedule, the anchor, chunks per rank: None = parallel.pp_virtual); the 1F1B pair's ratio comes last
CONTESTS = (("interleaved", "ScheduleInterleaved1F1B", None), ("zb", "ScheduleInterleavedZeroBubble", 1),
            ("zbv", "ScheduleZBVZeroBubble", 2), ("dualpipev", "ScheduleDualPipeV", 2),
            ("1f1b", "Schedule1F1B", 1))


def _with_schedule(cfg, name: str, virtual: int | None):
    c = cfg.copy()
    c.parallel.pp_schedule, c.parallel.pp_virtual = name, virtual or cfg.parallel.pp_virtual
    return c


def torch_v_schedules_run_on_gloo() -> bool:
    """torch 2.11's ScheduleZBVZeroBubble and ScheduleDualPipeV fail on gloo at their first
    step (the two stages in the middle of the V are on one rank: "Pair is not connected");
    2.13's run."""
    return torch.__version__ >= "2.13"


def _skipped(device_type: str) -> dict[str, str]:
    """The anchors this torch cannot run here, and why: an older torch lacks the newer ones,
    and torch_v_schedules_run_on_gloo."""
    import torch.distributed.pipelining as pipelining
    why = {a: f"torch {torch.__version__} has no {a}" for _, a, _ in CONTESTS if not hasattr(pipelining, a)}
    if device_type != "cuda" and not torch_v_schedules_run_on_gloo():
        for anchor in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
            why.setdefault(anchor, f"torch {torch.__version__}'s {anchor} fails on gloo")
    return why


def _contests(device_type: str = "cpu") -> list[tuple[str, str, int | None]]:
    """The pairs this torch can run on this device (_skipped: the others)."""
    skipped = _skipped(device_type)
    return [c for c in CONTESTS if c[1] not in skipped]


def _ours(cfg, args, mesh, micro, n_targets: float):
    par = build(args, mesh, cfg)

    def step():
        par.forward_backward(micro, n_targets)
        par.grad_sync.zero_grad()
    return step


def _anchor(cfg, args, mesh, cls_name: str, x, y, n_targets: float, m: int):
    """PipelineStage per chunk (same chunks, weights and dtype as ours) and torch's schedule."""
    import torch.distributed.pipelining as pipelining

    p = cfg.parallel
    chunks = build_chunks(args, mesh, cfg, decoder(args, mesh, cfg))
    stages = []
    for c, chunk in chunks.items():
        materialized(chunk, args, mesh, cfg)
        chunk.to(compute_dtype(cfg.train.precision, cfg.train.fp8_base))
        anchor_recompute(chunk, cfg.train.recompute)
        stages.append(pipelining.PipelineStage(chunk, c, p.pp * p.pp_virtual, mesh.device, group=mesh.group("pp").pg))
    cls = getattr(pipelining, cls_name)
    kwargs = {"scale_grads": False} if "scale_grads" in inspect.signature(cls).parameters else {}
    schedule = cls(stages[0] if cls_name == "Schedule1F1B" else stages, m,
                   loss_fn=lambda out, t: token_loss_sum(out, t) / n_targets, **kwargs)

    last = mesh.is_first_stage if vshape(p.pp_schedule) else mesh.is_last_stage  # a V ends where it starts

    def step():
        schedule.step(*((x,) if mesh.is_first_stage else ()), **({"target": y} if last else {}))
        for chunk in chunks.values():
            chunk.zero_grad(set_to_none=False)
    return step


def _worker(cfg_dict: dict, rounds: int, steps: int, out: str) -> str:
    from ndtrain.config import from_dict
    cfg = from_dict(cfg_dict)
    env = init_process(cfg.run.device, cfg.run.threads)
    try:
        mesh = ParallelMesh.build(mesh_shape(cfg), env.device)
        args, t = cfg.model_args(), cfg.train
        x, y = synthetic_batch(args, t.global_batch, t.seq_len, 0, env.device)  # the same rows on every stage
        m = t.global_batch // t.micro_batch
        micro = MicroBatch(x, y).split(t.micro_batch)
        n_targets = float(t.global_batch * t.seq_len)

        slowdown = slowdown_when_sharing(env.device)
        contenders, pairs = {}, []
        for name, anchor, virtual in _contests(env.device.type):
            c = _with_schedule(cfg, name, virtual)
            ours, theirs = f"ndtrain-{name}", f"torch-{anchor}"
            contenders[ours] = _ours(c, args, mesh, micro, n_targets)
            contenders[theirs] = _anchor(c, args, mesh, anchor, x, y, n_targets, m)
            pairs.append((ours, theirs))
        times = alternate(contenders, rounds, steps, env.device)
        real = measure_bubbles(cfg, args, mesh, micro, n_targets, BUBBLE_STEPS, out)
        # Paced: a small model (the same number of blocks, a light head) whose blocks each sleep
        # PACE_S per F, B and W, so the ranks' "compute" cannot slow each other down (see
        # bench/pacing.py), split into as many blocks per chunk.
        paced_args = args.with_(dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2, vocab_size=512)
        paced_micro = [MicroBatch(mb.tokens[:, :32] % 512, mb.targets[:, :32] % 512) for mb in micro]
        paced = measure_bubbles(cfg, paced_args, mesh, paced_micro, n_targets, BUBBLE_STEPS, out, PACE_S)
        if mesh.rank != 0:
            return ""
        lines = [f"{why}: that pair is skipped" for why in _skipped(env.device.type).values()]
        lines += [f"machine: a rank computes {slowdown:.2f}x slower while the other ranks compute than alone "
                 f"(1.00 = truly parallel; above, idle ranks speed the others up and bubbles read high)",
                 f"bubble = idle / busy time per rank over the step, median (best) of {BUBBLE_STEPS} steps; "
                 "replay = the median step's own action durations with free messages (the executor's cost is median − replay)"]
        lines += bubble_table(real, paced)
        tokens = t.global_batch * t.seq_len
        for ours, theirs in pairs:  # the 1F1B pair last: its ratio line keeps the historical label
            label = "ndtrain/torch-pipelining" if theirs == "torch-Schedule1F1B" else f"ndtrain/{theirs}"
            lines.append(report({ours: times[ours], theirs: times[theirs]}, tokens, "tok/s", label,
                                numerator=ours, denominator=theirs))
        return "\n".join(lines)
    finally:
        shutdown()


def run(args) -> int:
    cfg = bench_config(args, BENCH)
    t, p = cfg.train, cfg.parallel
    if p.dp != 1:
        raise ConfigError("--nproc", args.nproc, f"bench pp compares pipelines alone: use --nproc {p.pp} "
                          f"(= parallel.pp)")
    for name, _, virtual in CONTESTS:  # each schedule's own rules (DualPipeV: m ≥ 2·pp), before anything starts
        validate(_with_schedule(cfg, name, virtual), check_paths=False)
    announce(args, cfg, f"bench pp: {p.pp} stages (interleaved: {p.pp_virtual} chunks per rank; ZB-V, DualPipeV: 2) · "
                        f"{describe(cfg)} · {t.global_batch // t.micro_batch} micro-batches · "
                        f"{args.rounds} rounds × {args.steps} steps of {2 * len(CONTESTS)} contenders, alternating")
    print(launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps, args.out or "")[0])
    return 0
