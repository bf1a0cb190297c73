"""Multi-token prediction (model/mtp.py) equals one process in fp64 under pipelines, context,
expert and tensor parallelism and 3-D layouts on 8 ranks (issue 35), held to the fp64
proofs' rule (tests/helpers.py `assert_proof`); each row's MTP blocks' routing statistics
equal one process's; a pipeline resumes bit for bit.

Pipelines: the MTP modules live on the last stage with the head and read the input embedding
through a copy there (`mtp_embeddings`, pipeline/stage.py `embedding_copy`), whose gradient
is summed with the first stage's embedding after the backward (TiedEmbedding, as a tied head
is). Context parallelism: each position's tokens d ahead (which may sit in a chunk another
rank holds) and its targets are attached to the whole rows before the zigzag permutation
(`mtp.lookahead`, `context.shard(..., mtp_depth)`). Tensor parallelism: the modules read h⁰
before the head's region entry (parallel/tensor_mtp.py).

Rows run on pretraining (deepseek-v3-tiny with its MTP module, depth 2 for the shift across
more than one position) and on packed SFT rows (documents restart positions; no module
predicts across a boundary: `test_mtp.py` proves that of one process, and these rows prove
the layouts equal one process on such rows, boundaries falling on and near chunk edges).
"""

import functools
import json

import pytest

from helpers import proof_in_rank, reference_in_rank
from test_deepseek_layouts import _check as check_proofs
from ndtrain.testing import run_ranks

MTP = ["model.preset=deepseek-v3-tiny", "model.mtp_depth=2", "train.moe_aux_loss=0.01",
       "train.moe_bias_rate=0.001", "train.micro_batch=2"]  # 4 micro-batches per step: DualPipeV on pp = 2
