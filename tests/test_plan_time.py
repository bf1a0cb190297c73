"""The step-time model moves the bytes the papers say each dimension moves (on an ideal link:
no latency, 1 GB/s of bus bandwidth, no overlap), and stretches a pipeline by its
schedule's bubble."""

import random

import pytest
import torch

from ndtrain.config import load_config, validate
from ndtrain.model.llama import Transformer
from ndtrain.plan.calibration import LinkFit
from ndtrain.plan.cluster import Cluster
from ndtrain.parallel.pipeline.simulate import theory_bubble
from ndtrain.plan.params import stage_chunks, stage_params
from ndtrain.plan.pipeline import _simulated, bubble_fraction, makespan
from ndtrain.plan.steptime import step_time
from ndtrain.testing import run_ranks

BETA = 1e9
IDEAL = Cluster("ideal", {"fp32": 1e15, "bf16": 1e15}, 1e12, 64, LinkFit(0.0, BETA), LinkFit(0.0, BETA),
                shared_node=True)  # shared: nothing overlaps, every byte counts
MODEL = ["model.preset=125M", "train.seq_len=512", "train.precision=fp32"]


def _time(world, *overrides):
    cfg = validate(load_config(None, MODEL + list(overrides)), world=world, check_paths=False)
    step, _ = step_time(cfg, cfg.model_args(), IDEAL)
    return cfg, step


@pytest.mark.parametrize("sp", ["true", "false"])
def test_tensor_parallel_moves_8bsh_per_layer(sp):
    """Narayanan et al. 2021 (section 3.2): 8·b·s·h·(t−1)/t values per layer and micro-batch,
    the same with sequence parallelism (Korthikanti et al. 2022, section 4.2.2); plus the
    embedding's exit and the head's entry, 4·b·s·h·(t−1)/t (what tests/test_tp.py measures)."""
    t, b = 4, 2
    cfg, step = _time(t, f"parallel.tp={t}", f"parallel.sp={sp}", f"train.global_batch={b}")
    a = cfg.model_args()
    bsh = 4 * b * 512 * a.dim  # bytes, fp32
    expected = (8 * a.n_layers + 4) * bsh * (t - 1) / t / BETA
    assert step.tp == pytest.approx(expected)


@pytest.mark.parametrize("zero, ratio", [(1, 1.0), (2, 1.0), (3, 1.5)])
def test_zero_moves_what_the_paper_says(zero, ratio):
    """Rajbhandari et al. 2020 (section 7): DP all-reduces 2Ψ; ZeRO-1 and -2 reduce-scatter and
    all-gather the same 2Ψ; ZeRO-3 gathers twice and reduce-scatters, 3Ψ: 1.5× DP."""
    cfg, dp = _time(8, "train.global_batch=8")
    _, zero_step = _time(8, f"parallel.zero={zero}", "train.global_batch=8")
    psi = stage_params(cfg, cfg.model_args(), stage_chunks(cfg, cfg.model_args())[0])
    # ZeRO's flat buffers start each parameter and each of the 8 slices at a multiple of 64
    # elements (parallel/placement.py): at most 63 elements per tensor and 63 per slice more.
    with torch.device("meta"):
        tensors = len(list(Transformer(cfg.model_args()).parameters()))
    gaps = 63 * (tensors + 8 * 2 * (cfg.model_args().n_layers + 1))
    assert zero_step.dp / dp.dp == pytest.approx(ratio, rel=gaps / psi)
    assert dp.dp == pytest.approx(2 * 7 / 8 * 4 * psi / BETA)  # a ring all-reduce of the fp32 gradients


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_under_a_pipeline_communicates_once_per_step(zero):
    """Under a pipeline ZeRO-2/3 are deferred (parallel/zero.py): a chunk's units are
    gathered once for the step and reduce-scattered once, however many micro-batches."""
    steps = [_time(4, "parallel.pp=2", f"parallel.zero={zero}", "train.global_batch=8", f"train.micro_batch={mb}")[1]
             for mb in (4, 1)]  # 2 and 8 micro-batches per rank
    assert steps[0].dp == pytest.approx(steps[1].dp) and steps[0].dp > 0


@pytest.mark.parametrize("schedule, virtual", [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zbv", 2),
                                               ("dualpipev", 2)])
def test_every_schedule_simulated_gives_its_theory_on_equal_stages(schedule, virtual):
    """The planner prices a pipeline by simulating the schedule's own action lists
    (plan/pipeline.py); with equal stages that is the theory: (p−1)/m for AFAB and 1F1B
    (Narayanan et al. 2021, section 2.2), (p−1)/(v·m) interleaved, (p−1)(F+B−W)/(m(F+B+W))
    for zero bubble (Qi et al. 2023), here with F = 1, B = 2 (zero bubble: B = W = 1)."""
    pp, m = 4, 8
    split = schedule in ("zb", "zbv", "dualpipev")
    f, b, w = (1.0, 1.0, 1.0) if split else (1.0, 2.0, 0.0)
    costs = ((f, b, w),) * (pp * virtual)
    span, fraction = bubble_fraction(schedule, pp, virtual, m, costs)
    assert fraction == pytest.approx(theory_bubble(schedule, pp, virtual, m, f, b, w))
    assert span == pytest.approx((1 + fraction) * m * virtual * (f + b + w))


@pytest.mark.parametrize("schedule, virtual", [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zbv", 2),
                                               ("dualpipev", 2)])
