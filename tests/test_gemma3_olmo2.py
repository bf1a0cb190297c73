"""Gemma 3's and OLMo 2's blocks under the layouts (issue 35; their HF parity:
tests/test_hf_new_families.py).

- Gemma 3: Gemma 2's norms, GeGLU and embedding scale with q/k norms, a window on three
  layers of four rotating with a base of their own (`rope_local_theta`), the others with
  rope_theta and a linear scaling: fp64 layout proofs (tests/helpers.assert_proof) under
  TP with SP, PP, CP (ring, Ulysses) and ZeRO-3.
- OLMo 2: q/k norms over all heads, norms after the sublayers only: proofs under DP, ZeRO-3,
  PP, CP (ring, all-gather) and TP with SP (the norms' statistics completed over tp, the
  regions entered without a norm: parallel/tensor_norms.py); under tp = 4 and 2 KV heads
  (replicated K/V) refused in one line.
"""

from __future__ import annotations

import pytest

from ndtrain.testing import run_ranks

STEPS = ["train.steps=3"]
GEMMA3 = ["model.norm_offset=1.0", "model.sandwich_norm=true", "model.mlp_act=gelu_tanh", "model.embed_scale=8.0",
          "model.query_pre_attn_scalar=24", "model.qk_norm=true", "model.sliding_window=12", "model.window_layers=0,1,2",
          "model.rope_local_theta=500", 'model.rope_scaling={"rope_type": "linear", "factor": 4.0}',
          "model.tie_embeddings=true"]
OLMO2 = ["model.qk_norm=true", "model.qk_norm_all=true", "model.pre_norm=false", "model.sandwich_norm=true"]
MODELS = {"gemma3": GEMMA3, "olmo2": OLMO2}
ROWS = {
    "gemma3-tp2-sp": ("gemma3", ["parallel.tp=2"]),
    "gemma3-pp2": ("gemma3", ["parallel.pp=2", "train.micro_batch=4"]),
    "gemma3-cp2-ring": ("gemma3", ["parallel.cp=2"]),
    "gemma3-cp2-ulysses": ("gemma3", ["parallel.cp=2", "parallel.cp_impl=ulysses"]),
    "gemma3-zero3": ("gemma3", ["parallel.zero=3"]),
    "olmo2-dp2": ("olmo2", ["parallel.dp=2"]),
    "olmo2-tp2-sp": ("olmo2", ["parallel.tp=2"]),
    "olmo2-tp2-no-sp": ("olmo2", ["parallel.tp=2", "parallel.sp=false"]),
    "olmo2-zero3": ("olmo2", ["parallel.zero=3"]),
    "olmo2-pp2": ("olmo2", ["parallel.pp=2", "train.micro_batch=4"]),
    "olmo2-cp2-ring": ("olmo2", ["parallel.cp=2"]),
    "olmo2-cp2-allgather": ("olmo2", ["parallel.cp=2", "parallel.cp_impl=allgather"]),
}


def _references(data_dir):
    from helpers import reference_in_rank
    return {name: reference_in_rank(STEPS + model, data_dir) for name, model in MODELS.items()}


# The default tier: one launch, where each model's own mechanisms meet a layout (Gemma 3's
# windows and two rotary bases under tp + sp, the ring and the stages; OLMo 2's norms over all
# heads, their statistics completed over tp, and its flat slices under ZeRO-3); the rest slow.
DEFAULT = ("gemma3-tp2-sp", "gemma3-cp2-ring", "gemma3-pp2", "olmo2-tp2-sp", "olmo2-zero3")


def _rows(data_dir, names):
    from helpers import proof_in_rank
    return {name: proof_in_rank(STEPS + MODELS[ROWS[name][0]] + ROWS[name][1], data_dir) for name in names}


def _check(names, data_dir):
    from helpers import prove
    refs = run_ranks(_references, 1, data_dir)[0]
    results = run_ranks(_rows, 2, data_dir, names, timeout=900)[0]
    for name in names:
        prove(name, results[name], refs[ROWS[name][0]])


def test_gemma3_and_olmo2_under_each_layout_family_equal_one_process(tiny_data):
    _check(DEFAULT, tiny_data)


@pytest.mark.slow
def test_gemma3_and_olmo2_under_the_other_layouts_equal_one_process(tiny_data):
    _check([name for name in ROWS if name not in DEFAULT], tiny_data)


@pytest.mark.parametrize("overrides, fragment", [
    (OLMO2 + ["parallel.tp=4"], "model.qk_norm_all = True: with parallel.tp = 4: the key norm over all KV heads "
                                "needs them split over tp"),
    (["model.qk_norm_all=true"], "model.qk_norm_all = True: needs model.qk_norm = true"),
    (["model.pre_norm=false"], "model.pre_norm = False: needs model.sandwich_norm = true"),
    (["model.rope_local_theta=-1"], "model.rope_local_theta = -1.0: must be >= 0"),
])
def test_bad_keys(overrides, fragment):
    from ndtrain.config import ConfigError, load_config, validate
    cfg = load_config(None, ["model.preset=tiny", "run.device=cpu", "train.seq_len=32", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world=cfg.parallel.tp)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)
