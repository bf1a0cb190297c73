"""FP8 equals FP8: every layout trains like one process in fp8 (issue 21, parallel/fp8.py).

Each row trains TINY (or tiny-moe) for 3 steps with `train.precision=fp8`, its recipe, and
`train.fp8_base=fp64`: the block linears' matmul operands are fp8, everything else (and the
matmuls' accumulation, kernels/fp8.py's "fp64" back end) is fp64. Rows are held to the
fp64 proofs' rule (tests/helpers.py: first-step gradients at 1e-10 of each tensor's
largest element, the first loss and norm at 1e-12, later steps within the twin's gaps).

Why fp64 around fp8 operands, and why that tolerance holds. A layout changes where sums
are cut, so the values reaching a quantizer differ from one process's by summation-order
round-off: ~1e-16 relative in fp64, ~1e-7 in fp32. A quantized value changes only if its
input lies that close to a rounding midpoint of E4M3, whose midpoints sit 2^-4 apart
(relative): a chance of about 2·1e-16 / 2^-4 ≈ 3e-15 per element in fp64, so ~1e-8 for a
run's ~10^6 quantized elements, and then every operand is the same and only fp64 order
remains. In fp32 the chance is ~3e-6 per element: several elements flip in every run, each
by one E4M3 step (6-12%), which moves losses by 1e-5 to 1e-4 — as much as a layout that
forgets an amax reduction (the controls below) — so an fp32 comparison could not tell a
correct layout from a wrong one. fp64 can: the controls fail by 1e-12 to 1e-4.

The reference is one process with the same `train.micro_batch` (4 here): a tensorwise
activation scale covers one micro-batch, and data parallelism does not split one.
"""

import pytest

from helpers import prove, proof_in_rank, reference_in_rank
from ndtrain.testing import run_ranks

MOE = ["model.preset=tiny-moe", "train.moe_aux_loss=0.01", "train.moe_bias_rate=0.001"]