def test_many_micro_batches_extrapolate_exactly(schedule, virtual):
    """Past the warm-up a schedule repeats every pp micro-batches: three short simulations
    extrapolate to many micro-batches; on uneven stages it equals the whole simulation."""
    rng = random.Random(schedule)
    for pp in (2, 4):
        costs = tuple((rng.uniform(0.5, 1.5), rng.uniform(1, 3),
                       rng.uniform(0.3, 1) if schedule in ("zb", "zbv", "dualpipev") else 0.0)
                      for _ in range(pp * virtual))
        m = 12 * pp + (0 if schedule == "interleaved" else 3)
        assert makespan(schedule, pp, virtual, m, costs) == pytest.approx(_simulated(schedule, pp, virtual, m, costs),
                                                                          rel=1e-12)


def test_the_planned_step_is_the_simulated_pipeline():
    """Uneven stages (the last holds the head): the busiest stage waits less than the
    theory's (p−1)/m of its own time, the others more; the step is the simulated span plus
    what comes after the last backward."""
    _, step = _time(4, "parallel.pp=4", "parallel.pp_schedule=1f1b", "train.global_batch=8", "train.micro_batch=1")
    assert 0 < step.detail["bubble_fraction"] < 3 / 8
    assert step.bubble == pytest.approx(step.detail["bubble_fraction"] * step.busy)
    assert step.total == pytest.approx(step.busy + step.bubble + step.dp + step.optimizer)


# -- the data-parallel messages, against the engine's own collectives ------------------------

MESSAGE_LAYOUTS = {
    "dp": ["parallel.dp=2", "parallel.bucket_mb=0.1"],  # 100 KiB buckets: blocks of 148 KB get cut (tied)
    "dp-untied": ["parallel.dp=2", "parallel.bucket_mb=0.1", "model.tie_embeddings=false"],
    "zero1": ["parallel.zero=1"],
    "zero3": ["parallel.zero=3"],
}


def _messages_of_one_step(data_dir):
    from helpers import train_in_rank

    out = {}
    for name, overrides in MESSAGE_LAYOUTS.items():
        calls = []

        def probe(trainer):  # the collectives of the training step (not the final gathering of the model)
            record, train_step = trainer.mesh.stats.record, trainer.train_step

            def logged(dim, kind, nbytes, group_size):
                calls.append((dim, kind, nbytes))
                return record(dim, kind, nbytes, group_size)

            def step_logged(step):
                trainer.mesh.stats.record = logged
                try:
                    return train_step(step)
                finally:
                    trainer.mesh.stats.record = record
            trainer.train_step = step_logged
        train_in_rank(["train.steps=1"] + overrides, data_dir, before_fit=probe)
        out[name] = calls
    return out


def test_data_parallel_messages_are_the_engines(tiny_data):
    """The planner prices data-parallel traffic message by message (gloo's time per byte grows
    with the message; each message pays a latency): DP's buckets (parallel/data.py, packed
    in backward order, a parameter never split), ZeRO's flat buffers unit by unit
    (parallel/zero.py: each block, then the root, matrices and vectors apart). One fp32 step
    of the tiny model on 2 ranks issues exactly those messages: the same sizes, the same
    number of times (ZeRO-3 gathers each unit for forward and again for backward). The
    scalars (token count, loss, gradient norm) are not gradient traffic."""
    from helpers import TINY
    from ndtrain.plan.collectives import dp_messages

    measured = run_ranks(_messages_of_one_step, 2, tiny_data, timeout=300)[0]
    for name, overrides in MESSAGE_LAYOUTS.items():
        cfg = validate(load_config(None, TINY + ["train.steps=1", "model.vocab_size=512"] + overrides),
                       world=2, check_paths=False)
        args = cfg.model_args()
        planned = sorted(4 * n for n in dp_messages(cfg, args, stage_chunks(cfg, args)[0]))
        calls = measured[name]
        if name.startswith("dp"):
            assert len(planned) > args.n_layers, "the buckets must cut the blocks for this test to mean anything"
            buckets = sorted(n for dim, kind, n in calls if n > 64)
            assert {(dim, kind) for dim, kind, n in calls if n > 64} == {("dp_cp", "all_reduce")}
            assert buckets == planned, name
        else:
            gathers = 2 if name == "zero3" else 1
            assert sorted(n for _, kind, n in calls if kind == "reduce_scatter") == planned, name
            assert sorted(n for _, kind, n in calls if kind == "all_gather") == sorted(planned * gathers), name
            assert {dim for dim, kind, _ in calls if kind != "all_reduce"} == {"dp_shard_cp"}
            assert all(n <= 256 for _, kind, n in calls if kind == "all_reduce")  # scalars, the norm


def test_muons_iteration_is_priced_at_its_own_precision():
    """An fp32 run with Muon: its Newton–Schulz FLOPs at the bf16 peak (train.muon_ns_dtype =
    auto iterates in bf16), at the fp32 peak when the key says fp32; nothing else changes."""
    from ndtrain.parallel.muon import muon_matrices, ns_flops
    cluster = Cluster("fast-bf16", {"fp32": 1e14, "bf16": 4e14}, 1e12, 64, LinkFit(0.0, BETA), LinkFit(0.0, BETA),
                      shared_node=True)
    steps = {}
    for ns in ("auto", "fp32"):
        cfg = validate(load_config(None, MODEL + ["train.optimizer=muon", f"train.muon_ns_dtype={ns}"]), world=1,
                       check_paths=False)
        steps[ns] = step_time(cfg, cfg.model_args(), cluster)[0]
    flops = sum(ns_flops(a, b, 5) for a, b in muon_matrices(cfg.model_args()))
    gap = steps["fp32"].optimizer - steps["auto"].optimizer
    assert gap == pytest.approx(flops / cluster.efficiency * (1 / 1e14 - 1 / 4e14), rel=1e-9)
    assert steps["fp32"].compute == steps["auto"].compute and steps["fp32"].dp == steps["auto"].dp
