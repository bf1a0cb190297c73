"""Expert parallelism (parallel/expert.py) against one device, in fp64.

- The MoE block at ep = 1, 2 and 4 on 4 ranks equals the single-device block on all ranks'
  tokens: outputs, input gradients, router and expert gradients (summed over the ranks
  holding the same experts), routed counts and the balance loss. The router has a clear
  top-k margin (checked), one expert gets no token anywhere and, at ep = 4, one rank
  receives no token at all.
- The all-to-all bytes of a block equal the formula of parallel/expert.py, exactly from the
  routed counts, and 4·T·k·D·(ep−1)/ep values (plus the counts) under uniform routing.
- Whole-model layouts with experts (the MoE rows of the 5-D matrix): losses, gradient norms,
  routing statistics and final weights (router biases included) equal one process's.
"""

import pytest
import torch

from helpers import FP64, assert_proof, capture_first_grads, train_in_rank
from ndtrain.testing import run_ranks

E, K, D, F_, ROWS, SEQ = 8, 2, 16, 8, 2, 6  # experts, top-k, model dim, expert dim, rows and positions per rank


def _block_args():
    from ndtrain.model.args import PRESETS
    return PRESETS["tiny-moe"].with_(dim=D, n_heads=2, n_kv_heads=2, moe_experts=E, moe_top_k=K, moe_ffn_dim=F_,
                                     moe_router="softmax_topk", moe_norm_topk=True)


def _reference_block(args):
    """The full block, the same on every rank; experts 6 and 7 are never chosen."""
    from ndtrain.model.moe import MoE
    torch.manual_seed(0)
    block = MoE(args).double()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
        block.router.expert_bias[6:] = -10.0  # selection only: the weights never see it
    return block


def _all_tokens(world):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world, ROWS, SEQ, D, dtype=torch.float64, generator=g)
    grad = torch.randn(world, ROWS, SEQ, D, dtype=torch.float64, generator=g)
    return x, grad


def _run_block(block, x, grad, log):
    x = x.clone().requires_grad_()
    out = block(x, log, "0")
    objective = (out * grad).sum()
    extra = log.take_loss()
    (objective if extra is None else objective + extra).backward()
    return out.detach(), x.grad


def _as_layer_0(block, args, mesh):
    """`block` as layer 0 of a model, parallelised for `mesh` (its experts: this rank's)."""
    from ndtrain.parallel import expert
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    model.layers["0"].feed_forward = block
    full = {n: p.detach().clone() for n, p in block.experts.named_parameters()}
    expert.parallelize(model, mesh, sp=False)
    ep = mesh.group("ep")
    with torch.no_grad():  # the test's own weights, sliced, in place of the model's initial values
        for n, p in block.experts.named_parameters():
            p.copy_(full[n].narrow(0, ep.rank * p.shape[0], p.shape[0]))


