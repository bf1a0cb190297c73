"""DeepSeek-V3's architecture equals one process under every layout (issue 35): the
deepseek-v3-tiny preset (multi-head latent attention with a low-rank query and values
narrower than query·key, sigmoid routing limited to 2 of 4 expert groups with a scale, the
aux-loss-free bias and a shared expert, the first block dense) trains 3 steps in fp64 and is
held to the fp64 proofs' rule (tests/helpers.py `prove`: first-step gradients at
1e-10 of each tensor's largest element, the first loss and norm at 1e-12, later steps within
the twin's gaps).

The preset runs with its multi-token prediction module (depth 1, train.mtp_weight = 0.3), so
every row also proves MTP on that layout (tests/test_mtp_layouts.py adds depth 2, packed rows
and the routing statistics of the MTP blocks). The default tier proves, in one 2-rank launch,
one row of every layout family: tensor + sequence parallelism (heads split, whole
down-projections), ring context parallelism (unequal q·k and v widths; the MTP targets under
the zigzag layout), expert parallelism (group-limited routing), ZeRO-3 (flat slices) and the
zero-bubble pipeline (the MTP module on the last stage with the head, reading the embedding
through its copy there); the slow tier the other ZeRO stages, pipelines, back ends and tp
without sp, and 3-D rows on 8 ranks (ZeRO-3·tp2·cp2·ep2 in the default tier's
tests/test_frontier_compositions.py).
"""

import pytest

from helpers import prove, proof_in_rank, reference_in_rank
from ndtrain.testing import run_ranks

DS = ["model.preset=deepseek-v3-tiny", "train.moe_aux_loss=0.01", "train.moe_bias_rate=0.001"]
BATCH = ["train.micro_batch=2"]  # 4 micro-batches per step: what DualPipeV needs on pp = 2

ROWS = [("tp2-sp", ["parallel.tp=2"]),
        ("cp2-ring", ["parallel.cp=2", "parallel.cp_impl=ring"]),
        ("ep2", ["parallel.ep=2"]),
        ("zero3-dp2", ["parallel.zero=3"]),
        ("pp2-zb", ["parallel.pp=2", "parallel.pp_schedule=zb"])]
SLOW_ROWS = [("pp2-1f1b", ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
             ("dp2", []),
             ("zero1-dp2", ["parallel.zero=1"]),
             ("zero2-dp2", ["parallel.zero=2"]),
             ("tp2-no-sp", ["parallel.tp=2", "parallel.sp=false"]),
             ("pp2-dualpipev", ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual=2"]),
             ("cp2-allgather", ["parallel.cp=2", "parallel.cp_impl=allgather"]),
             ("cp2-ulysses", ["parallel.cp=2", "parallel.cp_impl=ulysses"])]
ROWS_8 = [("dp2-tp2-pp2", ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"]),
          ("pp2-cp2-ep2-dualpipev", ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual=2",
                                     "parallel.cp=2", "parallel.dp=2", "parallel.ep=2",
                                     "train.micro_batch=1"])]  # 4 micro-batches per dp rank for DualPipeV
# ZeRO-3 × tp2 × cp2 × ep2: the default tier's tests/test_frontier_compositions.py


def _reference(data_dir):
    return reference_in_rank(DS + BATCH, data_dir)


def _rows(data_dir, rows):
    return {name: proof_in_rank(DS + BATCH + overrides, data_dir) for name, overrides in rows}


def _check(results, ref):
    expected = [r.get("mtp_loss") for r in ref["history"]]
    assert None not in expected, "the preset's MTP module did not run"
    for name, proof in results.items():
        mtp = [r.get("mtp_loss") for r in proof["history"]]
        assert mtp == pytest.approx(expected, rel=1e-9), f"{name}: mtp_loss {mtp} against {expected}"
        prove(f"deepseek-v3-tiny {name}", proof, ref)


def test_deepseek_layouts_equal_one_process(tiny_data, deepseek_reference):
    _check(run_ranks(_rows, 2, tiny_data, ROWS, timeout=600)[0], deepseek_reference)


@pytest.mark.slow
def test_deepseek_other_layouts_equal_one_process(tiny_data, deepseek_reference):
    _check(run_ranks(_rows, 2, tiny_data, SLOW_ROWS, timeout=900)[0], deepseek_reference)


@pytest.mark.slow
def test_deepseek_3d_layouts_equal_one_process(tiny_data, deepseek_reference):
    _check(run_ranks(_rows, 8, tiny_data, ROWS_8, timeout=900)[0], deepseek_reference)

