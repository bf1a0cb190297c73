"""Shared pieces of the multi-rank tests: a tiny prepared corpus and a trainer runner."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import torch


# train.eps=1e-6: with Adam's default 1e-8, a weight whose gradient happens to sum to ~1e-9
# (one in ~10^4 does) gets an update lr·g/(|g|+eps) that turns the summation-order round-off
# of any other layout (~1e-10 absolute) into ~5e-5 of that weight (measured under TP). 1e-6
# bounds that gain by lr/eps and leaves every ordinary update as it was.
# 3 steps: the warm-up (2), then the decay; Adam's state after two updates. Two more steps
# tested nothing new and cost ~15% of the proofs' time (2026-11-28, A/B on four proof files).
TINY = ["model.preset=tiny", "train.steps=3", "train.global_batch=8", "train.seq_len=32",
        "train.lr=3e-3", "train.eps=1e-6", "train.warmup=2", "train.eval_every=0", "train.eval_batches=1",
        "run.progress=false", "run.plot=false", "run.device=cpu"]


def make_tiny_corpus(root: Path) -> Path:
    """About 150 KB of real Python source: a few stdlib modules copied into a folder."""
    src = Path(sysconfig.get_paths()["stdlib"])
    out = root / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("textwrap.py", "bisect.py", "colorsys.py", "heapq.py", "fnmatch.py", "shlex.py",
                 "glob.py", "keyword.py", "stat.py", "this.py", "queue.py", "sched.py"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def tiny_data_dir(root: Path) -> Path:
    from ndtrain.data.prepare import prepare_data
    corpus = make_tiny_corpus(root)
    return prepare_data(source=str(corpus), vocab_size=512, val_fraction=0.2,
                        cache_dir=root / "cache", progress=False)


# The layout proofs (docs/architecture.md, "Testing: the tolerance rule"): fp64 on the CPU with
# Adam's eps at 1e-6, which removes the optimizer's amplifier (an element whose gradient is
# ~0 turns a rounding δ into an update lr·δ/eps; at 1e-8 the RL proofs' gap grew 3-10× a step).
FP64 = ["train.precision=fp64", "train.eps=1e-6"]
# The first update is compared at exact precision: a layout only sums the same terms in
# another order, whose worst-case error γ_n = n·u (u = 1.1e-16) stays below 1.1e-11 for any
# reduction of n ≤ 10^5 terms; observed ≤ 2e-15.
GRAD_TOL, LOSS_TOL, NORM_TOL, STATE_TOL = 1e-10, 1e-12, 1e-12, 1e-12
# From the second update on, the gap is the problem's own amplification of that rounding. The
# twin reference measures it: one process with every non-zero gradient element moved, at every
# step, by up to ROUNDING of its tensor's largest element (uniform, seeded) — γ_n for sums of
# n = 1024 terms, more than the longest reduction in the proof models and 50× what any layout
# shows at the first update. Exact zeros (rows no token touched) stay zero in every layout.
ROUNDING = 2.0 ** -43


def capture_first_grads(trainer) -> None:
    """Make the trainer keep, as `trainer.first_grads` (rank 0; None elsewhere), the whole
    model's gradients of its first step as the optimizer receives them, before clipping."""
    clip = trainer.stepper.clip_grad_norm

    def clip_after_capture(max_norm):
        if not hasattr(trainer, "first_grads"):
            full = trainer.par.full_grad_state()  # collective
            trainer.first_grads = {k: v.detach().double().cpu().clone() for k, v in full.items()} if full else None
        return clip(max_norm)
    trainer.stepper.clip_grad_norm = clip_after_capture


def perturb_gradients(trainer, rho: float = ROUNDING, seed: int = 0) -> None:
    """The twin: before every clip (after any capture), add uniform noise of up to rho × the
    tensor's largest |gradient| to each non-zero gradient element the optimizer will use.
    Single-process runs only (each tensor is whole there)."""
    clip = trainer.stepper.clip_grad_norm
    gen = torch.Generator().manual_seed(seed)

    def clip_after_noise(max_norm):
        with torch.no_grad():
            for p in trainer.par.states.optim_params():
                if p.grad is not None:
                    g = p.grad
                    noise = torch.rand(g.shape, generator=gen, dtype=g.dtype).mul_(2).sub_(1)
                    g.add_(noise.mul_(g.abs().max() * rho).masked_fill_(g == 0, 0))
        return clip(max_norm)
    trainer.stepper.clip_grad_norm = clip_after_noise


def train_in_rank(overrides: list[str], data_dir: str, stop_after: int = 0, run_dir: str | None = None,
                  resume: bool = False, before_fit=None, make_task=None, meter: bool = False,
                  nccl: bool = False):
    """Build a Trainer on the current world with TINY + overrides and train; returns
    (losses, the full model's weights on rank 0 or None, trainer). `before_fit(trainer)`
    runs just before training (to install a probe or a fault). `make_task(cfg)` gives the
    task (default: pretraining on the prepared `data_dir`). `meter`: run the CPU memory
    meter on the first two steps (it slows them 2-3×; only memory tests read it). `nccl`:
    the whole run (the mesh built, training, the model gathered) under NCCL's semantics
    (tests/nccl_like.py)."""
    import contextlib

    from nccl_like import nccl_like
    with nccl_like() if nccl else contextlib.nullcontext():
        return _train_in_rank(overrides, data_dir, stop_after, run_dir, resume, before_fit, make_task, meter)


