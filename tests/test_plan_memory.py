"""The planner's memory per rank against what `ndtrain train --dry-run` measures, for every
layout of the layout-invariance matrix (tests/test_layouts.py::LAYOUTS; its default tier
here, the other rows under `-m slow`), and a few in bf16 and fp64, with Qwen3's block, under
context parallelism, and the tiny-moe model with its experts split over ep = 2 and 4 ranks.

One launch per world size runs `dry_run.measure` (two steps on random tokens, the second
measured: observe/memory.py) on every row of that size; the planner (plan/memory.py) then
predicts each rank from the configuration alone. Tolerance: 5% on each model state
(parameters, gradients, optimizer) and on the rank's peak (the states held when the step
begins plus the activation peak: `total` against the dry run's `peak`), and 15% on the
activation peak alone (measured within 5.9% for the matrix and 8.5% for the rows beside it,
full recomputation under CP being the least closely modelled; the CPU peak of a step also
moves by a tensor or two from run to run with the timing of asynchronous collectives). The
largest activation gap of each world size is printed (-s).
"""

import pytest

from helpers import TINY
from ndtrain.config import load_config, validate
from ndtrain.plan.memory import per_rank
from ndtrain.testing import run_ranks
from test_layouts import LAYOUTS, tier

TOLERANCE = 0.05
BASE = TINY + ["model.vocab_size=512"]
# Beyond the matrix (fp32, Llama blocks): bf16 and fp64, Qwen3's block (q/k norms, head_dim ≠
# dim / heads), context parallelism (whose back ends hold copies of q, K/V and fp32
# accumulators around their fused attention blocks while they run), and mixtures of experts
# (the routed experts' states split over ep and sharded over dp_shard·cp/ep, the slots'
# activations). A few rows: each one costs the suite a dry run.
EXTRA = [("qwen3-bf16-zero3", ["model.qk_norm=true", "model.head_dim=32", "parallel.zero=3", "train.precision=bf16"]),
         ("fp64-dp2", ["train.precision=fp64"]),
         ("cp2-allgather", ["parallel.cp=2", "parallel.cp_impl=allgather"]),
         ("cp2-ring-recompute-full-s256", ["parallel.cp=2", "train.recompute=full", "train.seq_len=256",
                                           "train.global_batch=2"]),
         ("tiny-moe-ep2", ["model.preset=tiny-moe", "parallel.ep=2"])]
EXTRA_4 = [("cp2-tp2-ulysses", ["parallel.cp=2", "parallel.tp=2", "parallel.cp_impl=ulysses"]),
           ("cp2-pp2-zb-allgather-bf16", ["parallel.cp=2", "parallel.pp=2", "parallel.pp_schedule=zb",
                                          "train.micro_batch=2", "parallel.cp_impl=allgather", "train.precision=bf16"]),
           ("tiny-moe-ep4-zero1", ["model.preset=tiny-moe", "parallel.ep=4", "parallel.zero=1"])]
# The default tier measures the layout matrix's default rows and the extra ones; the slow tier
# the rest of the matrix.
# At 2 ranks the default tier measures one row of each family of the matrix's default rows
# (the others join the slow tier's rows).
FAMILIES_2 = {"dp2-accumulation", "pp2-1f1b-m4", "pp2-zb-m4", "pp2-dualpipev-m4-pp_virtual=2-preset=small",
              "zero3-accumulation-keep-gathered", "tp2-sp"}
ROWS = {world: [row for row in tier(world, slow=False) if world != 2 or row[0] in FAMILIES_2]
        + {2: EXTRA, 4: EXTRA_4}.get(world, []) for world in LAYOUTS}
SLOW_ROWS = {world: tier(world, slow=True) + [row for row in tier(world, slow=False) if world == 2 and row[0] not in FAMILIES_2]
             for world in LAYOUTS}


def _config(overrides, world):
    return validate(load_config(None, BASE + overrides), world=world, check_paths=False)


def _measure_rows(rows):
    import torch.distributed as dist

    from ndtrain.mesh import ParallelMesh
    from ndtrain.train.dry_run import measure
    from ndtrain.train.worker import mesh_shape

    world = dist.get_world_size()
    out = {}
    for name, overrides in rows:
        cfg = _config(overrides, world)
        out[name] = measure(cfg, ParallelMesh.build(mesh_shape(cfg)))["ranks"]
    return out


