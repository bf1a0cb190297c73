"""Muon (issue 34, train/muon.py, parallel/muon.py): one process equals torch.optim.Muon plus
torch.optim.AdamW, and every layout equals one process (the fp64 proofs' rule,
tests/helpers.py). The reference of a layout row is one process with train.optimizer=muon
and the same overrides; its Newton–Schulz runs in fp64 (the compute dtype), so the rows are
held to the same twin-reference tolerances as AdamW's proofs."""

from pathlib import Path

import pytest
import torch

from helpers import prove, proof_in_rank, reference_in_rank
from ndtrain.testing import run_ranks

MUON = ["train.optimizer=muon", "train.steps=5"]  # issue 34 asks for 5 steps (TINY has 3)
MOE = ["model.preset=tiny-moe", "train.moe_aux_loss=0.01", "train.moe_bias_rate=0.001"]

ROWS_2 = [("dp2", []),
          ("zero1", ["parallel.zero=1"]),
          ("zero2", ["parallel.zero=2"]),
          ("zero3", ["parallel.zero=3"]),
          ("tp2-sp", ["parallel.tp=2"]),
          ("pp2-1f1b", ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
          ("pp2-zb", ["parallel.pp=2", "parallel.pp_schedule=zb"]),
          ("cp2", ["parallel.cp=2"]),
          ("ep2", MOE + ["parallel.ep=2"]),
          ("ep2-zero3", MOE + ["parallel.ep=2", "parallel.zero=3"])]
ROWS_4 = [("hsdp-zero3", ["parallel.dp_replicate=2", "parallel.zero=3"])]
ROWS_8 = [("pp2-tp2-dp2", ["parallel.pp=2", "parallel.tp=2", "parallel.dp=2"]),
          ("zero3-tp2-dp4", ["parallel.zero=3", "parallel.tp=2"])]  # HSDP × tp2: the default tier's
# tests/test_frontier_compositions.py
# The default tier: one launch of 2 ranks, one row per layout family the owners meet: plain DP
# and cp2 (replicas: nothing moves in), ZeRO-1 and ZeRO-3 (flat slices that cut across
# matrices: the optimizer's slices alone, and the parameters' too), tp2+sp (row and column
# shards), a pipeline (each stage owns its own matrices) and ep2 (experts as matrices), against
# the references of one launch of 1 rank; HSDP × tp2 on 8 ranks in
# tests/test_frontier_compositions.py. ZeRO-2, 1F1B, ep2+ZeRO-3, HSDP on 4 ranks, pp2 × tp2 × dp2
# and ZeRO-3 dp4 × tp2 in the slow tier.
DEFAULT = [row for row in ROWS_2 if row[0] in ("dp2", "zero1", "zero3", "tp2-sp", "pp2-zb", "cp2", "ep2")]


def _references(data_dir, moe: bool, dense: bool = True):
    out = {}
    if dense:
        out["dense"] = reference_in_rank(MUON, data_dir)
    if moe:
        out["moe"] = reference_in_rank(MUON + MOE, data_dir)
    return out


def _rows(data_dir, rows):
    return {name: proof_in_rank(MUON + overrides, data_dir) for name, overrides in rows}


def _check(results, refs, rows):
    for name, proof in results.items():
        ref = refs["moe" if MOE[0] in dict(rows)[name] else "dense"]
        prove(f"muon {name}", proof, ref)


def test_muon_layouts_equal_one_process(tiny_data, muon_refs):
    _check(run_ranks(_rows, 2, tiny_data, DEFAULT, timeout=600)[0], muon_refs, DEFAULT)


@pytest.mark.slow
def test_muon_every_2_rank_layout_equals_one_process(tiny_data, muon_refs):
    rest = [row for row in ROWS_2 if row not in DEFAULT]
    _check(run_ranks(_rows, 2, tiny_data, rest, timeout=900)[0], muon_refs, rest)


@pytest.mark.slow
def test_muon_hsdp_and_8_rank_layouts_equal_one_process(tiny_data, muon_refs):
    _check(run_ranks(_rows, 4, tiny_data, ROWS_4, timeout=900)[0], muon_refs, ROWS_4)
    _check(run_ranks(_rows, 8, tiny_data, ROWS_8, timeout=900)[0], muon_refs, ROWS_8)


@pytest.mark.slow
def test_muon_per_shard_newton_schulz_fails_the_proof(tiny_data, muon_refs):
    """Control: orthogonalising each tensor-parallel shard alone (Megatron's blockwise mode)
    is another optimizer, and the rule tells it apart."""
    rows = [("tp2-sp", ["parallel.tp=2"])]
    results = run_ranks(_blockwise_rows, 2, tiny_data, rows, timeout=600)[0]
    with pytest.raises(AssertionError):
        _check(results, muon_refs, rows)


def _blockwise_rows(data_dir, rows):
    import ndtrain.parallel.muon as muon

    def per_shard(self, inputs, ns, apply, during):  # each 2-D shard alone, at its matrix's learning rate
        during()
        for i, x in enumerate(inputs):
            if x is not None and x.ndim == 2:
                apply(i, slice(0, x.numel()), ns(x).to(x.dtype), self.spans[i][0][2])
    muon.MatrixOwners.orthogonalize = per_shard
    return _rows(data_dir, rows)


def _nccl_rows(data_dir, rows):
    return {name: (proof_in_rank(MUON + o, data_dir), proof_in_rank(MUON + o, data_dir, nccl=True)) for name, o in rows}


@pytest.mark.slow
def test_muon_under_nccl_semantics_equals_gloo_bit_for_bit(tiny_data):
    """The owners' all-to-alls (the second one in flight while AdamW runs) under NCCL's
    semantics (tests/nccl_like.py: contiguous tensors only, its backend name) equal the same
    runs on gloo bit for bit: ZeRO-3 (both all-to-alls) and tp2+sp."""
    from helpers import assert_same_proof
    rows = [row for row in ROWS_2 if row[0] in ("zero3", "tp2-sp")]
    for name, (gloo, nccl) in run_ranks(_nccl_rows, 2, tiny_data, rows, timeout=600)[0].items():
        assert_same_proof(nccl, gloo, f"muon {name}")


# -- one process: torch.optim.Muon -----------------------------------------------------------

def test_newton_schulz_is_torch_optim_muons(one_thread):
    from torch.optim._muon import _zeropower_via_newtonschulz

    from ndtrain.train.muon import NS_EPS, newton_schulz
    coeffs = (3.4445, -4.7750, 2.0315)
    for shape in ((16, 40), (40, 16)):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]))
        assert torch.equal(newton_schulz(g, coeffs, 5, torch.bfloat16), _zeropower_via_newtonschulz(g, coeffs, 5, NS_EPS))