def _train_in_rank(overrides, data_dir, stop_after, run_dir, resume, before_fit, make_task, meter):
    import torch.distributed as dist

    from ndtrain.checkpoint import store
    from ndtrain.config import load_config, validate
    from ndtrain.data.prepare import PreparedData
    from ndtrain.mesh import ParallelMesh
    from ndtrain.train.tasks import Pretrain
    from ndtrain.train.trainer import Trainer
    from ndtrain.train.worker import mesh_shape

    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = validate(load_config(None, TINY + overrides), world=world)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.run.device == "cuda" else torch.device("cpu")
    mesh = ParallelMesh.build(mesh_shape(cfg), device)  # run.device=cuda: the cuda-marked tests
    task = make_task(cfg) if make_task else Pretrain(cfg, PreparedData.open(data_dir))
    trainer = Trainer(cfg, mesh, task, Path(run_dir) if run_dir else None)
    if not meter:
        trainer.meter_steps = 0
    if resume:
        trainer.resume(store.latest(Path(run_dir)))
    if before_fit is not None:
        before_fit(trainer)
    trainer.fit(stop_after=stop_after)
    losses = [r["loss"] for r in trainer.history]
    full = trainer.par.full_model_state()  # collective: the whole model, on rank 0
    dtype = torch.float64 if cfg.train.precision == "fp64" else torch.float32
    state = {k: v.detach().to(dtype).clone() for k, v in full.items()} if mesh.rank == 0 else None
    return losses, state, trainer


def proof_in_rank(overrides: list[str], data_dir: str, make_task=None, before_fit=None, twin: bool = False,
                  meter: bool = False, nccl: bool = False) -> dict:
    """One fp64 layout proof run: losses, gradient norms, first-step gradients and final
    weights (the last two whole, on rank 0), and whether a pipeline ran its lists for
    asynchronous messages (gloo's; `async_p2p`, None without a pipeline). `make_task` and
    `nccl` as in train_in_rank; `twin`: the perturbed reference (perturb_gradients)."""
    def prepare(trainer):
        if before_fit is not None:
            before_fit(trainer)
        if twin:  # wrapped first, so the capture (outside it) sees the gradients before the noise
            perturb_gradients(trainer)
        capture_first_grads(trainer)
    losses, state, trainer = train_in_rank(FP64 + overrides, data_dir, before_fit=prepare, make_task=make_task,
                                           meter=meter, nccl=nccl)
    return {"losses": losses, "norms": [r["grad_norm"] for r in trainer.history],
            "grads": trainer.first_grads, "state": state, "history": trainer.history,
            "async_p2p": getattr(trainer.par.schedule, "async_p2p", None)}


def assert_same_proof(nccl: dict, gloo: dict, what: str) -> None:
    """A run under the NCCL-like group equals the same run on gloo bit for bit: the same
    messages carry the same values, only the handles and their order of completion differ.
    A pipeline ran NCCL's action lists there and gloo's here. Where the runs kept their
    history, the final evaluation too."""
    assert nccl["losses"] == gloo["losses"], f"{what}: losses under NCCL's semantics differ from gloo's"
    assert nccl["norms"] == gloo["norms"], f"{what}: gradient norms under NCCL's semantics differ from gloo's"
    for key in ("grads", "state"):
        if gloo.get(key) is not None:
            assert nccl[key].keys() == gloo[key].keys(), what
            for k in gloo[key]:
                assert torch.equal(nccl[key][k], gloo[key][k]), f"{what}: {key} {k} differs under NCCL's semantics"
    if "history" in gloo:  # the evaluation at the end: a pipeline's forward-only lists
        evals = [[r.get("val_loss") for r in run["history"]] for run in (nccl, gloo)]
        assert evals[0] == evals[1] and evals[1][-1] is not None, f"{what}: evaluation {evals[0]} vs {evals[1]}"
    if gloo.get("async_p2p") is not None:
        assert (nccl["async_p2p"], gloo["async_p2p"]) == (False, True), f"{what}: the executor's action lists"


def _envelope(gaps: list[float]) -> list[float]:
    out, worst = [], 0.0
    for g in gaps:
        worst = max(worst, g)
        out.append(worst)
    return out


