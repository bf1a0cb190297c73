"""The planner reproduces the published tables of the papers that defined its formulas.

Each test quotes its source, the table and the cells it checks. GB here are the papers'
10^9 bytes.
"""

import pytest

from ndtrain.config import load_config
from ndtrain.model.args import PRESETS, flops_per_token, param_count
from ndtrain.parallel.zero import model_state_bytes
from ndtrain.plan.activations import korthikanti_bytes_per_token
from ndtrain.plan.cluster import PRESETS as CLUSTERS
from ndtrain.plan.formulas import (gpt_matmul_params, gpt_params, megatron_flops_per_token, mfu,
                                   narayanan_training_seconds, training_flops_per_token, zero_states)
from ndtrain.plan.planner import Rate, make_plan, plan_config

# --------------------------------------------------------------------------------------
# Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
# Models", Table 1: per-device memory (GB) of model states with mixed-precision Adam (K = 12)
# by DP degree Nd: baseline, P_os, P_os+g, P_os+g+p.
ZERO_TABLE_1 = {
    7.5e9: {1: (120, 120, 120, 120), 4: (120, 52.5, 41.3, 30), 16: (120, 35.6, 21.6, 7.5),
            64: (120, 31.4, 16.6, 1.88), 256: (120, 30.4, 15.4, 0.47), 1024: (120, 30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048, 2048), 4: (2048, 896, 704, 512), 16: (2048, 608, 368, 128),
            64: (2048, 536, 284, 32), 256: (2048, 518, 263, 8), 1024: (2048, 513, 257, 2)},
    1e12: {1: (16000, 16000, 16000, 16000), 4: (16000, 7000, 5500, 4000), 16: (16000, 4750, 2875, 1000),
           64: (16000, 4187, 2218, 250), 256: (16000, 4046, 2054, 62.5), 1024: (16000, 4011, 2013, 15.6)},
}


@pytest.mark.parametrize("psi", sorted(ZERO_TABLE_1))
def test_zero_table_1(psi):
    for nd, row in ZERO_TABLE_1[psi].items():
        for stage, published in enumerate(row):
            ours = zero_states(psi, stage, nd) / 1e9  # the paper's 2Ψ + 2Ψ + 12Ψ
            assert abs(ours - published) <= max(1.0, 0.005 * published), (psi, nd, stage, ours, published)
            # the engine's accounting: the same terms with bf16 gradients accumulated in fp32
            engine = sum(model_state_bytes(int(psi), stage, nd, compute_bytes=2).values())
            assert engine == pytest.approx(zero_states(psi, stage, nd, grad_bytes=4))


# --------------------------------------------------------------------------------------
# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models".
# Table 2: activation bytes per transformer layer (16-bit activations, 1-byte dropout masks).
# Table 3: the configurations (a heads, h hidden, L layers, t tensor parallel, p pipeline,
# GPUs, global batch B, micro-batch b; s = 2048, V = 51200).
# Table 5: iteration time with selective recomputation + SP (s) and model FLOPs utilisation.
KORTHIKANTI = {  # name: (a, h, L, t, p, GPUs, B, b, seconds, MFU %)
    "22B": (64, 6144, 48, 8, 1, 8, 4, 4, 1.10, 41.5),
    "175B": (96, 12288, 96, 8, 8, 64, 64, 1, 13.75, 51.4),
    "530B": (128, 20480, 105, 8, 35, 280, 280, 1, 37.83, 56.0),
    "1T": (160, 25600, 128, 8, 64, 512, 512, 1, 71.49, 56.3),
}
S, V = 2048, 51200


def _table_2(s, b, h, a, t):
    """Table 2's rows, as published."""
    return {
        ("none", 1, False): s * b * h * (34 + 5 * a * s / h),
        ("none", t, False): s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        ("none", t, True): s * b * h * (34 / t + 5 * a * s / (h * t)),
        ("selective", t, False): s * b * h * (10 + 24 / t),
        ("selective", t, True): s * b * h * 34 / t,
        ("full", t, True): 2 * s * b * h,
    }