def _block_at(ep):
    """This rank's outputs and gradients with experts over `ep` of 4 ranks, next to the
    single-device block's on every rank's tokens."""
    import copy

    import torch.distributed as dist

    from ndtrain.comm import ops
    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.model.moe import RoutingLog

    world, rank = dist.get_world_size(), dist.get_rank()
    args = _block_args()
    ref = _reference_block(args)
    x, grad = _all_tokens(world)
    with torch.no_grad():
        choice = (x.reshape(-1, D) @ ref.router.weight.t()).softmax(-1) + ref.router.expert_bias
    ranked = torch.sort(choice, descending=True).values
    margin = float((ranked[:, K - 1] - ranked[:, K]).min())
    ref_log = RoutingLog(aux_coef=0.1)
    ref_out, ref_xgrad = _run_block(ref, x.reshape(world * ROWS, SEQ, D), grad.reshape(world * ROWS, SEQ, D), ref_log)

    mesh = ParallelMesh.build(MeshShape(dp_shard=world, ep=ep))
    block = copy.deepcopy(ref)
    for p in block.parameters():
        p.grad = None
    _as_layer_0(block, args, mesh)
    log = RoutingLog(aux_coef=0.1)
    out, xgrad = _run_block(block, x[rank], grad[rank], log)
    for p in block.experts.parameters():  # the data-parallel sum over ranks holding these experts
        ops.all_reduce(p.grad, mesh.group("edp"))
    ops.all_reduce(block.router.weight.grad, mesh.group("dp_cp"))
    counts, balance = log.counts["0"].clone(), log.balance["0"].clone()
    for t in (counts, balance):
        ops.all_reduce(t, mesh.group("dp_cp"))
    lo = mesh.coord("ep") * (E // ep)
    received = block.dispatch.meter.wire if ep > 1 else 0.0
    return {"margin": margin, "out": (out, ref_out.view(world, ROWS, SEQ, D)[rank]),
            "x_grad": (xgrad, ref_xgrad.view(world, ROWS, SEQ, D)[rank]),
            "router_grad": (block.router.weight.grad, ref.router.weight.grad),
            **{f"{n}_grad": (p.grad, getattr(ref.experts, n).grad[lo:lo + E // ep])
               for n, p in block.experts.named_parameters()},
            "counts": (counts, ref_log.counts["0"]), "balance": (balance, ref_log.balance["0"]),
            "local_counts": log.counts["0"], "a2a": received, "ep_rank": mesh.coord("ep")}


def _four_rank_checks():
    """One launch for the block, byte and memory checks below."""
    return {"blocks": {ep: _block_at(ep) for ep in (1, 2, 4)},
            "a2a": {(ep, uniform): _a2a_bytes(ep, uniform) for ep in (2, 4) for uniform in (False, True)},
            "memory": _measured_states()}


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_four_rank_checks, 4)


def test_moe_block_at_every_ep_equals_one_device(four_ranks):
    results = [r["blocks"] for r in four_ranks]
    for rank, by_ep in enumerate(results):
        for ep, r in by_ep.items():
            assert r["margin"] > 1e-3, "inputs too close to a top-k tie for a fair test"
            for key, value in r.items():
                if isinstance(value, tuple):
                    ours, ref = value
                    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12, msg=f"ep={ep} rank {rank}: {key}")
            assert r["counts"][0][6:].sum() == 0  # experts 6 and 7: no token anywhere
    # at ep = 4 rank 3 holds experts 6 and 7: it received nothing, yet sent its tokens out
    assert results[3][4]["ep_rank"] == 3 and results[3][4]["local_counts"].sum() == ROWS * SEQ * K


# -- all-to-all bytes ------------------------------------------------------------------------

def _a2a_bytes(ep, uniform):
    """One forward and backward of a block with experts over `ep` ranks: the bytes its
    all-to-alls sent (the block's meter and the mesh's tally) and the slot matrix s[i][j]."""
    import torch.distributed as dist

    from ndtrain.comm import ops
    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.model.moe import MoE, RoutingLog

    world, rank = dist.get_world_size(), dist.get_rank()
    args = _block_args()
    torch.manual_seed(0)
    block = MoE(args).double()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(ROWS, SEQ, D, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    if uniform:  # token t of this rank picks experts (t + rank) % E and (t + rank + E/2) % E
        with torch.no_grad():
            block.router.weight.zero_()
            block.router.weight[:, :E] = torch.eye(E)
        t = torch.arange(ROWS * SEQ)
        x = 0.01 * x.reshape(-1, D)
        x[t, (t + rank) % E] = 5.0
        x[t, (t + rank + E // 2) % E] = 4.0
        x = x.view(ROWS, SEQ, D)
    mesh = ParallelMesh.build(MeshShape(dp_shard=world, ep=ep))
    _as_layer_0(block, args, mesh)
    mesh.stats.reset()
    log = RoutingLog()
    _run_block(block, x, torch.ones_like(x), log)
    matrix = torch.zeros(world, ep, dtype=torch.float64)
    matrix[rank] = log.counts["0"].view(ep, E // ep).sum(1)  # slots this rank sends to each ep rank
    ops.all_reduce(matrix, mesh.group("dp_cp"))
    return block.dispatch.meter.wire, mesh.stats.wire("ep", "all_to_all"), matrix, mesh.coord("ep")


def test_all_to_all_bytes_follow_the_formula(four_ranks):
    """Per block and step, rank i sends 2·b·D·(Σ_{j≠i} s_ij + Σ_{j≠i} s_ji) + 8·(E − E/ep)
    bytes (dispatch and combine, forward and backward, and the int64 counts); uniform
    routing makes that 4·T·k·D·(ep−1)/ep values plus the counts. Measured: the block's own
    meter and the mesh's byte tally (comm/ops.py), which must agree."""
    b, T = 8, ROWS * SEQ
    for rank, cases in enumerate(r["a2a"] for r in four_ranks):
        for (ep, uniform), (meter, tally, matrix, i) in cases.items():
            group = [r for r in range(4) if r // ep == rank // ep]  # this rank's ep group
            s = matrix[group]  # s[i][j]: slots ep rank i sends to ep rank j
            sent, received = float(s[i].sum() - s[i, i]), float(s[:, i].sum() - s[i, i])
            counts = 8 * (E - E // ep)
            assert meter == 2 * b * D * (sent + received) + counts, (ep, uniform, rank)
            assert tally == meter
            if uniform:
                assert meter == 4 * T * K * D * (ep - 1) / ep * b + counts
            else:
                assert sent != received or s.std() > 0  # the uneven case is uneven


# -- memory ---------------------------------------------------------------------------------

MEMORY_MODEL = ["model.preset=tiny-moe", "model.dim=128", "model.n_heads=4", "model.ffn_dim=256",
                "model.moe_ffn_dim=256", "model.vocab_size=2048", "train.global_batch=4", "train.seq_len=8",
                "train.precision=bf16", "run.device=cpu", "parallel.ep=2"]


def _measured_states():
    import torch.distributed as dist

    from ndtrain.config import load_config, validate
    from ndtrain.mesh import ParallelMesh
    from ndtrain.train.dry_run import measure
    from ndtrain.train.worker import mesh_shape

    out = {}
    for stage in (2,):  # parameters whole, gradients and optimizer state sharded
        cfg = validate(load_config(None, MEMORY_MODEL + [f"parallel.zero={stage}"]), world=dist.get_world_size())
        out[stage] = measure(cfg, ParallelMesh.build(mesh_shape(cfg)))
    return out


def test_memory_report_separates_expert_and_dense_states(four_ranks):
    """bf16, experts over ep = 2 of 4 ranks: a rank holds half the experts, sharded (ZeRO)
    over the 2 ranks that hold the same ones, and the dense weights sharded over all 4. Each
    part follows the ZeRO formula with its own Ψ and shard group, within 2%."""
    from ndtrain.parallel.zero import model_state_bytes

    for stage, result in four_ranks[0]["memory"].items():
        assert result["n_shard"] == 4 and result["n_expert_shard"] == 2
        for rank, r in enumerate(result["ranks"]):
            psi_e, psi_d = r["psi_experts"], r["psi"] - r["psi_experts"]
            assert psi_e == 4 * 8 // 2 * 3 * 128 * 256  # blocks × experts here × 3 matrices
            experts = model_state_bytes(psi_e, stage, 2, 2)
            dense = model_state_bytes(psi_d, stage, 4, 2)
            for key in ("params", "grads", "optimizer"):
                assert r[f"expert_{key}"] == pytest.approx(experts[key], rel=0.02), (stage, rank, key)
                assert r[key] - r[f"expert_{key}"] == pytest.approx(dense[key], rel=0.02), (stage, rank, key)


# -- whole-model layouts ----------------------------------------------------------------------

# The fp64 layout proofs of tests/helpers.py, on the MoE model with both balancing methods on.
MOE = FP64 + ["model.preset=tiny-moe", "train.steps=3", "train.moe_aux_loss=0.01", "train.moe_bias_rate=0.001"]
CAPACITY = ["model.moe_capacity=1.0", "train.micro_batch=2"]

ROWS_BY_WORLD = {
    2: [("ep2", ["parallel.ep=2"]),
        ("ep2-zero3-recompute-full-accumulation", ["parallel.ep=2", "parallel.zero=3", "train.recompute=full",
                                                   "train.micro_batch=2"]),
        ("tp2-sp", ["parallel.tp=2"]),
        ("tp2-no-sp", ["parallel.tp=2", "parallel.sp=false"]),
        ("pp2-zb", ["parallel.pp=2", "parallel.pp_schedule=zb", "train.micro_batch=2"]),
        ("ep2-capacity", CAPACITY + ["parallel.ep=2"]),
        # bf16 (fp32 masters, gradients reduced in fp32): experts split against replicated
        ("bf16-ep2-zero1", ["train.precision=bf16", "parallel.ep=2", "parallel.zero=1"]),
        ("bf16-ep1-zero1", ["train.precision=bf16", "parallel.zero=1"])],
    4: [("ep4", ["parallel.ep=4"]),
        ("hsdp2x2-zero2-ep2", ["parallel.dp_replicate=2", "parallel.zero=2", "parallel.ep=2"]),
        ("tp2-dp2-ep2-zero1", ["parallel.tp=2", "parallel.ep=2", "parallel.zero=1"]),
        ("pp2-dp2-ep2-zero3-interleaved", ["parallel.pp=2", "parallel.ep=2", "parallel.zero=3",
                                           "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2",
                                           "train.micro_batch=2"]),
        ("pp2-cp2-ep2", ["parallel.pp=2", "parallel.cp=2", "parallel.ep=2", "train.micro_batch=2"]),
        *((f"pp2-dp2-ep2-{s}", ["parallel.pp=2", "parallel.ep=2", f"parallel.pp_schedule={s}", "parallel.pp_virtual=2",
                                "train.micro_batch=1"] + (["parallel.zero=1"] if s == "dualpipev" else []))
          for s in ("zbv", "dualpipev"))],
    8: [("pp2-dp2-tp2-ep2", ["parallel.pp=2", "parallel.tp=2", "parallel.ep=2", "train.micro_batch=2"]),
        ("dp2-cp2-tp2-zero3-ep2", ["parallel.cp=2", "parallel.tp=2", "parallel.zero=3", "parallel.ep=2"]),
        ("pp2-dp2-cp2-ep2", ["parallel.pp=2", "parallel.cp=2", "parallel.ep=2", "train.micro_batch=2"])],
}


# The default tier: every 2-rank row and two 4-rank compositions; the rest with -m slow.
DEFAULT_TIER = {2: {name for name, _ in ROWS_BY_WORLD[2]},
                4: {"hsdp2x2-zero2-ep2", "pp2-dp2-ep2-zero3-interleaved"}, 8: set()}
# Under NCCL's semantics (tests/nccl_like.py), equal to the same row on gloo bit for bit: ep2
# by default, every row with -m slow.
NCCL_DEFAULT = {2: {"ep2"}, 4: set()}


def _trained(overrides, data_dir, run_dir=None, twin=False, nccl=False):
    """One fp64 proof run (tests/helpers.py: losses, gradient norms, first-step gradients,
    final weights and router biases) and every step's routing statistics; `nccl`: under
    NCCL's semantics."""
    from helpers import perturb_gradients
    plot = ["run.plot=true"] if run_dir else []

    def prepare(trainer):
        if twin:
            perturb_gradients(trainer)
        capture_first_grads(trainer)
    losses, state, trainer = train_in_rank(MOE + overrides + plot, data_dir, run_dir=run_dir,
                                           before_fit=prepare, nccl=nccl)
    proof = {"losses": losses, "norms": [r["grad_norm"] for r in trainer.history], "grads": trainer.first_grads,
             "state": state, "async_p2p": getattr(trainer.par.schedule, "async_p2p", None)}
    return proof, [r["moe"] for r in trainer.history], trainer


def _layouts(data_dir, rows, run_dir, nccl_names):
    """Every row; the first also writes a run directory, whose checkpoint fresh trainers
    load on that layout and on another. Then those of `nccl_names` again under NCCL's
    semantics (under "nccl")."""
    out = {}
    for i, (name, overrides) in enumerate(rows):
        proof, stats, _ = _trained(overrides, data_dir, run_dir if i == 0 else None)
        out[name] = (proof, stats)
    out["nccl"] = {name: _trained(overrides, data_dir, nccl=True)[:2] for name, overrides in rows
                   if name in nccl_names}
    if run_dir:
        out["resumed"] = {other: _loaded(overrides, data_dir, run_dir)
                          for other, overrides in (("same", rows[0][1]), ("ep1-zero1", ["parallel.zero=1"]))}
    return out


def _loaded(overrides, data_dir, run_dir):
    """A fresh trainer on `overrides`' layout loads the run's last checkpoint (written by
    another layout, maybe): its full model (router biases included) and AdamW's moments."""
    from pathlib import Path

    import torch.distributed as dist

    from helpers import TINY
    from ndtrain.checkpoint import store
    from ndtrain.config import load_config, validate
    from ndtrain.data.prepare import PreparedData
    from ndtrain.mesh import ParallelMesh
    from ndtrain.train.tasks import Pretrain
    from ndtrain.train.trainer import Trainer
    from ndtrain.train.worker import mesh_shape

    cfg = validate(load_config(None, TINY + MOE + overrides), world=dist.get_world_size())
    trainer = Trainer(cfg, ParallelMesh.build(mesh_shape(cfg)), Pretrain(cfg, PreparedData.open(data_dir)), None)
    untrained = trainer.par.full_model_state()  # rank 0; live tensors under zero = 0: copied
    untrained = {k: v.clone() for k, v in untrained.items()} if untrained is not None else None
    trainer.resume(store.latest(Path(run_dir)))
    optim = trainer.stepper.optimizer.state
    return {"step": trainer.step, "loaded": trainer.par.full_model_state(), "untrained": untrained,
            "moments": sum(float(v["exp_avg"].abs().sum()) for v in optim.values())}


def _references(data_dir):
    """Each reference with the tolerances its twin gives (tests/helpers.py: the rule)."""
    from helpers import proof_tolerances
    out = {}
    for name, overrides in (("plain", []), ("capacity", CAPACITY)):
        proof, stats, _ = _trained(overrides, data_dir)
        proof["tol"] = proof_tolerances(proof, _trained(overrides, data_dir, twin=True)[0])
        out[name] = (proof, stats)
    return out


@pytest.fixture(scope="module")
def references(tiny_data):
    return run_ranks(_references, 1, tiny_data)[0]


def _assert_same_training(name, ours, ref):
    (proof, stats), (ref_proof, ref_stats) = ours[:2], ref[:2]
    try:
        assert_proof(proof, ref_proof)
    except AssertionError as e:
        raise AssertionError(f"layout {name}: {e}") from None
    for step, (moe, r_moe) in enumerate(zip(stats, ref_stats, strict=True)):
        assert moe["tokens_per_expert"] == r_moe["tokens_per_expert"], (name, step)
        assert moe["aux_loss"] == pytest.approx(r_moe["aux_loss"], rel=1e-10), (name, step)
        assert moe["dead_fraction"] == r_moe["dead_fraction"], (name, step)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_moe_layouts_train_like_one_process(world, tiny_data, references, tmp_path):
    """And on 2 ranks (ep=2), the run directory: load statistics in metrics.jsonl, the
    load plot, expert and dense memory, a checkpoint that fresh trainers load exactly, on
    the same layout and with the experts replicated (ep=1, ZeRO-1)."""
    rows = [row for row in ROWS_BY_WORLD[world] if row[0] in DEFAULT_TIER[world]]
    _check_moe_layouts(world, rows, tiny_data, references, tmp_path, NCCL_DEFAULT[world])


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_moe_layouts_train_like_one_process_every_row(world, tiny_data, references, tmp_path):
    rows = [row for row in ROWS_BY_WORLD[world] if row[0] not in DEFAULT_TIER[world]]
    _check_moe_layouts(world, rows, tiny_data, references, tmp_path, {name for name, _ in rows})


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_default_rows_under_nccl_semantics(world, tiny_data, references):
    """The default tier's rows that it does not run under NCCL's semantics itself."""
    rows = [row for row in ROWS_BY_WORLD[world] if row[0] in DEFAULT_TIER[world] and row[0] not in NCCL_DEFAULT[world]]
    _check_moe_layouts(world, rows, tiny_data, references, None, {name for name, _ in rows})


def _check_moe_layouts(world, rows, tiny_data, references, tmp_path, nccl_names):
    """`tmp_path` None: no run directory checked."""
    from helpers import assert_same_proof
    run_dir = str(tmp_path / "run") if world == 2 and tmp_path is not None else None
    results = run_ranks(_layouts, world, tiny_data, rows, run_dir, nccl_names, timeout=600)
    nccl = results[0].pop("nccl")
    assert nccl.keys() == set(nccl_names), f"not rows of this tier: {sorted(set(nccl_names) - nccl.keys())}"
    for name, (proof, stats) in nccl.items():
        assert_same_proof(proof, results[0][name][0], f"layout {name}")
        untimed = [[{k: v for k, v in step.items() if not k.endswith("_seconds")} for step in run]
                   for run in (stats, results[0][name][1])]
        assert untimed[0] == untimed[1], f"layout {name}: routing statistics under NCCL's semantics"
    for name, _ in rows:
        if name.startswith("bf16"):
            continue
        ref = references["capacity" if "capacity" in name else "plain"]
        _assert_same_training(name, results[0][name], ref)
        moe = results[0][name][1][-1]
        if "ep" in name:
            assert "a2a_bytes" in moe and min(moe["a2a_bytes"]) > 0, name
    if run_dir is not None:
        _check_run_dir(tmp_path / "run", results)
        split, replicated = results[0]["bf16-ep2-zero1"][0], results[0]["bf16-ep1-zero1"][0]
        for key, tol in (("losses", 1e-3), ("norms", 1e-2)):
            assert split[key] == pytest.approx(replicated[key], rel=tol), key
        assert split["losses"][0] == pytest.approx(results[0]["ep2"][0]["losses"][0], rel=1e-2)  # bf16 ≈ fp64


def _check_run_dir(run, results):
    import json

    from ndtrain.observe.progress import _fmt
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and (run / "moe_load.png").stat().st_size > 10_000
    for r in records:
        moe = r["moe"]
        assert moe["layers"] == [0, 1, 2, 3] and all(len(row) == 8 for row in moe["tokens_per_expert"])
        assert {"max_violation", "dead_fraction", "aux_loss", "a2a_bytes"} <= moe.keys()
        assert all(sum(row) == 8 * 32 * 2 for row in moe["tokens_per_expert"])  # every slot of the batch
    memory = records[-1]["memory"]  # (on log steps and the last) the experts' share of each state, per rank
    assert 0 < memory["expert_params"][0] < memory["params"][0]
    assert memory["expert_optimizer"][0] == pytest.approx(2 * memory["expert_params"][0], rel=1e-3)
    assert "MoE maxvio" in _fmt(records[-1]) and "dead" in _fmt(records[-1])
    trained = results[0]["ep2"][0]["state"]
    for layout, resumed in results[0]["resumed"].items():  # the experts split, or replicated and ZeRO-1
        assert resumed["step"] == 3 and resumed["moments"] > 0, layout
        for k, v in trained.items():
            assert torch.equal(resumed["loaded"][k], v), (layout, k)
        assert any(not torch.equal(resumed["untrained"][k], v) for k, v in trained.items() if "expert_bias" in k)
