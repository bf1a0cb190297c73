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
TINY = ["model.preset=tiny", "train.steps=5", "train.global_batch=8", "train.seq_len=32",
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


# The layout proofs: fp64 on the CPU, AdamW's default eps (fp64 removes the round-off that
# TINY's eps works around), tolerances from issue 9: first-step gradients at 1e-10 of each
# tensor's largest element, every loss and the final weights at 1e-9, the gradient norm at 1e-12.
FP64 = ["train.precision=fp64", "train.eps=1e-8"]
GRAD_TOL, STATE_TOL, LOSS_TOL, NORM_TOL = 1e-10, 1e-9, 1e-9, 1e-12


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


def train_in_rank(overrides: list[str], data_dir: str, stop_after: int = 0, run_dir: str | None = None,
                  resume: bool = False, before_fit=None, make_task=None):
    """Build a Trainer on the current world with TINY + overrides and train; returns
    (losses, the full model's weights on rank 0 or None, trainer). `before_fit(trainer)`
    runs just before training (to install a probe or a fault). `make_task(cfg)` gives the
    task (default: pretraining on the prepared `data_dir`)."""
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
    mesh = ParallelMesh.build(mesh_shape(cfg))
    task = make_task(cfg) if make_task else Pretrain(cfg, PreparedData.open(data_dir))
    trainer = Trainer(cfg, mesh, task, Path(run_dir) if run_dir else None)
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


def proof_in_rank(overrides: list[str], data_dir: str, make_task=None) -> dict:
    """One fp64 layout proof run: losses, gradient norms, first-step gradients and final
    weights (the last two whole, on rank 0). `make_task` as in train_in_rank."""
    losses, state, trainer = train_in_rank(FP64 + overrides, data_dir, before_fit=capture_first_grads,
                                           make_task=make_task)
    return {"losses": losses, "norms": [r["grad_norm"] for r in trainer.history],
            "grads": trainer.first_grads, "state": state}


def assert_tensors_close(a: dict, b: dict, tol: float, what: str) -> float:
    """Element-wise: max |a − b| ≤ tol · max |b| for every tensor; returns the largest ratio."""
    assert a.keys() == b.keys(), f"{what}: names differ: {sorted(set(a) ^ set(b))[:5]}"
    worst = 0.0
    for k in b:
        scale = b[k].abs().max().clamp_min(1e-300)
        ratio = float((a[k] - b[k]).abs().max() / scale)
        assert ratio <= tol, f"{what} {k}: max difference {ratio:.2e} of its largest element > {tol:g}"
        worst = max(worst, ratio)
    return worst


def assert_proof(run: dict, ref: dict) -> dict:
    """Compare an fp64 proof run with the single-process one; returns the largest deviations."""
    assert len(run["losses"]) == len(ref["losses"])
    loss = max(abs(x - y) / abs(y) for x, y in zip(run["losses"], ref["losses"]))
    assert loss <= LOSS_TOL, f"losses {run['losses']} vs {ref['losses']}: {loss:.2e} > {LOSS_TOL:g}"
    norm = max(abs(x - y) / abs(y) for x, y in zip(run["norms"], ref["norms"]))
    assert norm <= NORM_TOL, f"gradient norms {run['norms']} vs {ref['norms']}: {norm:.2e} > {NORM_TOL:g}"
    return {"grads": assert_tensors_close(run["grads"], ref["grads"], GRAD_TOL, "first-step gradient"),
            "state": assert_tensors_close(run["state"], ref["state"], STATE_TOL, "final weight"),
            "loss": loss, "norm": norm}


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
