"""The master test: every layout trains exactly like one process.

Each row of LAYOUTS trains TINY for 3 steps in fp64 on the same seed and data as a single
process, with AdamW's default eps, and must match it (tests/helpers.py, issue 9):
- every parameter's gradient after the first step, as the optimizer receives it (summed
  over every dimension, before clipping), element by element at 1e-10 of the tensor's
  largest element;
- every step's loss at 1e-9, and every step's global gradient norm at 1e-12;
- the final weights, element by element at 1e-9 of each tensor's largest element.
FP32_ROWS repeat a row of each family in fp32, at 1e-5 (losses and weights), as a looser
second check that the production dtype takes the same code paths. Rows of one world size
share one launch of that many ranks. The largest deviation per row family is printed
(pytest -s) for the record. NCCL_DEFAULT's rows (every row with -m slow) run again under
NCCL's semantics (tests/nccl_like.py) and must equal their gloo runs bit for bit.

Add a row for every new dimension and every composition it supports.
"""

import pytest
import torch

from helpers import (assert_losses_close, assert_proof, assert_same_proof, assert_states_close, proof_in_rank,
                     reference_in_rank, train_in_rank)
from ndtrain.testing import run_ranks


def _pipeline(pp: int, schedule: str, m: int, *extra: str) -> tuple[str, list[str]]:
    """A pipeline row: pp stages, m micro-batches per data-parallel rank (global batch 8)."""
    dp = next((int(e.split("=")[1]) for e in extra if e.startswith("parallel.dp=")), 1)
    name = f"pp{pp}-{schedule}-m{m}" + "".join(f"-{e.split('.', 1)[1]}" for e in extra)
    return name, [f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}",
                  f"train.micro_batch={8 // (dp * m)}", *extra]


SMALL = ["model.preset=small"]  # the default job's shape: tied embeddings, 4 KV-grouped heads