PP_ROWS = [("pp2-1f1b", ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
           ("pp2-zb", ["parallel.pp=2", "parallel.pp_schedule=zb"]),
           ("pp2-dualpipev", ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual=2"])]
CP_ROWS = [("cp2-ring", ["parallel.cp=2", "parallel.cp_impl=ring"]),
           ("cp2-allgather", ["parallel.cp=2", "parallel.cp_impl=allgather"]),
           ("cp2-ulysses", ["parallel.cp=2", "parallel.cp_impl=ulysses"])]


def _runs(data_dir, rows, make_task=None, extra=()):
    return {name: (reference_in_rank if name == "single" else proof_in_rank)(MTP + list(extra) + overrides,
                                                                               data_dir, make_task=make_task)
            for name, overrides in rows}


def _mtp_loads(run) -> list:
    """Per step, the MTP blocks' slots per expert (their MoE's statistics, model/mtp.py)."""
    return [[c for layer, c in zip(r["moe"]["layers"], r["moe"]["tokens_per_expert"]) if str(layer).startswith("mtp.")]
            for r in run["history"]]


def _check(results, ref, what):
    """Every row's MTP losses and its MTP blocks' routing statistics are there and the latter
    equal one process's; then the proof rule (test_deepseek_layouts.py)."""
    assert all(r.get("mtp_loss") is not None for r in ref["history"])
    assert all(_mtp_loads(ref))
    for name, proof in results.items():
        mtp = [r.get("mtp_loss") for r in proof["history"]]
        expected = [r["mtp_loss"] for r in ref["history"]]
        assert mtp == pytest.approx(expected, rel=1e-9), f"{what} {name}: mtp_loss {mtp} against {expected}"
        assert _mtp_loads(proof) == _mtp_loads(ref), f"{what} {name}: the MTP blocks' routing statistics differ"
    check_proofs({f"{what} {name}": proof for name, proof in results.items()}, ref)


@pytest.fixture(scope="module")
def reference(tiny_data):
    return run_ranks(_runs, 1, tiny_data, [("single", [])])[0]["single"]


@pytest.mark.slow
def test_mtp_pipelines_equal_one_process(tiny_data, reference):
    _check(run_ranks(_runs, 2, tiny_data, PP_ROWS, timeout=900)[0], reference, "mtp")


@pytest.mark.slow
def test_mtp_context_parallel_equals_one_process(tiny_data, reference):
    _check(run_ranks(_runs, 2, tiny_data, CP_ROWS, timeout=900)[0], reference, "mtp")


# ------------------------------------------------------------------- packed documents (SFT)

SFT_ROWS = [("single", []), ("pp2-1f1b", ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
            ("cp2-ring", ["parallel.cp=2", "parallel.cp_impl=ring"])]


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory, tiny_data):
    from test_sft import make_records
    path = tmp_path_factory.mktemp("mtp_sft") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_records()))
    return str(path), f"{tiny_data}/tokenizer.json"


def _sft_runs(files, rows):
    from test_sft import SFT_TEST, _sft_task
    return _runs("", rows, functools.partial(_sft_task, *files), SFT_TEST)


@pytest.mark.slow
def test_mtp_on_packed_documents_equals_one_process(sft_files):
    """Packed SFT rows (positions restarting at each example, prompts masked): pp2 and cp2
    (boundaries on and near the zigzag chunks' edges) equal one process, whose modules never
    predict across a boundary (test_mtp.py)."""
    ref = run_ranks(_sft_runs, 1, sft_files, SFT_ROWS[:1])[0]["single"]
    _check(run_ranks(_sft_runs, 2, sft_files, SFT_ROWS[1:], timeout=900)[0], ref, "mtp sft")


@pytest.mark.slow
def test_mtp_expert_parallel_equals_one_process(tiny_data, reference):
    _check(run_ranks(_runs, 2, tiny_data, [("ep2", ["parallel.ep=2"])], timeout=900)[0], reference, "mtp")


@pytest.mark.slow
def test_mtp_3d_layout_equals_one_process(tiny_data, reference):
    """On 8 ranks: DeepSeek-V3's own kind of layout (DualPipeV over pp2 with cp2, dp2 and
    ep2), ZeRO-3 under a pipeline with cp2 (the embedding's copy alone in a flat buffer of
    the last stage, its slice summed with the first stage's), and tp2 under a pipeline (the
    copy split over the vocabulary as the embedding is)."""
    rows = [("pp2-cp2-ep2-dualpipev", ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual=2",
                                       "parallel.cp=2", "parallel.dp=2", "parallel.ep=2", "train.micro_batch=1"]),
            ("pp2-zero3-dp2-cp2", ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3", "parallel.cp=2",
                                   "train.micro_batch=1"]),
            ("pp2-tp2-dp2", ["parallel.pp=2", "parallel.tp=2", "parallel.dp=2", "train.micro_batch=1"])]
    _check(run_ranks(_runs, 8, tiny_data, rows, timeout=1500)[0], reference, "mtp")


TP_ROWS = [("tp2-sp", ["parallel.tp=2"]), ("tp2-no-sp", ["parallel.tp=2", "parallel.sp=false"])]


@pytest.mark.slow
def test_mtp_tensor_parallel_equals_one_process(tiny_data, reference):
    """The modules' blocks split as the main ones, h⁰ taken before the head's region entry
    (parallel/tensor_mtp.py), with and without sequence parallelism."""
    _check(run_ranks(_runs, 2, tiny_data, TP_ROWS, timeout=900)[0], reference, "mtp")


@pytest.mark.slow
def test_mtp_under_a_pipeline_resumes_bit_exact(tiny_data, tmp_path):
    """The last stage's copy of the embedding is never written, and read back from the
    embedding's weights and moments (checkpoint/layout.py): 10 steps straight equal 5, a
    resume and 5 more, bit for bit, on pp2 with the MTP modules."""
    from test_resume import _straight_vs_resumed
    import torch
    extra = [a for a in MTP if not a.startswith("train.micro_batch")] + ["parallel.pp=2"]
    straight, resumed, s_state, r_state, step = run_ranks(_straight_vs_resumed, 2, tiny_data, str(tmp_path), extra)[0]
    assert step == 10 and straight == resumed
    assert all(torch.equal(s_state[k], r_state[k]) for k in s_state)
