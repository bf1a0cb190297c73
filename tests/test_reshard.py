"""Any layout resumes any checkpoint: train 2 steps on layout A, save, resume for 2 more on
layout B; every step's loss and the final weights equal an uninterrupted 4-step run on A.

In fp64, under the layout proofs' tolerance rule (tests/helpers.py): B's first step starts
from A's exact weights and moments, so its loss is held to exact precision; later losses and
the final weights to the gaps of the twin, a one-process 4-step run perturbed at rounding
level every step (which bounds 2 steps of B's rounding from above). B's summation order
differs from A's, nothing else may. Each launch runs every job of its world size in order; a B job reads the step-2
checkpoint its A job wrote. `model.init_from=run:DIR` loads the same way (weights only) on
DP, ZeRO-3, TP and PP, exactly.
"""

import pytest
import torch

from ckpt_helpers import copy_checkpoint, full_state, make_trainer, train
from helpers import FP64, LOSS_TOL, assert_tensors_close, loss_scale, perturb_gradients, proof_tolerances
from ndtrain.testing import run_ranks

SAVED, TOTAL = 2, 4  # after the warm-up (TINY's 2 steps): B resumes AdamW's moments mid-schedule
STEPS = FP64 + [f"train.steps={TOTAL}", f"train.save_every={SAVED}"]
PP2 = ["parallel.pp=2", "train.micro_batch=4"]
# name: (world A, layout A, world B, layout B)
PAIRS = {
    "dp2 -> tp2": (2, ["parallel.dp=2"], 2, ["parallel.tp=2"]),
    "tp2 -> pp2": (2, ["parallel.tp=2"], 2, PP2),
    "zero3 dp4 -> pp2 x tp2": (4, ["parallel.zero=3"], 4, PP2 + ["parallel.tp=2"]),
    # tied: the last stage's head is a second copy of the embedding, written once
    "pp2 interleaved (tied) -> dp2 zero1": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved",
                                                "parallel.pp_virtual=2", "train.micro_batch=2",
                                                "model.tie_embeddings=true"],
                                            2, ["parallel.zero=1", "model.tie_embeddings=true"]),
    "hsdp 2x2 -> tp2 x dp2": (4, ["parallel.zero=3", "parallel.dp_replicate=2"], 4, ["parallel.tp=2"]),
    # ZeRO-3 shards over dp_shard × cp: the context-parallel ranks hold different slices
    "cp2 zero3 -> dp2": (2, ["parallel.cp=2", "parallel.zero=3"], 2, ["parallel.dp=2"]),
    "1 process -> pp2 x tp2 x dp2": (1, [], 8, ["parallel.pp=2", "parallel.tp=2", "train.micro_batch=2"]),
}


# model.init_from=run:DIR (weights only, fresh optimizer) on each layout, from the 1-process run
INIT_FROM = {"dp2": ["parallel.dp=2"], "zero3": ["parallel.zero=3"], "tp2": ["parallel.tp=2"], "pp2": PP2}
SOURCE = "1 process -> pp2 x tp2 x dp2"


def _jobs(data_dir, root, jobs):
    out = {}
    for kind, name, overrides in jobs:
        run = f"{root}/{name.replace(' ', '_')}"
        if kind == "init":
            source = f"{root}/{SOURCE.replace(' ', '_')}/a"
            tokenizer = f"data.tokenizer={data_dir}/tokenizer.json"  # a run of the command line holds its own
            trainer = make_trainer(FP64 + [f"model.init_from=run:{source}", tokenizer] + overrides, data_dir, None)
            trainer.start()
            out[(kind, name)] = (trainer.step, full_state(trainer))
        elif kind == "twin":
            losses, state, trainer = train(STEPS + overrides, data_dir, f"{run}/twin", before_fit=perturb_gradients)
            out[(kind, name)] = {"losses": losses, "state": state, "norms": [r["grad_norm"] for r in trainer.history]}
        elif kind == "a":
            losses, state, trainer = train(STEPS + overrides, data_dir, f"{run}/a")
            out[(kind, name)] = {"losses": losses, "state": state, "norms": [r["grad_norm"] for r in trainer.history]}
        else:
            copy_checkpoint(f"{run}/a", SAVED, f"{run}/b")
            losses, state, _ = train(STEPS + overrides, data_dir, f"{run}/b")
            out[(kind, name)] = {"losses": losses, "state": state}
    return out


