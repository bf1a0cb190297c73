"""Elastic resume of a mixture: a run stopped at step 4 on dp2 and resumed under another
layout reads exactly the global batches of the uninterrupted run (every token, every row,
collected from every rank), and its losses and final weights equal the uninterrupted run's
in fp64 under the layout proofs' tolerance rule (tests/helpers.py; as tests/test_reshard.py:
B's first step starts from A's exact state, so its loss is held to exact precision, later
steps and the final weights to the gaps of the one-process twin)."""

import pytest
import torch

from ckpt_helpers import copy_checkpoint, train
from helpers import FP64, LOSS_TOL, assert_tensors_close, loss_scale, perturb_gradients, proof_tolerances
from mixture_helpers import prepared_mixture, sources_override
from ndtrain.testing import run_ranks

STEPS = FP64 + ["train.steps=8", "train.save_every=4"]
DP2 = ["parallel.dp=2"]
LAYOUTS = {"pp2": (2, ["parallel.pp=2", "train.micro_batch=4"]),
           "dp4": (4, ["parallel.dp=4"]),
           "pp2 x dp2": (4, ["parallel.pp=2", "parallel.dp=2", "train.micro_batch=2"]),
           "cp2 zero3": (2, ["parallel.cp=2", "parallel.zero=3"]),
           "tp2": (2, ["parallel.tp=2"])}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture_resume")
    data = prepared_mixture(root)
    sources = [{"name": s.name, "path": str(s.data.path), "weight": s.weight} for s in data.sources]
    return sources, [str(s.data.path) for s in data.sources]


def _recording(seen: list):
    def install(trainer):
        rows = trainer.task.rows

        def record(split, step, start, stop):
            mb = rows(split, step, start, stop)
            if split == "train":
                seen.append((step, start, stop, mb.tokens.clone(), mb.targets.clone()))
            return mb
        trainer.task.rows = record
    return install


def _jobs(sources, paths, root, jobs):
    out = {}
    for kind, name, overrides in jobs:
        seen: list = []
        config = STEPS + [sources_override(sources)] + overrides
        run = f"{root}/{name.replace(' ', '_')}"
        if kind == "resume":
            copy_checkpoint(f"{root}/a", 4, run)
        hook = perturb_gradients if kind == "twin" else _recording(seen)
        losses, state, trainer = train(config, paths, run, before_fit=hook)
        out[(kind, name)] = {"losses": losses, "state": state, "rows": seen,
                             "norms": [r["grad_norm"] for r in trainer.history]}
    return out


def _global_batches(ranks: list[dict], key) -> dict[int, torch.Tensor]:
    """Each step's global batch (tokens and the last target of each row), assembled from the
    rows every rank read; ranks that read the same rows must have read the same tokens."""
    batches: dict[int, torch.Tensor] = {}
    for result in ranks:
        for step, start, stop, tokens, targets in result[key]["rows"]:
            rows = torch.cat([tokens, targets[:, -1:]], dim=1)
            batch = batches.setdefault(step, torch.full((8, rows.shape[1]), -1, dtype=torch.long))
            mine = batch[start:stop]
            assert bool(((mine == -1) | (mine == rows)).all()), f"step {step}: two ranks read different rows"
            batch[start:stop] = rows
    assert all(bool((b >= 0).all()) for b in batches.values()), "a row nobody read"
    return batches


def _elastic(names, mixture, tmp_path):
    sources, paths = mixture
    results = run_ranks(_jobs, 1, sources, paths, str(tmp_path / "one"),
                        [("ref", "ref", []), ("twin", "twin", [])])[0]
    tol = proof_tolerances(results[("ref", "ref")], results[("twin", "twin")])
    loss_tol = [LOSS_TOL] + tol["loss"][5:]
    a_ranks = run_ranks(_jobs, 2, sources, paths, str(tmp_path), [("a", "a", DP2)]
                        + [("resume", n, LAYOUTS[n][1]) for n in names if LAYOUTS[n][0] == 2])
    wide = [("resume", n, LAYOUTS[n][1]) for n in names if LAYOUTS[n][0] == 4]
    b_ranks = run_ranks(_jobs, 4, sources, paths, str(tmp_path), wide, timeout=600) if wide else []
    a = a_ranks[0][("a", "a")]
    straight = _global_batches(a_ranks, ("a", "a"))
    assert sorted(straight) == list(range(8))
    for name in names:
        ranks = b_ranks if LAYOUTS[name][0] == 4 else a_ranks
        b = ranks[0][("resume", name)]
        resumed = _global_batches(ranks, ("resume", name))
        assert sorted(resumed) == [4, 5, 6, 7], name
        for step in resumed:
            assert torch.equal(resumed[step], straight[step]), f"{name}: step {step} read other data"
        assert len(b["losses"]) == 4, name
        for i, (x, y, s) in enumerate(zip(b["losses"], a["losses"][4:], loss_scale(a["losses"][4:]))):
            assert abs(x - y) / s <= loss_tol[i], f"{name}, step {4 + i}: loss {x!r} vs {y!r} > {loss_tol[i]:.1e}"
        assert_tensors_close(b["state"], a["state"], tol["state"], f"{name}: final weight")


def test_mixture_resumes_dp2_to_pp2_exactly(mixture, tmp_path):
    _elastic(["pp2"], mixture, tmp_path)


@pytest.mark.slow
def test_mixture_resumes_dp2_to_dp4_pp2_x_dp2_cp2_and_tp2_exactly(mixture, tmp_path):
    _elastic(["dp4", "pp2 x dp2", "cp2 zero3", "tp2"], mixture, tmp_path)