@pytest.mark.parametrize("world", [w if w == 2 else pytest.param(w, marks=pytest.mark.slow) for w in sorted(ROWS)])
def test_planned_memory_matches_the_dry_run(world):
    _check_rows(world, ROWS[world])


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SLOW_ROWS))
def test_planned_memory_matches_the_dry_run_every_row(world):
    _check_rows(world, SLOW_ROWS[world])


def _check_rows(world, rows):
    measured = run_ranks(_measure_rows, world, rows, timeout=600)[0]
    failures, worst = [], (0.0, "")
    for name, overrides in rows:
        cfg = _config(overrides, world)
        stages = per_rank(cfg, cfg.model_args())
        per_stage = world // cfg.parallel.pp  # ranks are laid out with pp outermost
        for rank, m in enumerate(measured[name]):
            plan = stages[rank // per_stage]
            pairs = {"params": (plan.params, m["params"]), "grads": (plan.grads, m["grads"]),
                     "optimizer": (plan.optimizer, m["optimizer"]), "peak": (plan.total, m["peak"])}
            assert plan.params_count == m["psi"], f"{name} rank {rank}: parameters {plan.params_count} vs {m['psi']}"
            for what, (ours, theirs) in pairs.items():
                error = ours / theirs - 1
                if abs(error) > TOLERANCE:
                    failures.append(f"{name} rank {rank} {what}: planned {ours:,.0f} measured {theirs:,} ({error:+.1%})")
            act = plan.activations / m["activations"] - 1
            if abs(act) > 3 * TOLERANCE:
                failures.append(f"{name} rank {rank} activations: planned {plan.activations:,.0f} "
                                f"measured {m['activations']:,} ({act:+.1%})")
            worst = max(worst, (abs(act), f"{name} rank {rank}: activations {act:+.1%}"))
    print(f"\nworld {world}: largest activation-only gap {worst[1]}")
    assert not failures, "\n".join(failures)


# DeepSeek-V3's block (latent attention, group-limited routing, a dense first block) under
# tensor and expert parallelism, and with its MTP module under ZeRO-1 (issue 35): the slow tier.
DEEPSEEK = ["model.preset=deepseek-v3-tiny", "model.mtp_depth=0"]
DEEPSEEK_ROWS = [("deepseek-v3-tiny-tp2", DEEPSEEK + ["parallel.tp=2"]),
                 ("deepseek-v3-tiny-ep2-bf16", DEEPSEEK + ["parallel.ep=2", "train.precision=bf16"]),
                 ("deepseek-v3-tiny-mtp-zero1", ["model.preset=deepseek-v3-tiny", "parallel.zero=1"]),
                 # the MTP module and its copy of the embedding on the last stage
                 ("deepseek-v3-tiny-mtp-pp2", ["model.preset=deepseek-v3-tiny", "parallel.pp=2"])]


@pytest.mark.slow
def test_planned_memory_matches_the_dry_run_deepseek():
    _check_rows(2, DEEPSEEK_ROWS)


@pytest.mark.parametrize("family", ["tiny", "gemma2-norms", "olmo2-norms", "qwen2-bias", "qwen3-qk-norm", "tiny-moe",
                                    "deepseek-v3-tiny", "gpt-oss-tiny"])
def test_the_planners_block_holds_the_models_parameters(family):
    """Every block's dense and routed-expert parameter counts (plan/params.py) against the
    block the model builds, on the meta device, layer by layer: Gemma 2's norms after the
    sublayers once went uncounted (2·dim per layer)."""
    import dataclasses

    import torch

    from ndtrain.model.args import PRESETS
    from ndtrain.model.llama import Transformer
    from ndtrain.plan.params import block_experts, block_local
    shapes = {"gemma2-norms": dict(sandwich_norm=True), "olmo2-norms": dict(sandwich_norm=True, pre_norm=False),
              "qwen2-bias": dict(qkv_bias=True), "qwen3-qk-norm": dict(qk_norm=True)}
    args = PRESETS[family if family in PRESETS else "tiny"]
    args = dataclasses.replace(args, **shapes.get(family, {}))
    with torch.device("meta"):
        model = Transformer(args)
    for i, block in enumerate(model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers):
        experts = sum(p.numel() for n, p in block.named_parameters() if ".experts." in f".{n}")
        dense = sum(p.numel() for p in block.parameters()) - experts
        assert (block_local(args, 1, i), block_experts(args, i, 1)) == (dense, experts), f"{family} layer {i}"