@pytest.mark.parametrize("name", list(KORTHIKANTI))
def test_korthikanti_table_2_activations_per_layer(name):
    a, h, _, t, _, _, _, b, _, _ = KORTHIKANTI[name]
    for (mode, tp, sp), published in _table_2(S, b, h, a, t).items():
        ours = korthikanti_bytes_per_token(h, a, S, tp, sp, mode) * S * b
        assert ours == pytest.approx(published, rel=1e-12), (name, mode, tp, sp)


@pytest.mark.parametrize("name", list(KORTHIKANTI))
def test_korthikanti_table_5_mfu(name):
    """The MFU follows from the iteration time and the configuration (A100: 312 TFLOP/s),
    with the 6N + 12·L·h·s FLOPs per token of the paper's appendix, within 0.3 points."""
    a, h, layers, t, p, gpus, batch, _, seconds, published = KORTHIKANTI[name]
    per_token = training_flops_per_token(gpt_matmul_params(layers, h, V), layers, h, S, causal=False)
    # the appendix's closed form: 72·B·s·L·h²·(1 + s/(6h) + V/(12·h·L)) per iteration
    assert per_token * batch * S == pytest.approx(72 * batch * S * layers * h**2 * (1 + S / (6 * h) + V / (12 * h * layers)))
    ours = 100 * mfu(per_token * batch * S, seconds, gpus, CLUSTERS["A100-80GB"].peak["bf16"])
    assert abs(ours - published) <= 0.3, (name, ours, published)


@pytest.mark.parametrize("name, hfu", [("22B", 43.7), ("175B", 52.8), ("530B", 57.0), ("1T", 57.0)])
def test_korthikanti_table_5_mfu_and_hfu_of_the_same_runs(name, hfu):
    """Table 5 reports both conventions for each run (selective recomputation + SP): the model
    FLOPs give the MFU column, the hardware FLOPs (recomputation included) the HFU column, from
    the same iteration time, within 0.15 points (the published figures have one decimal)."""
    a, h, layers, t, p, gpus, batch, _, seconds, published_mfu = KORTHIKANTI[name]
    peak = CLUSTERS["A100-80GB"].peak["bf16"]
    model = megatron_flops_per_token(layers, h, V, S) * batch * S
    hardware = megatron_flops_per_token(layers, h, V, S, "selective") * batch * S
    assert model == pytest.approx(training_flops_per_token(gpt_matmul_params(layers, h, V), layers, h, S,
                                                           causal=False) * batch * S)
    assert abs(100 * mfu(model, seconds, gpus, peak) - published_mfu) <= 0.3
    assert abs(100 * mfu(hardware, seconds, gpus, peak) - hfu) <= 0.15, (name, 100 * mfu(hardware, seconds, gpus, peak))


# --------------------------------------------------------------------------------------
# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM", Table 1 (weak scaling, V = 51200, s = 2048): parameters (billions),
# heads, hidden size, layers, tensor and pipeline parallel size, GPUs, batch, achieved
# TFLOP/s per GPU, aggregate PFLOP/s.
NARAYANAN_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 4.4),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 8.8),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 18.2),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 34.6),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 70.8),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 143.8),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 227.1),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 297.4),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 410.2),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 502.0),
]


@pytest.mark.parametrize("row", NARAYANAN_TABLE_1, ids=[f"{r[0]}B" for r in NARAYANAN_TABLE_1])
def test_narayanan_table_1(row):
    billions, heads, h, layers, t, p, gpus, batch, tflops, pflops = row
    assert abs(gpt_params(layers, h, V, S) / 1e9 - billions) <= 0.1
    # the paper's closed form, P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)), differs by the final norm only
    closed = 12 * layers * h**2 * (1 + 13 / (12 * h) + (V + S) / (12 * layers * h))
    assert gpt_params(layers, h, V, S) - closed == pytest.approx(2 * h)
    assert tflops * gpus / 1e3 == pytest.approx(pflops, rel=0.01)


