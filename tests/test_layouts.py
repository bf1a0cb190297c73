"""The master test: every layout trains exactly like one process.

Each row of LAYOUTS runs TINY for 5 steps on the same seed and data, then compares the
losses of every step and the final full weights (gathered to rank 0) with a single-process
run, at 1e-5 relative. Rows of one world size share one launch of that many ranks.

Add a row for every new dimension and every composition it supports.
"""

import pytest

from helpers import assert_losses_close, assert_states_close, train_in_rank
from ndtrain.testing import run_ranks

def _pipeline(pp: int, schedule: str, m: int, *extra: str) -> tuple[str, list[str]]:
    """A pipeline row: pp stages, m micro-batches per data-parallel rank (global batch 8)."""
    dp = next((int(e.split("=")[1]) for e in extra if e.startswith("parallel.dp=")), 1)
    name = f"pp{pp}-{schedule}-m{m}" + "".join(f"-{e.split('.', 1)[1]}" for e in extra)
    return name, [f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}",
                  f"train.micro_batch={8 // (dp * m)}", *extra]


LAYOUTS: dict[int, list[tuple[str, list[str]]]] = {
    2: [
        ("dp2", ["parallel.dp=2"]),
        ("dp2-buckets-smaller-than-a-weight", ["parallel.dp=2", "parallel.bucket_mb=0.001"]),
        ("dp2-accumulation", ["parallel.dp=2", "train.micro_batch=1"]),
        *(_pipeline(2, schedule, m) for schedule in ("afab", "1f1b", "zb") for m in (2, 4)),
        *(_pipeline(2, "interleaved", m, "parallel.pp_virtual=2") for m in (2, 4)),
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
        ("tp2-sp-recompute-full", ["parallel.tp=2", "train.recompute=full"]),  # reruns the collectives
    ],
    4: [
        ("dp4", ["parallel.dp=4"]),
        ("dp4-buckets-smaller-than-a-weight", ["parallel.dp=4", "parallel.bucket_mb=0.001"]),
        ("dp4-accumulation", ["parallel.dp=4", "train.micro_batch=1"]),
        *(_pipeline(4, schedule, m) for schedule in ("afab", "1f1b", "zb") for m in (4, 8)),
        _pipeline(2, "1f1b", 2, "parallel.dp=2", "parallel.bucket_mb=0.001"),
        _pipeline(2, "1f1b", 2, "parallel.dp=2", "parallel.zero=1"),
        _pipeline(2, "interleaved", 4, "parallel.dp=2", "parallel.zero=1", "parallel.pp_virtual=2"),
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
        _pipeline(2, "zb", 4, "parallel.tp=2", "parallel.sp=false"),  # B runs the tp collectives, W none
        _pipeline(2, "zb", 4, "parallel.tp=2"),  # SP norm gradients: partial through W, summed per step
    ],
    8: [
        _pipeline(2, "1f1b", 2, "parallel.tp=2", "parallel.dp=2"),
    ],
}


def _single(data_dir):
    return train_in_rank([], data_dir)[:2]


def _run_layouts(data_dir, rows):
    return {name: train_in_rank(overrides, data_dir)[:2] for name, overrides in rows}


@pytest.fixture(scope="module")
def reference(tiny_data):
    return run_ranks(_single, 1, tiny_data)[0]


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_layout_invariance(world, tiny_data, reference):
    ref_losses, ref_state = reference
    results = run_ranks(_run_layouts, world, tiny_data, LAYOUTS[world], timeout=600)
    for name, _ in LAYOUTS[world]:
        losses, state = results[0][name]
        try:
            assert_losses_close(losses, ref_losses, 1e-5)
            assert_states_close(state, ref_state, 1e-5)
        except AssertionError as e:
            raise AssertionError(f"layout {name}: {e}") from None
        for rank, other in enumerate(results[1:], 1):
            assert other[name][0] == losses, f"layout {name}: rank {rank} reports other losses"
