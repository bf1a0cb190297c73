"""`ndtrain plan` on mixtures of experts and in fp8: published parameter counts, expert
states split over ep, the all-to-all, `--search` over ep, fp8 peaks, weight copies and
all-gather bytes, and the input each refuses. (The memory of tiny-moe under ep = 2 and 4
against the engine's dry run: tests/test_plan_memory.py.)"""

import json

import pytest

from ndtrain.cli import main
from ndtrain.config import load_config, validate
from ndtrain.plan.calibration import LinkFit
from ndtrain.plan.cluster import PRESETS, Cluster
from ndtrain.plan.fp8 import Fp8
from ndtrain.plan.params import stage_chunks
from ndtrain.plan.search import candidates, search
from ndtrain.plan.steptime import step_time

# Mixtral 8x7B (Jiang et al. 2024, arXiv 2401.04088; Mistral's release: 46.7B parameters, 12.9B
# active per token): Mistral 7B's shape, 8 experts of 14,336 in every block, top-2, untied.
MIXTRAL = ["model.preset=olmoe-1b-7b", "model.dim=4096", "model.n_layers=32", "model.n_heads=32",
           "model.n_kv_heads=8", "model.ffn_dim=14336", "model.moe_ffn_dim=14336", "model.moe_experts=8",
           "model.moe_top_k=2", "model.vocab_size=32000"]
# OLMoE-1B-7B (Muennighoff et al. 2024, arXiv 2409.02060: 6.9B parameters, 1.3B active): the preset
# (without OLMoE's q/k norms, 65K parameters).
OLMOE = ["model.preset=olmoe-1b-7b"]
BATCH = ["train.precision=bf16", "train.seq_len=4096", "train.global_batch=64", "train.micro_batch=1"]


def _plan(capsys, *argv):
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("shape, total, active", [(MIXTRAL, 46.7, 12.9), (OLMOE, 6.9, 1.3)], ids=["mixtral", "olmoe"])
def test_published_total_and_active_parameters(capsys, shape, total, active):
    code, out, _ = _plan(capsys, "--cluster", "H100", "--gpus", "8", "--json", *shape, *BATCH, "parallel.ep=8",
                         "parallel.zero=1")
    assert code == 0
    plan = json.loads(out)
    assert abs(plan["params"] / 1e9 - total) <= 0.05 and abs(plan["active_params"] / 1e9 - active) <= 0.05
    # FLOPs per token from the active parameters: 6 per active weight, plus the attention scores
    per_token = plan["model_flops_per_step"] / (64 * 4096)
    assert 6 * plan["active_params"] < per_token < 6 * plan["active_params"] * 1.15


def _moe(capsys, *extra):
    code, out, err = _plan(capsys, "--cluster", "H100", "--gpus", "8", "--json", *MIXTRAL, *BATCH, "parallel.zero=1",
                           "train.recompute=full", *extra)
    assert code == 0, err
    return json.loads(out)


def test_experts_split_over_ep_and_their_all_to_all(capsys):
    """Expert states split over ep (dense ones over dp by ZeRO): the parameters one rank holds
    are the dense ones plus E/ep experts; the all-to-all appears with ep > 1 and grows with the
    load imbalance, as do the experts' matmuls on the busiest rank."""
    one, eight = _moe(capsys, "parallel.ep=1"), _moe(capsys, "parallel.ep=8")
    experts = 32 * 8 * 3 * 4096 * 14336
    assert one["memory_per_stage"][0]["params_count"] - eight["memory_per_stage"][0]["params_count"] == 7 * experts // 8
    assert one["step_time_model_s"]["ep"] == 0 < eight["step_time_model_s"]["ep"]
    skewed = _moe(capsys, "parallel.ep=8", "--moe-imbalance", "1.5")
    assert skewed["step_time_model_s"]["ep"] > 1.3 * eight["step_time_model_s"]["ep"]
    assert skewed["step_time_model_s"]["compute"] > eight["step_time_model_s"]["compute"]
    assert skewed["moe_imbalance"] == 1.5


@pytest.mark.slow  # the search's other layouts stay in the default tier
def test_search_tries_expert_parallelism():
    """Candidates vary ep over the powers of two dividing the experts (a dense model: 1 only);
    what the search proposes passes `validate` as train would."""
    moe = load_config(None, ["model.preset=tiny-moe", "train.seq_len=64", "train.global_batch=4"])
    dense = load_config(None, ["model.preset=tiny", "train.seq_len=64", "train.global_batch=4"])

    def eps(cfg):
        return {o for c in candidates(cfg, cfg.model_args(), 4, 8) for o in c if o.startswith("parallel.ep")}
    assert eps(moe) == {"parallel.ep=1", "parallel.ep=2", "parallel.ep=4"} and eps(dense) == {"parallel.ep=1"}
    found, _, _ = search(moe, moe.model_args(), PRESETS["A100-40GB"], 2, top=1000)
    assert {f.plan.cfg.parallel.ep for f in found} == {1, 2}
    for f in found:
        validate(f.plan.cfg.copy(), world=2, check_paths=False)


