"""FP8 with latent attention (issue 35): deepseek-v3-tiny (MLA's up-projections wq_b, wkv_b and
wo, the dense block's MLP, the shared and routed experts in fp8; the down-projections wq_a and
wkv_a in the base dtype: parallel/fp8.py LINEARS)
trains under each layout like one process in fp8, with an fp64 base so the quantization is
exact and only summation order differs (tests/test_fp8_layouts.py explains why fp64, and why
the proofs' tolerance then holds). The MTP module's block stays in the base dtype. Tensor and
context parallelism run a dense model with the same latent attention (fp8 with MoE blocks
refuses them)."""

import pytest

from helpers import prove, proof_in_rank, reference_in_rank
from ndtrain.testing import run_ranks

FP8 = ["train.precision=fp8", "train.fp8_base=fp64", "train.fp8_recipe=blockwise", "train.micro_batch=4"]
DS = ["model.preset=deepseek-v3-tiny", "train.moe_aux_loss=0.01", "train.moe_bias_rate=0.001"] + FP8
# fp8 with MoE blocks refuses tp and cp (parallel/fp8.py): those rows run a dense model with
# deepseek-v3-tiny's latent attention
DENSE = ["model.preset=tiny", "model.n_kv_heads=4", "model.attention=mla", "model.q_lora_rank=32",
         "model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
         "model.v_head_dim=16"] + FP8
ROWS = {"moe": [("pp2-1f1b", ["parallel.pp=2"]), ("ep2", ["parallel.ep=2"]), ("zero3-dp2", ["parallel.zero=3"])],
        "dense": [("tp2-sp", ["parallel.tp=2"]), ("cp2-ring", ["parallel.cp=2"])]}
MODELS = {"moe": DS, "dense": DENSE}


def _runs(data_dir, rows):
    return {(kind, name): (reference_in_rank if name == "single" else proof_in_rank)(MODELS[kind] + overrides,
                                                                                      data_dir)
            for kind, name, overrides in rows}


def _swapped(data_dir):
    from ndtrain.config import load_config, validate
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel import fp8
    from ndtrain.parallel.parallelize import decoder
    from ndtrain.train.worker import mesh_shape
    from helpers import TINY
    cfg = validate(load_config(None, TINY + DS), world=1)
    model = decoder(cfg.model_args(), ParallelMesh.build(mesh_shape(cfg)), cfg)()
    return {n for n, m in model.named_modules() if isinstance(m, fp8.Float8Linear)}


@pytest.mark.slow
def test_fp8_latent_attention_layouts_equal_one_process(tiny_data):
    swapped = run_ranks(_swapped, 1, tiny_data)[0]
    assert {f"layers.1.attention.{x}" for x in ("wq_b", "wkv_b", "wo")} <= swapped
    assert not {f"layers.1.attention.{x}" for x in ("wq_a", "wkv_a")} & swapped  # partial gradients under tp
    assert not any(n.startswith("mtp.") for n in swapped)
    refs = run_ranks(_runs, 1, tiny_data, [(kind, "single", []) for kind in MODELS])[0]
    results = run_ranks(_runs, 2, tiny_data, [(k, n, o) for k, rows in ROWS.items() for n, o in rows], timeout=900)[0]
    for (kind, name), proof in results.items():
        prove(f"fp8 mla {kind} {name}", proof, refs[(kind, "single")])