# Narayanan et al. 2021, section 5.1 ("Estimating end-to-end training time"): 8·T·P/(n·X),
# their published hardware rates (full recomputation). GPT-3 175B on T = 300B tokens, 1,024
# GPUs at 140 TFLOP/s: about 34 days; the 1T model of Table 1 on 450B tokens, 3,072 GPUs at
# 163 TFLOP/s: about 84 days. The planner gets the days from `--hfu-tflops` and the layout:
# the same shapes as Llama blocks of the same 12h² parameters (4h² attention + a SwiGLU of
# 8h²), untied, V = 51200, s = 2048, full recomputation (the 1T run with a smaller batch than
# its 3,072: the days do not depend on it, and its memory replay costs the suite less).
NARAYANAN_RUNS = {  # name: (layers, hidden, heads, P, T, GPUs, TFLOP/s, days, tp, pp, global batch)
    "GPT-3 175B": (96, 12288, 96, 175e9, 300e9, 1024, 140, 34, 8, 8, 1536),
    "1T": (128, 25600, 160, 1008.0e9, 450e9, 3072, 163, 84, 8, 64, 96),
}


@pytest.mark.parametrize("name", list(NARAYANAN_RUNS))
def test_narayanan_end_to_end_training_time(name):
    layers, h, heads, params, tokens, gpus, tflops, days, tp, pp, batch = NARAYANAN_RUNS[name]
    closed = narayanan_training_seconds(tokens, params, gpus, tflops * 1e12) / 86400
    assert abs(closed - days) <= 0.5, closed
    shape = [f"model.n_layers={layers}", f"model.dim={h}", f"model.n_heads={heads}", f"model.n_kv_heads={heads}",
             f"model.ffn_dim={round(8 * h / 3 / tp) * tp}", f"model.vocab_size={V}", "model.tie_embeddings=false"]
    cfg, device = plan_config(load_config(None, ["model.preset=8B", *shape, f"train.seq_len={S}",
                                                 f"train.global_batch={batch}", "train.micro_batch=1",
                                                 "train.precision=bf16", "train.recompute=full", f"parallel.tp={tp}",
                                                 f"parallel.pp={pp}", "parallel.zero=1"]), CLUSTERS["A100-80GB"], gpus)
    args = cfg.model_args()
    assert param_count(args, embedding=False) == pytest.approx(params, rel=0.01)
    hardware = make_plan(cfg, args, device, rate=Rate(tflops, utilization=False, hardware=True), tokens=tokens)
    # 8·P per token plus what the closed form leaves out: the attention scores (8·L·s·h, causal
    # half, recomputed once) and the head, which is not recomputed: within 2%
    assert hardware.days == pytest.approx(closed, rel=0.02)
    assert hardware.hfu_tflops_per_gpu == pytest.approx(tflops)
    # read as a model-FLOPs rate (--tflops), the same number gives about 6/8 of the days
    model = make_plan(cfg, args, device, rate=Rate(tflops, utilization=False, hardware=False), tokens=tokens)
    assert model.days / hardware.days == pytest.approx(model.flops_per_step / model.hardware_flops_per_step)
    assert model.days / hardware.days == pytest.approx(6 / 8, rel=0.02)
    assert hardware.hfu / hardware.mfu == pytest.approx(hardware.hardware_flops_per_step / hardware.flops_per_step)


# --------------------------------------------------------------------------------------
# Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models"), Table 4, first two rows: 8,192
# GPUs at TP 8, CP 1, PP 16, DP 64, sequence 8,192, 16M tokens per batch, 430 TFLOP/s per
# GPU, 43% BF16 MFU; 16,384 GPUs at DP 128, 400 TFLOP/s, 41%. The 405B shape: 126 layers,
# dim 16,384, FFN 53,248, 128 heads, 8 KV heads, vocabulary 128,000; H100 peak 989 TFLOP/s.
LLAMA3_405B = ["model.preset=8B", "model.n_layers=126", "model.dim=16384", "model.ffn_dim=53248",
               "model.n_heads=128", "model.n_kv_heads=8", "model.vocab_size=128000", "train.seq_len=8192",
               "train.global_batch=2048", "train.micro_batch=1", "train.precision=bf16",
               "parallel.tp=8", "parallel.pp=16", "parallel.zero=1"]