# -- fp8 -----------------------------------------------------------------------------------

EIGHT_B = ["model.preset=8B", "train.seq_len=4096", "train.global_batch=64", "train.micro_batch=1", "parallel.tp=8"]


def test_fp8_runs_the_block_matmuls_at_the_fp8_peak(capsys):
    plans = {}
    for precision in ("bf16", "fp8"):
        code, out, err = _plan(capsys, "--cluster", "H100", "--gpus", "8", "--json", *EIGHT_B,
                               f"train.precision={precision}")
        assert code == 0, err
        plans[precision] = json.loads(out)
    bf16, fp8 = plans["bf16"], plans["fp8"]
    assert fp8["train"]["precision"] == "fp8" and fp8["train"]["fp8_recipe"] == "tensorwise"
    # the blocks' linears are most of the FLOPs: their time halves, the head and attention stay
    ratio = fp8["step_time_model_s"]["compute"] / bf16["step_time_model_s"]["compute"]
    assert 0.5 < ratio < 0.65
    # the weights' fp8 copies (one byte each) come on top of bf16's memory
    blocks = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336) // 8
    assert fp8["memory_at_peak"]["fp8 weight copies"] == pytest.approx(blocks, rel=1e-3)
    assert fp8["memory_per_rank"]["params"] == bf16["memory_per_rank"]["params"]  # bf16 states
    code, out, _ = _plan(capsys, "--cluster", "H100", "--gpus", "8", *EIGHT_B, "train.precision=fp8",
                         "train.fp8_recipe=blockwise")
    assert "fp8 (blockwise)" in out and "1,979.0 TFLOP/s fp8 peak" in out


def test_fp8_all_gathers_carry_one_byte_per_linear_weight():
    """ZeRO-3 with train.fp8_all_gather: the blocks' linear weights travel in fp8, the rest
    (norms, embedding, head) in bf16: on an ideal link (no latency, nothing overlapped) the
    gathers cost what those bytes cost."""
    ideal = Cluster("ideal", {"bf16": 1e15, "fp32": 1e15, "fp8": 2e15}, 1e12, 64, LinkFit(0.0, 1e9), LinkFit(0.0, 1e9),
                    shared_node=True)
    cfg = validate(load_config(None, ["model.preset=125M", "train.seq_len=512", "train.precision=bf16",
                                      "parallel.zero=3", "train.global_batch=8"]), world=8, check_paths=False)
    args = cfg.model_args()
    plain = step_time(cfg, args, ideal, Fp8())[0].dp
    gathered = step_time(cfg, args, ideal, Fp8(all_gather=True))[0].dp
    blocks = 12 * (768 * 768 * 2 + 768 * 256 * 2 + 3 * 768 * 2048)
    gather = 2 * 7 / 8 / 1e9  # ZeRO-3 gathers twice per micro-batch (one here); 7/8 of the bytes move
    assert plain - gathered == pytest.approx(gather * blocks * (2 - 1), rel=0.01)
    assert stage_chunks(cfg, args)  # one stage


@pytest.mark.parametrize("argv, key, rule", [
    (["--cluster", "A100-80GB", "train.precision=fp8"], "train.precision = 'fp8'", "no fp8 matmul rate"),
    (["--cluster", "H100", "train.precision=fp8", "train.fp8_recipe=mxfp8"], "train.fp8_recipe = 'mxfp8'",
     "has no block-scaled (MX) tensor cores to plan with"),
    (["--cluster", "H100", "train.precision=fp8", "train.fp8_recipe=mx"], "train.fp8_recipe = 'mx'",
     "choose one of"),
    (["--cluster", "H100", "train.precision=fp8", "train.fp8_all_gather=true"], "train.fp8_all_gather = 'true'",
     "needs parallel.zero=3"),
    (["--cluster", "H100", "train.precision=fp8", "train.fp8_recipe=rowwise", "train.fp8_all_gather=true",
      "parallel.zero=3"], "train.fp8_all_gather = 'true'", "needs train.fp8_recipe=tensorwise"),
    (["--cluster", "H100", "train.precision=bf16", "train.fp8_recipe=rowwise"], "train.fp8_recipe = 'rowwise'",
     "applies only with train.precision=fp8"),
    (["--cluster", "H100", "--moe-imbalance", "0.5", *OLMOE], "--moe-imbalance = 0.5", "must be ≥ 1"),
    (["--cluster", "H100", "--moe-imbalance", "1.2", "model.preset=8B"], "--moe-imbalance = 1.2", "has no experts"),
])
def test_refused(capsys, argv, key, rule):
    code, out, err = _plan(capsys, *argv)
    assert code == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and key in line and rule in line, line