def tensor_gap(a: dict, b: dict) -> float:
    """The largest, over tensors, of max |a − b| / max |b|."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)) for k in b)


def loss_scale(losses: list[float]) -> list[float]:
    """What a loss gap is relative to: the loss, or 1e-3 where it is smaller (RL's losses
    pass through zero)."""
    return [max(abs(x), 1e-3) for x in losses]


def proof_tolerances(ref: dict, twin: dict) -> dict:
    """The tolerance rule: the first update at exact precision; step k ≥ 1 at the larger of
    that and the twin's largest gap up to step k (losses and norms), and the final weights
    at the larger of STATE_TOL and the twin's largest per-tensor gap."""
    loss_gap = _envelope([abs(x - y) / s for x, y, s in zip(twin["losses"], ref["losses"], loss_scale(ref["losses"]))])
    norm_gap = _envelope([abs(x - y) / abs(y) for x, y in zip(twin["norms"], ref["norms"])])
    return {"loss": [LOSS_TOL] + [max(LOSS_TOL, g) for g in loss_gap[1:]],
            "norm": [NORM_TOL] + [max(NORM_TOL, g) for g in norm_gap[1:]],
            "grads": GRAD_TOL, "state": max(STATE_TOL, tensor_gap(twin["state"], ref["state"]))}


def reference_in_rank(overrides: list[str], data_dir: str, make_task=None, before_fit=None) -> dict:
    """A proof's single-process reference and its twin: the reference's proof dict, with
    the tolerances that layouts are held to under `tol` (proof_tolerances)."""
    ref = proof_in_rank(overrides, data_dir, make_task, before_fit)
    twin = proof_in_rank(overrides, data_dir, make_task, before_fit, twin=True)
    ref["tol"] = proof_tolerances(ref, twin)
    return ref


def assert_tensors_close(a: dict, b: dict, tol: float, what: str) -> float:
    """Element-wise: max |a − b| ≤ tol · max |b| for every tensor; returns the largest ratio."""
    assert a.keys() == b.keys(), f"{what}: names differ: {sorted(set(a) ^ set(b))[:5]}"
    worst = 0.0
    for k in b:
        scale = b[k].abs().max().double().clamp_min(1e-300)  # in fp64: an all-zero fp32 tensor gives 0, not 0/0
        ratio = float((a[k] - b[k]).abs().max().double() / scale)
        assert ratio <= tol, f"{what} {k}: max difference {ratio:.2e} of its largest element > {tol:g}"
        worst = max(worst, ratio)
    return worst


def assert_proof(run: dict, ref: dict) -> dict:
    """Compare an fp64 proof run with its reference (reference_in_rank) under the tolerance
    rule; returns the largest deviations, each as a fraction of what was allowed."""
    tol = ref["tol"]
    assert len(run["losses"]) == len(ref["losses"])
    worst = {"loss": 0.0, "norm": 0.0}
    for i, (x, y, s) in enumerate(zip(run["losses"], ref["losses"], loss_scale(ref["losses"]))):
        gap = abs(x - y) / s
        assert gap <= tol["loss"][i], f"step {i} loss {x!r} vs {y!r}: {gap:.2e} > {tol['loss'][i]:.2e}"
        worst["loss"] = max(worst["loss"], gap)
    for i, (x, y) in enumerate(zip(run["norms"], ref["norms"])):
        gap = abs(x - y) / abs(y)
        assert gap <= tol["norm"][i], f"step {i} gradient norm {x!r} vs {y!r}: {gap:.2e} > {tol['norm'][i]:.2e}"
        worst["norm"] = max(worst["norm"], gap)
    return {"grads": assert_tensors_close(run["grads"], ref["grads"], tol["grads"], "first-step gradient"),
            "state": assert_tensors_close(run["state"], ref["state"], tol["state"], "final weight"), **worst}


def prove(label: str, run: dict, ref: dict) -> dict:
    """`assert_proof` with the row's label on a failure; prints the deviations (-s)."""
    try:
        d = assert_proof(run, ref)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None
    print(f"{label}: gradients {d['grads']:.1e}, weights {d['state']:.1e}, "
          f"losses {d['loss']:.1e}, norms {d['norm']:.1e}")
    return d


def unwritable_dir(tmp_path: Path) -> Path:
    """A directory nobody here can write to: read-only by mode, or /proc when we are root
    (root ignores modes; /proc takes no new entries)."""
    import os
    d = tmp_path / "read-only"
    d.mkdir(exist_ok=True)
    d.chmod(0o555)
    return d if os.geteuid() != 0 else Path("/proc")


def assert_states_close(a: dict, b: dict, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        err = (a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)
        assert err <= rtol, f"{k}: relative error {err:.2e} > {rtol}"


def assert_losses_close(a: list[float], b: list[float], rtol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * abs(y), f"step {i}: {x} vs {y}"


def refused(argv, root: Path, capsys, fragment: str, code: int = 2) -> str:
    """`ndtrain argv` (in this process) exits `code` with one line on stderr holding
    `fragment`, no traceback, and writes nothing under `root`. Returns the line."""
    from ndtrain.cli import main

    def tree():
        return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))
    before = tree()
    got = main(argv)
    err = capsys.readouterr().err
    assert got == code, err
    assert err.count("\n") == 1 and err.startswith("ndtrain: error: ") and "Traceback" not in err, err
    assert fragment in err, err
    assert tree() == before, "something was written"
    return err