# The default tier: the pairs on 1 and 2 ranks (and init_from); -m slow adds those on 4 and 8.
SMALL_PAIRS = [name for name, (wa, _, wb, _) in PAIRS.items() if max(wa, wb) <= 2]


@pytest.mark.parametrize("which", ["small", pytest.param("all", marks=pytest.mark.slow)])
def test_any_layout_resumes_any_checkpoint(tiny_data, tmp_path, which):
    pairs = {name: PAIRS[name] for name in (SMALL_PAIRS if which == "small" else PAIRS)}
    by_world: dict[int, list] = {1: []}
    for name, (wa, a, wb, b) in pairs.items():
        by_world.setdefault(wa, []).append(("a", name, a))
    for name, (wa, a, wb, b) in pairs.items():
        by_world.setdefault(wb, []).append(("b", name, b))
    by_world[2] += [("init", name, overrides) for name, overrides in INIT_FROM.items()]
    if SOURCE not in pairs:  # its A run: the tolerance's reference and init_from's source
        by_world[1].append(("a", SOURCE, PAIRS[SOURCE][1]))
    by_world[1].append(("twin", SOURCE, []))
    results = {}
    for world in sorted(by_world):  # A jobs of a world run before its B jobs; 1 < 8
        results.update(run_ranks(_jobs, world, tiny_data, str(tmp_path), by_world[world], timeout=600)[0])
    tol = proof_tolerances(results[("a", SOURCE)], results[("twin", SOURCE)])
    loss_tol = [LOSS_TOL] + tol["loss"][SAVED + 1:]  # B's first step: A's exact state, another summation order
    for name in pairs:
        a, b = results[("a", name)], results[("b", name)]
        try:
            assert len(a["losses"]) == TOTAL and len(b["losses"]) == TOTAL - SAVED
            for i, (x, y, s) in enumerate(zip(b["losses"], a["losses"][SAVED:], loss_scale(a["losses"][SAVED:]))):
                assert abs(x - y) / s <= loss_tol[i], f"step {SAVED + i}: loss {x!r} vs {y!r} > {loss_tol[i]:.1e}"
            assert_tensors_close(b["state"], a["state"], tol["state"], "final weight")
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    source_state = results[("a", SOURCE)]["state"]
    for name in INIT_FROM:  # every rank read its slices of the run's newest checkpoint
        step, state = results[("init", name)]
        assert step == 0 and state.keys() == source_state.keys(), name
        for k in state:
            assert torch.equal(state[k], source_state[k]), f"init_from on {name}: {k}"


def test_slices_copy_any_piece_into_any_other():
    """Pieces of a tensor under random tensor-parallel splits (with padding) and ZeRO flat
    ranges, read into pieces of another random layout: every element lands where it
    belongs, padding is never written, and the count of copied elements is exact."""
    import math
    import random

    import torch

    from ndtrain.checkpoint.slices import Piece, copy_overlap, real_numel

    def pieces(g, split, t, z):
        per = math.ceil(g.shape[split] / t) if split is not None else None
        out = []
        for r in range(t if split is not None else 1):
            box, offsets = list(g.shape), [0] * g.ndim
            if split is not None:
                box[split], offsets[split] = per, r * per
            padded = torch.zeros(box)
            real = tuple(slice(0, max(0, min(b, n - o))) for b, n, o in zip(box, g.shape, offsets))
            padded[real] = g[tuple(slice(o, o + s.stop) for o, s in zip(offsets, real))]
            n = math.prod(box)
            step = math.ceil(n / z)
            for a in range(0, n, step):
                p = Piece(tuple(g.shape), tuple(offsets), tuple(box), a, min(n, a + step))
                out.append((p, padded.reshape(-1)[p.start:p.end].clone()))
        return out

    rng = random.Random(0)
    for _ in range(200):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
        g = torch.randn(shape)
        stored = pieces(g, rng.choice([None, *range(len(shape))]), rng.randint(1, 3), rng.randint(1, 4))
        wanted = pieces(g, rng.choice([None, *range(len(shape))]), rng.randint(1, 3), rng.randint(1, 4))
        for piece, expected in wanted:
            got = torch.full((piece.numel,), float("nan"))
            copied = sum(copy_overlap(piece, got, p, lambda lo, hi, d=d: d[lo:hi]) for p, d in stored)
            assert copied == real_numel(piece), (shape, piece)
            real = ~torch.isnan(got)
            assert torch.equal(got[real], expected[real]), (shape, piece)
            assert int(real.sum()) == copied  # padding untouched
