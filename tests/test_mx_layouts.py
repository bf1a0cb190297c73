"""MXFP8 equals MXFP8, NVFP4 equals NVFP4: every layout family trains like one process in the
same micro-scaled format (issue 38, parallel/fp8.py, kernels/mx.py).

As tests/test_fp8_layouts.py: TINY (or tiny-moe) with `train.fp8_base=fp64`, the block linears'
operands in the format, their products exact (kernels/mx.py: a value times its block scale is
exact, so the fp64 back end only sums in another order), held to the fp64 proofs' rule
(tests/helpers.py). The argument for fp64 around the quantizers is that file's: a value
changes only where a layout's fp64 round-off (~1e-16) moves it across a rounding midpoint (or,
for stochastic rounding, across its random threshold), ~1e-16 / 2^-3 per element for E2M1.

NVFP4 runs its published recipe: 16×16 weight blocks, the Hadamard transform of the weight
gradient's inputs, and stochastic rounding of the gradients, whose numbers are keyed by
(seed, step, the micro-batch's index in the global batch, the layer, each element's global
token and feature index), so a layout draws the numbers one process draws. The model has 4
KV heads (tiny has 2), so tp = 2 shards every projection into whole 32-element blocks, and
NVFP4's sequence is 64 tokens, so cp = 2 cuts it into chunks of 16 (the Hadamard runs).
Under expert parallelism an expert's rows come from every ep rank's micro-batch: their
numbers are keyed by that source's micro-batch in the global batch and the expert's global
index (kernels/fp8_linear.expert_keys), so NVFP4 proves ep2 with stochastic rounding on.
"""

import pytest

from helpers import assert_proof, proof_in_rank, reference_in_rank
from ndtrain.testing import run_ranks

MOE = ["model.preset=tiny-moe", "train.moe_aux_loss=0.01", "train.moe_bias_rate=0.001"]
BASE = ["train.fp8_base=fp64", "train.micro_batch=4", "model.n_kv_heads=4", "model.n_layers=2", "train.steps=3"]
FORMATS = {"nvfp4": ["train.precision=nvfp4", "train.seq_len=64"],
           "mxfp8": ["train.precision=fp8", "train.fp8_recipe=mxfp8"]}
