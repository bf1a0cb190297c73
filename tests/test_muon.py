"""Muon (issue 34, train/muon.py, parallel/muon.py): one process equals torch.optim.Muon plus
torch.optim.AdamW, and every layout equals one process (the fp64 proofs' rule,
tests/helpers.py). The reference of a layout row is one process with train.optimizer=muon
and the same overrides; its Newton–Schulz runs in fp64 (the compute dtype), so the rows are
held to the same twin-reference tolerances as AdamW's proofs."""

import pytest
import torch

from helpers import assert_proof, proof_in_rank, reference_in_rank
from ndtrain.testing import run_ranks

MUON = ["train.optimizer=muon"]
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
          ("zero3-tp2-dp4", ["parallel.zero=3", "parallel.tp=2"])]
# The default tier: one launch of 2 ranks proving ZeRO-3 (flat slices across matrices),
# tp2+sp (row and column shards) and ep2 (experts as matrices); the rest in the slow tier.
DEFAULT = [row for row in ROWS_2 if row[0] in ("zero3", "tp2-sp", "ep2")]


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
        try:
            d = assert_proof(proof, ref)
        except AssertionError as e:
            raise AssertionError(f"muon {name}: {e}") from None
        print(f"muon {name}: gradients {d['grads']:.1e}, weights {d['state']:.1e}, "
              f"losses {d['loss']:.1e}, norms {d['norm']:.1e}")


@pytest.fixture(scope="module")
def muon_refs(tiny_data):
    return run_ranks(_references, 1, tiny_data, True, timeout=600)[0]


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

    def per_shard(self, inputs, ns):
        return [ns(x.view(x.shape[0], -1)).to(x.dtype).view_as(x) if x.ndim == 2 else x for x in inputs]
    muon.MatrixOwners.orthogonalize = per_shard
    return _rows(data_dir, rows)


# -- one process: torch.optim.Muon -----------------------------------------------------------

def test_newton_schulz_is_torch_optim_muons():
    from torch.optim._muon import _zeropower_via_newtonschulz

    from ndtrain.train.muon import NS_EPS, newton_schulz
    coeffs = (3.4445, -4.7750, 2.0315)
    for shape in ((16, 40), (40, 16)):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]))
        assert torch.equal(newton_schulz(g, coeffs, 5, torch.bfloat16), _zeropower_via_newtonschulz(g, coeffs, 5, NS_EPS))


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_one_process_equals_torch_muon_and_adamw(adjust):
    """The tiny model, 4 steps of random gradients: MuonAdamW (iteration in bf16, as
    torch.optim.Muon's) gives the same weights as torch.optim.Muon on the blocks' matrices
    and torch.optim.AdamW on the rest, bit for bit."""
    from ndtrain.config import load_config, validate
    from ndtrain.mesh import ParallelMesh
    from ndtrain.model.args import PRESETS
    from ndtrain.parallel.parallelize import build_model
    from ndtrain.parallel.placement import OptimSlice
    from ndtrain.parallel.states import param_groups
    from ndtrain.train.optim import build_optimizer

    t = validate(load_config(None, ["model.preset=tiny", "train.optimizer=muon", f"train.muon_adjust_lr={adjust}",
                                    "run.device=cpu"]), world=1).train
    models = [build_model(PRESETS["tiny"], 0, torch.device("cpu")) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    ours = build_optimizer(param_groups(models[0].named_parameters(), t.weight_decay, True), t, torch.device("cpu"),
                           ([OptimSlice(n, p, p, 0, 0, p.numel()) for n, p in models[0].named_parameters()],
                            ParallelMesh.single().stage_group(), torch.bfloat16))
    groups = param_groups(models[1].named_parameters(), t.weight_decay, True)
    matrices = [p for g in groups if g.get("muon") for p in g["params"]]
    assert len(matrices) == 4 * 7  # q, k, v, o and the MLP's three, per block
    reference = [torch.optim.Muon(matrices, lr=t.lr, weight_decay=t.weight_decay, momentum=t.muon_momentum,
                                  nesterov=t.muon_nesterov, adjust_lr_fn=adjust),
                 torch.optim.AdamW([g for g in groups if not g.get("muon")], lr=t.lr, betas=(t.beta1, t.beta2),
                                   eps=t.eps, foreach=True)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        for (_, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        ours.step()
        for opt in reference:
            opt.step()
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a, b), name