ROWS = [("tp2-sp", ["parallel.tp=2"]),
        ("zero3-dp2", ["parallel.zero=3"]),
        ("pp2-1f1b", ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
        ("pp2-zb", ["parallel.pp=2", "parallel.pp_schedule=zb"]),  # input and weight gradients apart
        ("cp2", ["parallel.cp=2"]),
        ("ep2", MOE + ["parallel.ep=2"])]
ROWS_8 = [("dp2-zero3-tp2-cp2", ["parallel.dp=2", "parallel.zero=3", "parallel.tp=2", "parallel.cp=2"])]
# The default tier proves blockwise, the recipe with the most cells to agree on, on the rows
# whose scales need a mechanism (the amax reduction over tp, which cp's reuses, and
# per-source experts); the slow tier the other rows (cp2 too), every recipe, a 3-D row and
# the controls (which break the reduction under cp as well).
DEFAULT_RECIPE = "blockwise"
DEFAULT_ROWS = [row for row in ROWS if row[0] in ("tp2-sp", "ep2")]


def fp8(recipe: str) -> list[str]:
    return ["train.precision=fp8", "train.fp8_base=fp64", f"train.fp8_recipe={recipe}", "train.micro_batch=4"]


def _references(data_dir, recipes):
    return {r: {"dense": reference_in_rank(fp8(r), data_dir), "moe": reference_in_rank(fp8(r) + MOE, data_dir)}
            for r in recipes}


def _rows(data_dir, recipes, rows, broken=None):
    if broken == "no amax reduction":
        import ndtrain.parallel.fp8 as fp8_layout
        fp8_layout.MaxOver.max_ = lambda self, t: None
    elif broken == "one scale per expert":
        import ndtrain.kernels.fp8_linear as fp8_linear
        merged = fp8_linear.segments_of
        fp8_linear.segments_of = lambda counts: merged(counts.sum(1) if counts.dim() == 2 else counts)
    return {(r, name): proof_in_rank(fp8(r) + overrides, data_dir) for r in recipes for name, overrides in rows}


def _check(results, references, rows):
    for (recipe, name), proof in results.items():
        overrides = dict(rows)[name]
        ref = references[recipe]["moe" if MOE[0] in overrides else "dense"]
        prove(f"fp8 {recipe} {name}", proof, ref)


def test_fp8_blockwise_layouts_equal_one_process(tiny_data):
    refs = run_ranks(_references, 1, tiny_data, [DEFAULT_RECIPE])[0]
    _check(run_ranks(_rows, 2, tiny_data, [DEFAULT_RECIPE], DEFAULT_ROWS, timeout=600)[0], refs, DEFAULT_ROWS)


ALL = sorted({"tensorwise", "rowwise", "blockwise"})


@pytest.fixture(scope="module")
def all_references(tiny_data):
    return run_ranks(_references, 1, tiny_data, ALL, timeout=900)[0]


@pytest.mark.slow
def test_fp8_every_recipe_under_every_layout(tiny_data, all_references):
    others = [r for r in ALL if r != DEFAULT_RECIPE]
    rest = [row for row in ROWS if row not in DEFAULT_ROWS]
    results = run_ranks(_rows, 2, tiny_data, others, ROWS, timeout=900)[0]
    results.update(run_ranks(_rows, 2, tiny_data, [DEFAULT_RECIPE], rest, timeout=900)[0])
    _check(results, all_references, ROWS)


@pytest.mark.slow
def test_fp8_3d_row(tiny_data, all_references):
    _check(run_ranks(_rows, 8, tiny_data, ALL, ROWS_8, timeout=900)[0], all_references, ROWS_8)


@pytest.mark.slow
@pytest.mark.parametrize("broken, rows", [
    ("no amax reduction", [("tp2-sp", ["parallel.tp=2"]), ("cp2", ["parallel.cp=2"])]),
    ("one scale per expert", [("ep2", MOE + ["parallel.ep=2"])])])
def test_fp8_controls_fail(tiny_data, all_references, broken, rows):
    """Each mechanism matters: without the amax reduction over tp or cp, or with one scale for
    an expert's rows from several micro-batches, every recipe misses the reference."""
    results = run_ranks(_rows, 2, tiny_data, ALL, rows, broken, timeout=900)[0]
    for key, proof in results.items():
        with pytest.raises(AssertionError):
            _check({key: proof}, all_references, rows)


# -- ZeRO-3's fp8 all-gather ----------------------------------------------------------------------

GATHER = ["parallel.zero=3", "train.micro_batch=4", "train.fp8_recipe=tensorwise"]


def _gather_runs(data_dir):
    """fp64 proofs with and without the fp8 all-gather; then one bf16 and one fp8-gathered step
    of the small model (its block linears hold 92% of its parameters with this vocabulary)."""
    from helpers import train_in_rank
    fp8_64 = ["train.precision=fp8", "train.fp8_base=fp64"] + GATHER
    out = {"plain": proof_in_rank(fp8_64, data_dir),
           "gathered": proof_in_rank(fp8_64 + ["train.fp8_all_gather=true"], data_dir)}
    for name, extra in (("bf16", ["train.precision=bf16"]),
                        ("fp8", ["train.precision=fp8", "train.fp8_all_gather=true"])):
        trainer = train_in_rank(["model.preset=small", "train.steps=1"] + GATHER + extra, data_dir)[2]
        out[name] = trainer.history[0]["comm"]
    return out


def test_zero3_fp8_all_gather_moves_half_the_bytes_and_changes_nothing(tiny_data):
    """The gathered fp8 weights are the ones the fp8 matmuls would have quantized from the
    gathered bf16 weights: the same losses, first gradients and final weights, bit for bit.
    The all-gather bytes of a step (comm in metrics.jsonl): at most 0.55× of bf16's."""
    import torch
    res = run_ranks(_gather_runs, 2, tiny_data, timeout=600)[0]
    plain, gathered = res["plain"], res["gathered"]
    assert plain["losses"] == gathered["losses"]
    for what in ("grads", "state"):
        assert all(torch.equal(plain[what][k], gathered[what][k]) for k in plain[what]), what
    bf16, fp8 = res["bf16"]["dp_shard_cp.all_gather"], res["fp8"]["dp_shard_cp.all_gather"]
    print(f"all-gather bytes per step: bf16 {bf16:,.0f}, fp8 {fp8:,.0f} ({fp8 / bf16:.3f}×); "
          f"amax all-reduce {res['fp8'].get('dp_shard_cp.all_reduce', 0):,.0f}")
    assert fp8 <= 0.55 * bf16
