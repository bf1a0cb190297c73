"""What the checkpoint tests share: a trainer on the current world that starts the way the
command line does (resume the newest good checkpoint, else `model.init_from`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from helpers import TINY


def make_trainer(overrides: list[str], data_dir: str | list[str], run_dir: str | None):
    """`data_dir`: a prepared directory, or one per source of the config's data.sources."""
    import torch.distributed as dist

    from ndtrain.checkpoint.sources import resolve_init_from
    from ndtrain.config import load_config, validate
    from ndtrain.mesh import ParallelMesh
    from ndtrain.train.tasks import Pretrain
    from ndtrain.train.trainer import Trainer
    from ndtrain.train.worker import mesh_shape, open_prepared, resolve_vocab

    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = load_config(None, TINY + overrides)
    resolve_init_from(cfg)
    validate(cfg, world=world)
    data = open_prepared(cfg, data_dir)
    resolve_vocab(cfg, data)
    mesh = ParallelMesh.build(mesh_shape(cfg))
    return Trainer(cfg, mesh, Pretrain(cfg, data), Path(run_dir) if run_dir else None)


def full_state(trainer) -> dict | None:
    """The whole model's weights on rank 0 (fp32 copies, fp64 in fp64 runs), None elsewhere.
    Collective."""
    full = trainer.par.full_model_state()
    dtype = torch.float64 if trainer.cfg.train.precision == "fp64" else torch.float32
    return {k: v.detach().to(dtype).clone() for k, v in full.items()} if full is not None else None


def train(overrides: list[str], data_dir: str | list[str], run_dir: str | None, before_fit=None):
    """Start (resume or init_from) and train; (losses of the steps run, full weights on rank 0,
    the trainer)."""
    trainer = make_trainer(overrides, data_dir, run_dir)
    trainer.meter_steps = 0  # nothing here reads the activation peak
    trainer.start()
    if before_fit is not None:
        before_fit(trainer)
    trainer.fit()
    return [r["loss"] for r in trainer.history], full_state(trainer), trainer


def copy_checkpoint(src_run: str, step: int, dst_run: str) -> None:
    """Rank 0 copies one checkpoint folder into another run directory; every rank waits."""
    import torch.distributed as dist

    from ndtrain.checkpoint.store import step_dir
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.copytree(step_dir(src_run, step), step_dir(dst_run, step))
    if dist.is_initialized():
        dist.barrier()