LAYOUTS: dict[int, list[tuple[str, list[str]]]] = {
    2: [
        ("dp2", ["parallel.dp=2"]),
        ("dp2-buckets-smaller-than-a-weight", ["parallel.dp=2", "parallel.bucket_mb=0.001"]),
        ("dp2-accumulation", ["parallel.dp=2", "train.micro_batch=1"]),
        ("dp2-small-tied", ["parallel.dp=2", *SMALL]),
        *(_pipeline(2, schedule, m) for schedule in ("afab", "1f1b", "zb") for m in (2, 4)),
        *(_pipeline(2, "interleaved", m, "parallel.pp_virtual=2") for m in (2, 4)),
        _pipeline(2, "1f1b", 2, "train.recompute=full"),
        _pipeline(2, "zb", 4, "train.recompute=selective"),
        # ZB-V and DualPipeV: two chunks per rank in a V, the loss and the tied ends on rank 0
        *(_pipeline(2, schedule, 4, "parallel.pp_virtual=2") for schedule in ("zbv", "dualpipev")),
        _pipeline(2, "zbv", 2, "parallel.pp_virtual=2"),
        _pipeline(2, "dualpipev", 4, "parallel.pp_virtual=2", *SMALL),  # the tied ends summed on one rank
        ("zero1", ["parallel.zero=1"]),
        ("zero2", ["parallel.zero=2"]),
        ("zero3", ["parallel.zero=3"]),
        ("zero1-accumulation", ["parallel.zero=1", "train.micro_batch=2"]),
        ("zero2-accumulation", ["parallel.zero=2", "train.micro_batch=2"]),
        ("zero3-accumulation-keep-gathered", ["parallel.zero=3", "train.micro_batch=2",
                                              "parallel.reshard_after_forward=false"]),
        ("dp2-recompute-full", ["parallel.dp=2", "train.recompute=full"]),
        ("zero3-recompute-selective", ["parallel.zero=3", "train.recompute=selective"]),
        ("zero2-recompute-every2", ["parallel.zero=2", "train.recompute=every:2"]),
        ("zero3-recompute-full-accumulation", ["parallel.zero=3", "train.recompute=full", "train.micro_batch=1"]),
        ("tp2-sp", ["parallel.tp=2"]),
        ("tp2", ["parallel.tp=2", "parallel.sp=false"]),
        ("tp2-sp-small-tied", ["parallel.tp=2", *SMALL]),
        ("tp2-sp-recompute-full", ["parallel.tp=2", "train.recompute=full"]),  # reruns the collectives
    ],
    4: [
        ("dp4", ["parallel.dp=4"]),
        ("dp4-buckets-smaller-than-a-weight", ["parallel.dp=4", "parallel.bucket_mb=0.001"]),
        ("dp4-accumulation", ["parallel.dp=4", "train.micro_batch=1"]),
        *(_pipeline(4, schedule, m) for schedule in ("afab", "1f1b", "zb") for m in (4, 8)),
        _pipeline(2, "1f1b", 2, "parallel.dp=2", "parallel.bucket_mb=0.001"),
        _pipeline(2, "zb", 2, "parallel.dp=2", "parallel.bucket_mb=0.001"),
        _pipeline(2, "1f1b", 2, "parallel.dp=2", "parallel.zero=1"),
        _pipeline(2, "interleaved", 4, "parallel.dp=2", "parallel.zero=1", "parallel.pp_virtual=2"),
        # ZeRO-2/3 under a pipeline: a chunk's gradient accumulates locally and is reduce-scattered
        # once per step; ZeRO-3 keeps each chunk gathered while its micro-batches are in flight
        _pipeline(2, "1f1b", 2, "parallel.dp=2", "parallel.zero=2"),
        _pipeline(2, "zb", 4, "parallel.dp=2", "parallel.zero=3"),
        _pipeline(2, "interleaved", 2, "parallel.dp=2", "parallel.zero=3", "parallel.pp_virtual=2"),
        _pipeline(2, "afab", 2, "parallel.dp=2", "parallel.zero=3", *SMALL),  # tied: slices summed over the ends
        *(_pipeline(2, schedule, 4, "parallel.dp=2", "parallel.zero=1", "parallel.pp_virtual=2")
          for schedule in ("zbv", "dualpipev")),
        _pipeline(2, "zbv", 2, "parallel.dp=2", "parallel.bucket_mb=0.001", "parallel.pp_virtual=2"),
        _pipeline(2, "dualpipev", 4, "parallel.dp=2", "parallel.zero=3", "parallel.pp_virtual=2"),
        ("zero1", ["parallel.zero=1"]),
        ("zero2", ["parallel.zero=2"]),
        ("zero3", ["parallel.zero=3"]),
        ("hsdp2x2-zero3", ["parallel.zero=3", "parallel.dp_replicate=2"]),
        ("hsdp2x2-zero2-accumulation", ["parallel.zero=2", "parallel.dp_replicate=2", "train.micro_batch=1"]),
        ("hsdp2x2-zero1-recompute-every2", ["parallel.zero=1", "parallel.dp_replicate=2", "train.recompute=every:2"]),
        ("zero3-accumulation", ["parallel.zero=3", "train.micro_batch=1"]),
        # tiny has 2 KV heads: tp4 replicates each on two ranks, tp2 splits them
        ("tp4-sp", ["parallel.tp=4"]),
        ("tp4", ["parallel.tp=4", "parallel.sp=false"]),
        ("tp2-sp-dp2-accumulation", ["parallel.tp=2", "parallel.dp=2", "train.micro_batch=1"]),
        ("tp2-dp2", ["parallel.tp=2", "parallel.sp=false", "parallel.dp=2"]),
        ("tp2-sp-dp2-zero1", ["parallel.tp=2", "parallel.zero=1"]),
        ("tp2-dp2-zero2", ["parallel.tp=2", "parallel.sp=false", "parallel.zero=2"]),
        ("tp2-sp-dp2-zero3", ["parallel.tp=2", "parallel.zero=3"]),
        ("tp2-sp-dp2-zero3-accumulation", ["parallel.tp=2", "parallel.zero=3", "train.micro_batch=1"]),
        _pipeline(2, "1f1b", 2, "parallel.tp=2"),  # sequence-parallel activations between stages
        _pipeline(2, "afab", 2, "parallel.tp=2"),
        _pipeline(2, "interleaved", 2, "parallel.tp=2", "parallel.pp_virtual=2"),
        _pipeline(2, "zb", 4, "parallel.tp=2", "parallel.sp=false"),  # B runs the tp collectives, W none
        _pipeline(2, "zb", 4, "parallel.tp=2"),  # SP norm gradients: partial through W, summed per step
        *(_pipeline(2, schedule, 4, "parallel.tp=2", "parallel.pp_virtual=2") for schedule in ("zbv", "dualpipev")),
    ],
    8: [
        _pipeline(2, "1f1b", 2, "parallel.tp=2", "parallel.dp=2"),
        _pipeline(2, "1f1b", 2, "parallel.tp=2", "parallel.dp=2", "parallel.zero=1"),
        _pipeline(2, "interleaved", 2, "parallel.tp=2", "parallel.dp=2", "parallel.pp_virtual=2"),
        ("hsdp2x2-zero3-tp2", ["parallel.zero=3", "parallel.dp_replicate=2", "parallel.tp=2"]),
        _pipeline(2, "1f1b", 2, "parallel.dp=4", "parallel.dp_replicate=2", "parallel.zero=2"),  # HSDP × PP
        _pipeline(2, "zb", 2, "parallel.dp=2", "parallel.tp=2", "parallel.zero=3"),
        ("zero3-dp4-tp2", ["parallel.zero=3", "parallel.tp=2", "train.micro_batch=1"]),
    ],
}