@pytest.mark.parametrize("gpus, tflops, published", [(8192, 430, 43), (16384, 400, 41)])
def test_llama3_table_4(gpus, tflops, published):
    cfg, device = plan_config(load_config(None, LLAMA3_405B), CLUSTERS["H100-SXM"], gpus)
    assert cfg.parallel.dp == gpus // 128
    args = cfg.model_args()
    assert param_count(args) / 1e9 == pytest.approx(405, rel=0.01)
    plan = make_plan(cfg, args, device, rate=Rate(tflops, utilization=False, hardware=False), tokens=15.6e12)
    assert abs(100 * plan.mfu - published) <= 1.0
    assert plan.tflops_per_gpu == pytest.approx(tflops)
    # the days follow from the rate: 15.6T tokens at the given throughput
    assert plan.days == pytest.approx(15.6e12 * flops_per_token(args, 8192) / (tflops * 1e12 * gpus) / 86400)


def test_flops_per_token_is_six_n_plus_attention():
    """ndtrain's MFU counts the causal half of the attention scores: 6N + 6·L·h·s, with N
    the parameters a token goes through (an MoE model's active ones: fewer than all). Not
    for the presets where attention is priced otherwise: windowed layers (gpt-oss; counted
    against torch's FlopCounterMode in tests/test_flops.py), latent attention's q·k-wide
    scores and v-wide values, and MTP modules' extra pass (deepseek-v3)."""
    for a in (a for a in PRESETS.values() if not (a.is_mla or a.mtp_depth or a.sliding_window)):
        n = param_count(a, embedding=False, active=True)
        assert n < param_count(a, embedding=False) if a.is_moe else n == param_count(a, embedding=False)
        assert flops_per_token(a, 2048) == training_flops_per_token(n, a.n_layers, a.dim, 2048, causal=True)


# --------------------------------------------------------------------------------------
# Megatron-Bridge performance summary (archive, NeMo 26.04.01): Llama3-70B on 64 GB200s in
# FP8 (current scaling), MXFP8 and NVFP4: 4,224 / 3,712 / 4,864 tokens/s per GPU at 1,892 /
# 1,664 / 2,202 model TFLOP/s per GPU (shared/research/frontier-2026-11.md, section 3). Llama3-70B:
# 80 layers, dim 8,192, FFN 28,672, 64 heads, 8 KV heads, vocabulary 128,256, sequence 8,192.
# Given each row's MFU against the GB200's dense bf16 peak (2,500 TFLOP/s), the planner's
# tokens/s per GPU are within 15% of the published ones (issue 38).
LLAMA3_70B = ["model.preset=8B", "model.n_layers=80", "model.dim=8192", "model.ffn_dim=28672", "model.n_heads=64",
              "model.n_kv_heads=8", "model.vocab_size=128256", "train.seq_len=8192", "train.global_batch=128",
              "train.micro_batch=1", "parallel.tp=2", "parallel.pp=4"]


@pytest.mark.parametrize("precision, tflops, published", [
    (["train.precision=fp8"], 1892, 4224), (["train.precision=fp8", "train.fp8_recipe=mxfp8"], 1664, 3712),
    (["train.precision=nvfp4"], 2202, 4864)])
def test_megatron_bridge_llama3_70b_gb200_rows(precision, tflops, published):
    from ndtrain.plan.fp8 import fp8_settings
    cluster = CLUSTERS["GB200"]
    cfg, device = plan_config(load_config(None, LLAMA3_70B + precision), cluster, 64)
    args = cfg.model_args()
    assert param_count(args) / 1e9 == pytest.approx(70.6, rel=0.01)
    fp8 = fp8_settings(cfg, {}, cluster)
    plan = make_plan(cfg, args, device, rate=Rate(tflops / 2500, utilization=True, hardware=False), fp8=fp8)
    per_gpu = plan.tokens_per_s / 64
    print(f"{precision[-1]}: {per_gpu:,.0f} tokens/s per GPU, published {published:,} ({per_gpu / published - 1:+.1%})")
    assert abs(per_gpu / published - 1) <= 0.15