@pytest.mark.parametrize("adjust, muon_lr", [("original", 0.02), ("match_rms_adamw", 0.0)])
def test_one_process_equals_torch_muon_and_adamw(adjust, muon_lr, one_thread):
    """A one-block model, 3 steps of random gradients: MuonAdamW (iteration in bf16, as
    torch.optim.Muon's) gives the same weights as torch.optim.Muon on the blocks' matrices
    and torch.optim.AdamW on the rest, bit for bit."""
    from ndtrain.config import load_config, validate
    from ndtrain.mesh import ParallelMesh
    from ndtrain.model.args import PRESETS
    from ndtrain.model.llama import Transformer
    from ndtrain.parallel.placement import OptimSlice
    from ndtrain.parallel.states import param_groups
    from ndtrain.train.optim import build_optimizer

    import dataclasses
    t = validate(load_config(None, ["model.preset=tiny", "train.optimizer=muon", f"train.muon_adjust_lr={adjust}",
                                    f"train.muon_lr={muon_lr}", "run.device=cpu"]), world=1).train
    # one narrow block: torch runs the iteration in bf16, which is slow on a CPU
    args = dataclasses.replace(PRESETS["tiny"], n_layers=1, dim=32, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=48,
                               vocab_size=64)
    torch.manual_seed(0)
    models = [Transformer(args) for _ in range(2)]
    with torch.no_grad():
        for p in models[0].parameters():
            p.normal_(0, 0.05)
    models[1].load_state_dict(models[0].state_dict())
    ours = build_optimizer(param_groups(models[0].named_parameters(), t.weight_decay, True), t, torch.device("cpu"),
                           ([OptimSlice(n, p, p, 0, 0, p.numel()) for n, p in models[0].named_parameters()],
                            ParallelMesh.single().stage_group(), torch.bfloat16))
    groups = param_groups(models[1].named_parameters(), t.weight_decay, True)
    matrices = [p for g in groups if g.get("muon") for p in g["params"]]
    assert len(matrices) == 7  # q, k, v, o and the MLP's three
    reference = [torch.optim.Muon(matrices, lr=muon_lr or t.lr, weight_decay=t.weight_decay, momentum=t.muon_momentum,
                                  nesterov=t.muon_nesterov, adjust_lr_fn=adjust),
                 torch.optim.AdamW([g for g in groups if not g.get("muon")], lr=t.lr, betas=(t.beta1, t.beta2),
                                   eps=t.eps, foreach=True)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for (_, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        ours.step()
        for opt in reference:
            opt.step()
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a, b), name


# -- checkpoints -----------------------------------------------------------------------------

RESUME = {  # name: (world A, layout A, world B, layout B), each with train.optimizer=muon
    "1 process -> tp2": (1, [], 2, ["parallel.tp=2"]),
    "zero3 dp2 -> pp2": (2, ["parallel.zero=3"], 2, ["parallel.pp=2", "train.micro_batch=4"]),
    "tp2 -> zero2 dp2": (2, ["parallel.tp=2"], 2, ["parallel.zero=2"]),
}


@pytest.mark.slow
def test_muon_resumes_across_layouts(tiny_data, tmp_path):
    """Muon's momentum is stored as global tensors (momentum_buffer/NAME): train on layout A,
    resume on B from A's checkpoint (test_reshard's steps: 2 of 4); B's losses and final
    weights equal A's uninterrupted run under test_reshard's rule (the first resumed step
    exact, the rest within the twin's gaps)."""
    from helpers import LOSS_TOL, assert_tensors_close, loss_scale, proof_tolerances
    from test_reshard import SAVED, _jobs
    opt = [o for o in MUON if not o.startswith("train.steps=")]  # test_reshard's step counts
    by_world: dict[int, list] = {1: [("twin", "1 process -> tp2", opt)]}
    for name, (wa, a, _, _) in RESUME.items():
        by_world.setdefault(wa, []).insert(0, ("a", name, opt + a))
    for name, (_, _, wb, b) in RESUME.items():
        by_world.setdefault(wb, []).append(("b", name, opt + b))
    results = {}
    for world in sorted(by_world):
        results.update(run_ranks(_jobs, world, tiny_data, str(tmp_path), by_world[world], timeout=600)[0])
    tol = proof_tolerances(results[("a", "1 process -> tp2")], results[("twin", "1 process -> tp2")])
    loss_tol = [LOSS_TOL] + tol["loss"][SAVED + 1:]
    for name in RESUME:
        a, b = results[("a", name)], results[("b", name)]
        assert len(b["losses"]) == len(a["losses"]) - SAVED > 0, name
        for i, (x, y, s) in enumerate(zip(b["losses"], a["losses"][SAVED:], loss_scale(a["losses"][SAVED:]))):
            assert abs(x - y) / s <= loss_tol[i], f"{name} step {SAVED + i}: loss {x!r} vs {y!r} > {loss_tol[i]:.1e}"
        assert_tensors_close(b["state"], a["state"], tol["state"], f"{name}: final weight")


def _switch(data_dir, root):
    """An AdamW run's step-2 checkpoint resumed with Muon: Muon's momentum fresh, AdamW's
    moments kept; a Muon run's resumed with AdamW: refused."""
    from ckpt_helpers import copy_checkpoint, make_trainer, train
    from ndtrain.train.errors import TrainingError
    from ndtrain.train.trainer import Trainer
    said = []
    Trainer.report = lambda self, message: said.append(message)
    steps = ["train.steps=2", "train.save_every=2"]
    train(steps, data_dir, f"{root}/adamw")
    copy_checkpoint(f"{root}/adamw", 2, f"{root}/to_muon")
    trainer = make_trainer(MUON + ["train.steps=4"], data_dir, f"{root}/to_muon")
    trainer.start()
    opt = trainer.stepper.optimizer
    fresh = all(not opt.state[p]["momentum_buffer"].any() for g in opt.muon_groups for p in g["params"])
    kept = all(opt.state[p]["exp_avg"].any() for g in opt.adamw.param_groups for p in g["params"])
    trainer.fit()
    copy_checkpoint(f"{root}/to_muon", 4, f"{root}/to_adamw")
    from ndtrain.checkpoint import store
    from ndtrain.checkpoint.inspect import _optimizer
    said.append(_optimizer(store.read_meta(store.latest(Path(f"{root}/to_muon")))))
    try:
        make_trainer(["train.steps=6"], data_dir, f"{root}/to_adamw").start()
        refused = None
    except TrainingError as e:
        refused = str(e)
    return trainer.step, fresh, kept, said, refused


@pytest.mark.slow
def test_adamw_run_continues_with_muon_not_the_reverse(tiny_data, tmp_path):
    step, fresh, kept, said, refused = run_ranks(_switch, 1, tiny_data, str(tmp_path), timeout=300)[0]
    assert step == 4 and fresh and kept
    assert any("Muon's matrices start with fresh (zero) momentum" in m for m in said), said
    assert "Muon momentum + AdamW moments, step 4" in said, said  # ndtrain checkpoint inspect's line
    assert refused is not None and "train.optimizer" in refused and "Muon" in refused, refused


FP8 = ["train.precision=fp8", "train.fp8_base=fp64", "train.fp8_recipe=blockwise", "train.micro_batch=4"]
FP8_ROWS = [("fp8-tp2-sp", ["parallel.tp=2"]), ("fp8-zero3", ["parallel.zero=3"])]


def _fp8_reference(data_dir):
    return {"dense": reference_in_rank(MUON + FP8, data_dir)}


@pytest.mark.slow
def test_muon_composes_with_fp8(tiny_data):
    """fp8 matmuls (tests/test_fp8_layouts.py's fp64-around-fp8 proofs) with Muon: the layouts
    equal one process in fp8 with Muon."""
    ref = run_ranks(_fp8_reference, 1, tiny_data, timeout=600)[0]
    rows = [(name, FP8 + o) for name, o in FP8_ROWS]
    _check(run_ranks(_rows, 2, tiny_data, rows, timeout=600)[0], ref, rows)


# -- what the planner and the dry run say it costs --------------------------------------------

PRICED = [("muon-dp2", MUON), ("muon-zero3", MUON + ["parallel.zero=3"]), ("muon-tp2", MUON + ["parallel.tp=2"]),
          ("muon-ep2", MUON + ["model.preset=tiny-moe", "parallel.ep=2"])]


@pytest.mark.slow
def test_planner_and_dry_run_price_muon():
    """The planner's model states (one momentum for Muon's matrices) within test_plan_memory's
    5% of the dry run's; the dry run's Newton–Schulz FLOPs, summed over ranks, equal the
    formula over every matrix; its owners' bytes equal the formula under plain DP (Ψ(1 − 1/N))
    and stay within its bound elsewhere."""
    from ndtrain.parallel.muon import muon_costs, muon_matrices, ns_flops
    from test_plan_memory import _check_rows, _config, _measure_rows
    _check_rows(2, PRICED)
    measured = run_ranks(_measure_rows, 2, PRICED, timeout=600)[0]
    for name, overrides in PRICED:
        args = _config(overrides, 2).model_args()
        total = sum(ns_flops(a, b, 5) for a, b in muon_matrices(args))
        ranks = measured[name]
        assert abs(sum(r["muon_ns_flops"] for r in ranks) - total) <= len(ranks), name
        for r in ranks:
            held = r["psi_muon"] if name != "muon-zero3" else r["psi_muon"] / 2
            bound = muon_costs(args, 2, 1, held, 5, 4)["bytes"]
            if name == "muon-dp2":
                assert r["psi_muon"] == sum(a * b for a, b in muon_matrices(args))
                assert r["muon_bytes"] == bound, (name, r["muon_bytes"], bound)
            else:
                assert r["muon_bytes"] <= bound * 1.01, (name, r["muon_bytes"], bound)


def test_the_iteration_runs_in_bf16_unless_the_run_computes_in_fp64():
    """train.muon_ns_dtype = auto: bf16 (torch.optim.Muon's and Keller Jordan's choice, at any
    training precision), fp64 where the compute dtype is fp64 (the layout proofs, fp8 on an
    fp64 base); an explicit dtype wins."""
    from ndtrain.parallel.precision import muon_ns_precision
    for precision, base, expected in [("fp32", "bf16", "bf16"), ("bf16", "bf16", "bf16"), ("fp64", "bf16", "fp64"),
                                      ("fp8", "fp64", "fp64"), ("fp8", "fp32", "bf16"), ("nvfp4", "bf16", "bf16")]:
        assert muon_ns_precision("auto", precision, base) == expected, (precision, base)
    assert muon_ns_precision("fp32", "bf16") == "fp32" and muon_ns_precision("fp64", "fp32") == "fp64"