# The default tier (what `python -m pytest` runs): one proof of every family and of every
# kind of composition; the other rows repeat them at other sizes, micro-batch counts and
# combinations and run with `python -m pytest -m slow` (docs/architecture.md, "Tests").
DEFAULT_TIER = {
    2: {"dp2-accumulation", "pp2-afab-m2", "pp2-1f1b-m4", "pp2-zb-m4", "pp2-zbv-m4-pp_virtual=2",
        "pp2-dualpipev-m4-pp_virtual=2-preset=small", "zero1", "zero2",
        "zero3-accumulation-keep-gathered", "zero3-recompute-selective", "tp2-sp", "tp2-sp-small-tied"},
    4: {"hsdp2x2-zero3", "tp2-sp-dp2-zero3", "pp2-interleaved-m2-dp=2-zero=3-pp_virtual=2"},  # pp×tp: the 8-rank row
    8: {"pp2-1f1b-m2-tp=2-dp=2"},
}


# Under NCCL's semantics (tests/nccl_like.py: one handle per p2p batch, batches in order on a
# group's stream, checked in-order matching, the executor's NCCL lists), equal to the same row
# on gloo bit for bit: one row of each family by default, every row with -m slow.
NCCL_DEFAULT = {2: {"pp2-dualpipev-m4-pp_virtual=2-preset=small", "zero3-accumulation-keep-gathered", "tp2-sp"},
                4: {"pp2-interleaved-m2-dp=2-zero=3-pp_virtual=2"},
                8: {"pp2-1f1b-m2-tp=2-dp=2"}}


def tier(world: int, slow: bool) -> list[tuple[str, list[str]]]:
    """The rows of one world size in the default tier, or (slow) the others."""
    return [(name, o) for name, o in LAYOUTS[world] if (name in DEFAULT_TIER[world]) != slow]


# One row of each family, again in fp32 (TINY's eps), at 1e-5.
FP32_ROWS: dict[int, list[str]] = {
    2: ["dp2-accumulation", "pp2-zb-m4", "pp2-interleaved-m2-pp_virtual=2", "zero3-recompute-full-accumulation",
        "tp2-sp"],
    4: ["hsdp2x2-zero2-accumulation", "tp4-sp", "tp2-sp-dp2-zero3", "pp2-zb-m4-tp=2", "pp2-zb-m4-dp=2-zero=3"],
    8: ["pp2-1f1b-m2-tp=2-dp=2"],
}


# The control of the tolerance rule: a defect as small as a learning rate off by one part in
# 10^6 leaves the first update exact but must fail a later step or the final weights.
DEFECT = ["train.lr=0.003000003"]


def _references(data_dir):
    return {"tiny": reference_in_rank([], data_dir), "small": reference_in_rank(SMALL, data_dir),
            "fp32": train_in_rank([], data_dir)[:2], "defect": proof_in_rank(DEFECT, data_dir)}