TP, CP, ZERO3 = ("tp2-sp", ["parallel.tp=2"]), ("cp2", ["parallel.cp=2"]), ("zero3-dp2", ["parallel.zero=3"])
PP, ZB, EP = (("pp2-1f1b", ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
              ("pp2-zb", ["parallel.pp=2", "parallel.pp_schedule=zb"]), ("ep2", MOE + ["parallel.ep=2"]))
DP = ("dp2", [])
HSDP = ("hsdp2x2-zero3", ["parallel.dp_replicate=2", "parallel.zero=3", "train.global_batch=16"])  # a micro-batch per rank
# The default tier: one row of every layout family. NVFP4 (the recipe with the most to agree
# on: tensor amaxes, Hadamard runs, random numbers) where a mechanism is needed (the amax over
# tp, the Hadamard runs of the chunks under cp, the numbers keyed by the global micro-batch
# under data parallelism and by the source micro-batch and expert under ep), MXFP8 under the
# zero-bubble pipeline (its weight gradient apart from its input gradient); the slow tier NVFP4
# under both pipelines and MXFP8 on every other row.
DEFAULT = [("nvfp4", TP), ("nvfp4", ZERO3), ("nvfp4", EP), ("nvfp4", CP), ("mxfp8", ZB)]
SLOW = [("nvfp4", PP), ("nvfp4", ZB), ("nvfp4", DP)] + [("mxfp8", row) for row in (TP, CP, ZERO3, PP, EP, DP)]
SLOW_4 = [("nvfp4", HSDP), ("mxfp8", HSDP)]  # 4 ranks; NVFP4 on HSDP × tp2 (8 ranks): the default tier's
# tests/test_frontier_compositions.py
# NVFP4's options one at a time, on the rows their mechanisms touch.
ABLATIONS = {"nvfp4-1d": ["train.nvfp4_2d_weights=false"], "nvfp4-nohadamard": ["train.nvfp4_hadamard=false"],
             "nvfp4-nosr": ["train.nvfp4_stochastic_rounding=false"]}


def overrides(fmt: str, extra: list[str]) -> list[str]:
    base, variant = fmt.split("+")[0], ABLATIONS.get(fmt.split("+")[-1], [])
    return FORMATS[base] + BASE + variant + extra


def _references(data_dir, keys):
    return {key: reference_in_rank(overrides(key[0], (MOE if key[1] else []) + list(key[2])), data_dir)
            for key in keys}


def _rows(data_dir, rows, broken=None):
    if broken == "rank-local micro-batches":
        import ndtrain.parallel.fp8 as fp8_layout
        real = fp8_layout.begin_step
        fp8_layout.begin_step = lambda model, step, first: real(model, step, 0)
    if broken == "expert rows keyed by the receiving rank":
        import ndtrain.parallel.fp8 as fp8_layout
        fp8_layout.ep_sources = lambda mesh: (0,) * mesh.group("ep").size
    return {(fmt, name): proof_in_rank(overrides(fmt, extra), data_dir) for fmt, (name, extra) in rows}


def _key(fmt, row):
    """The reference a row is held to: its format, dense or MoE, and its global batch if it
    sets one (the reference trains the same micro-batches)."""
    return fmt, MOE[0] in row[1], tuple(o for o in row[1] if o.startswith("train.global_batch="))


def check(rows, data_dir, broken=None, world=2):
    refs = run_ranks(_references, 1, data_dir, sorted({_key(f, r) for f, r in rows}), timeout=900)[0]
    results = run_ranks(_rows, world, data_dir, rows, broken, timeout=900)[0]
    out = {}
    for fmt, row in rows:
        try:
            d = assert_proof(results[(fmt, row[0])], refs[_key(fmt, row)])
            print(f"{fmt} {row[0]}: gradients {d['grads']:.1e}, weights {d['state']:.1e}, losses {d['loss']:.1e}")
            out[(fmt, row[0])] = None
        except AssertionError as e:
            out[(fmt, row[0])] = f"{fmt} {row[0]}: {e}"
    return out


def test_every_layout_family_equals_one_process_in_nvfp4_and_mxfp8(tiny_data):
    failures = [e for e in check(DEFAULT, tiny_data).values() if e]
    assert not failures, failures


@pytest.mark.slow
def test_mxfp8_on_every_dense_row_and_nvfp4_zero_bubble(tiny_data):
    failures = [e for e in check(SLOW, tiny_data).values() if e]
    assert not failures, failures


@pytest.mark.slow
def test_both_formats_on_hsdp_equal_one_process(tiny_data):
    failures = [e for e in check(SLOW_4, tiny_data, world=4).values() if e]
    assert not failures, failures


@pytest.mark.slow
def test_nvfp4_ablations_stay_layout_invariant(tiny_data):
    rows = [("nvfp4+nvfp4-1d", TP), ("nvfp4+nvfp4-nohadamard", CP), ("nvfp4+nvfp4-nosr", ZERO3)]
    failures = [e for e in check(rows, tiny_data).values() if e]
    assert not failures, failures


@pytest.mark.slow
def test_rounding_keyed_by_the_ranks_own_micro_batches_fails(tiny_data):
    """The control: numbers keyed by a rank's own micro-batch index, not the global one, make
    data parallelism draw other numbers than one process, and the proof catches it."""
    result = check([("nvfp4", ZERO3)], tiny_data, broken="rank-local micro-batches")
    assert result[("nvfp4", "zero3-dp2")] is not None


@pytest.mark.slow
def test_expert_rows_keyed_by_the_receiving_rank_fail(tiny_data):
    """The control of NVFP4 on ep2: an expert's rows from the other rank's micro-batch keyed as
    the receiving rank's own draw other numbers than one process, and the proof catches it."""
    result = check([("nvfp4", EP)], tiny_data, broken="expert rows keyed by the receiving rank")
    assert result[("nvfp4", "ep2")] is not None
