"""Muon (train.optimizer=muon, issue 34) under the post-training tasks: SFT, DPO and RL each
train with Muon on a 2-rank layout whose owners move matrices (tp2+sp for SFT and RL: every
matrix split by rows or columns; ZeRO-3 dp2 for DPO: flat slices across matrices), equal to
one process with Muon under the fp64 proofs' rule (tests/helpers.prove), each task's
own data and loss (tests/test_sft.py, test_dpo.py, test_rl.py). Every run states that its
optimizer was Muon's, and the reference's weights differ from AdamW's on the same steps (the
key reaches the task: a test that could not fail otherwise)."""

from __future__ import annotations

import functools

import pytest

from helpers import prove, proof_in_rank, reference_in_rank
from ndtrain.testing import run_ranks
from test_dpo import DPO_TEST, _dpo_task, make_pairs
from test_rl import RL_PROOF, _rl_task
from test_sft import SFT_TEST, _sft_task, make_records

MUON = ["train.optimizer=muon"]
RL_SHORT = ["train.steps=2"]  # one rollout and its two updates (the second with ratios ≠ 1)
# task: (its base overrides, the layout proven)
LAYOUTS = {"sft": (SFT_TEST, ["parallel.tp=2", "train.micro_batch=2"]),
           "dpo": (DPO_TEST, ["parallel.zero=3", "train.micro_batch=2"]),
           "rl": (RL_PROOF + RL_SHORT, ["parallel.tp=2"])}


def _make(task: str, files: dict):
    if task == "sft":
        return functools.partial(_sft_task, *files["sft"])
    if task == "dpo":
        return functools.partial(_dpo_task, *files["dpo"])
    return _rl_task


def _rows(files: dict, kind: str) -> dict:
    """kind "reference": each task on one process with Muon (and its twin), and with AdamW;
    "layout": each task on its layout with Muon."""
    out = {}
    for task, (base, layout) in LAYOUTS.items():
        seen = []

        def note(trainer):
            seen.append(type(trainer.stepper.optimizer).__name__)
        if kind == "reference":
            run = reference_in_rank(base + MUON, "", make_task=_make(task, files), before_fit=note)
            adamw = proof_in_rank(base, "", make_task=_make(task, files))
            run["adamw_state"] = adamw["state"]
        else:
            run = proof_in_rank(base + MUON + layout, "", make_task=_make(task, files), before_fit=note)
        run.pop("history")
        run["optimizers"] = sorted(set(seen))
        out[task] = run
    return out


@pytest.fixture(scope="module")
def task_files(tmp_path_factory, tiny_data):
    import json
    root = tmp_path_factory.mktemp("muon_tasks")
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_records()))
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_pairs()))
    tok = f"{tiny_data}/tokenizer.json"
    return {"sft": (str(root / "chat.jsonl"), tok), "dpo": (str(root / "pairs.jsonl"), tok)}


@pytest.mark.slow
def test_muon_under_sft_dpo_and_rl_equals_one_process(task_files):
    refs = run_ranks(_rows, 1, task_files, "reference", timeout=900)[0]
    runs = run_ranks(_rows, 2, task_files, "layout", timeout=900)[0]
    for task in LAYOUTS:
        ref, run = refs[task], runs[task]
        assert ref["optimizers"] == run["optimizers"] == ["MuonAdamW"], (task, ref["optimizers"], run["optimizers"])
        moved = max(float((ref["state"][k] - ref["adamw_state"][k]).abs().max()) for k in ref["state"])
        assert moved > 1e-6, f"{task}: Muon's weights equal AdamW's"
        prove(f"muon {task}", run, ref)