def _run_layouts(data_dir, rows, fp32_names, nccl_names):
    proofs = {name: proof_in_rank(overrides, data_dir) for name, overrides in rows}
    fp32 = {name: train_in_rank(overrides, data_dir)[:2] for name, overrides in rows if name in fp32_names}
    nccl = {name: proof_in_rank(overrides, data_dir, nccl=True) for name, overrides in rows if name in nccl_names}
    return proofs, fp32, nccl


@pytest.fixture(scope="module")
def reference(tiny_data):
    return run_ranks(_references, 1, tiny_data)[0]


def _family(name: str) -> str:
    for family in ("pp", "hsdp", "zero", "tp", "dp"):
        if name.startswith(family) or f"-{family}" in name:
            return family
    return name


def test_the_tolerance_rule_catches_a_small_defect(reference):
    """The twin's tolerances are far below what a real defect moves: a learning rate one part
    in 10^6 off passes the first update (it does not enter it) and fails the rest."""
    defect, ref = reference["defect"], reference["tiny"]
    assert defect["grads"].keys() == ref["grads"].keys()
    assert all(torch.equal(defect["grads"][k], ref["grads"][k]) for k in ref["grads"])
    with pytest.raises(AssertionError, match="loss|gradient norm|final weight"):
        assert_proof(defect, ref)
    print("tolerances:", {k: v for k, v in ref["tol"].items() if k != "grads"})


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_layout_invariance(world, tiny_data, reference):
    _check_layouts(world, tier(world, slow=False), tiny_data, reference, NCCL_DEFAULT[world])


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_layout_invariance_every_row(world, tiny_data, reference):
    rows = tier(world, slow=True)
    _check_layouts(world, rows, tiny_data, reference, {name for name, _ in rows})


def _default_rows_left(world: int) -> list[tuple[str, list[str]]]:
    """The default tier's rows that it does not run under NCCL's semantics itself."""
    return [(name, o) for name, o in tier(world, slow=False) if name not in NCCL_DEFAULT[world]]


@pytest.mark.slow
@pytest.mark.parametrize("world", [world for world in sorted(LAYOUTS) if _default_rows_left(world)])
def test_default_rows_under_nccl_semantics(world, tiny_data, reference):
    rows = _default_rows_left(world)
    _check_layouts(world, rows, tiny_data, reference, {name for name, _ in rows})


def _check_layouts(world, rows, tiny_data, reference, nccl_names):
    results = run_ranks(_run_layouts, world, tiny_data, rows, FP32_ROWS[world], nccl_names, timeout=900)
    proofs, fp32, nccl = results[0]
    assert nccl.keys() == set(nccl_names), f"not rows of this tier: {sorted(set(nccl_names) - nccl.keys())}"
    for name in nccl:
        assert_same_proof(nccl[name], proofs[name], f"layout {name}")
    worst: dict[str, dict[str, float]] = {}
    for name, overrides in rows:
        ref = reference["small" if SMALL[0] in overrides else "tiny"]
        try:
            deviations = assert_proof(proofs[name], ref)
        except AssertionError as e:
            raise AssertionError(f"layout {name} (fp64): {e}") from None
        family = worst.setdefault(_family(name), dict.fromkeys(deviations, 0.0))
        for k, v in deviations.items():
            family[k] = max(family[k], v)
        for rank, (other, _, _) in enumerate(results[1:], 1):
            assert other[name]["losses"] == proofs[name]["losses"], f"layout {name}: rank {rank} reports other losses"
    for name, (losses, state) in fp32.items():
        ref_losses, ref_state = reference["fp32"]
        try:
            assert_losses_close(losses, ref_losses, 1e-5)
            assert_states_close(state, ref_state, 1e-5)
        except AssertionError as e:
            raise AssertionError(f"layout {name} (fp32): {e}") from None
    for family, d in sorted(worst.items()):
        print(f"world {world} {family}: gradients {d['grads']:.1e}, weights {d['state']:.1e}, "
              f"losses {d['loss']:.1e}, norms {d['norm']:.1e}")
