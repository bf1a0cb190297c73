"""From a plain model to this rank's share of an N-D layout.

`build(args, mesh, cfg)` builds the single-device model (or, under pipeline parallelism,
only this rank's chunks), gives it the same initial weights every layout gives it, applies
each dimension's transformation in a fixed order and returns a `Parallelized`: the local
module plus the objects that run a step on it. The trainer only talks to `Parallelized`, so
adding a dimension changes this file and that dimension's module, never the trainer.

Order of the transformations (each one is a no-op when its dimension has size 1):
1. tensor/sequence parallel module swaps   (parallel/tensor.py)
2. activation recomputation wrappers       (parallel/recompute.py)
3. gradient synchronisation over dp × cp:  DP buckets (parallel/data.py) or ZeRO (parallel/zero.py)
4. the schedule: one stage, or a pipeline  (parallel/pipeline/)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ndtrain.comm import ops
from ndtrain.config import Config
from ndtrain.mesh import ParallelMesh
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.parallel import tensor
from ndtrain.parallel.data import DataParallel
from ndtrain.train.clip import clip_grad_norm_
from ndtrain.train.loss import token_loss_sum
from ndtrain.train.optim import build_optimizer, param_groups, set_lr
from ndtrain.train.schedule import GradSync, MicroBatch, SingleStage

# Which mesh dimensions hold identical copies of a checkpoint part (see checkpoint.store).
REPLICATED_MODEL_DIMS = ("dp_replicate", "dp_shard", "cp")


@dataclass
class Parallelized:
    """This rank's model and the machinery of one training step on it."""

    model: nn.Module
    mesh: ParallelMesh
    grad_sync: GradSync
    optimizer: torch.optim.Optimizer
    schedule: SingleStage
    loss_fn: Callable = token_loss_sum
    # mesh dims over which model / optimizer states are identical copies (for checkpoints)
    model_replicated: tuple[str, ...] = REPLICATED_MODEL_DIMS
    optim_replicated: tuple[str, ...] = REPLICATED_MODEL_DIMS
    extra: dict = field(default_factory=dict)

    # -- one step -------------------------------------------------------------------
    def forward_backward(self, micro_batches: list[MicroBatch], n_targets: float) -> torch.Tensor:
        return self.schedule.run(micro_batches, n_targets, self.grad_sync)

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm_(list(self.model.parameters()), max_norm, self.mesh)

    def optimizer_step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.grad_sync.zero_grad()

    def evaluate(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        return self.schedule.evaluate(micro_batches)

    def reduce_loss(self, local: torch.Tensor) -> float:
        """The step's loss from each rank's share: summed over dp × cp."""
        return ops.all_reduce_scalars([float(local)], self.mesh.group("dp_cp"))[0]

    # -- state ----------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by name, each storage once (a tied head is left out)."""
        return unique_state(self.model)

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        load_unique_state(self.model, state)

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (None elsewhere). Collective over tp on the
        first data-parallel replica; with no model dimension split, rank 0 holds it all."""
        if self.mesh.coord("dp_cp") != 0:
            return None
        state = tensor.full_state(self.model, self.model_state(), self.mesh.group("tp"))
        return state if self.mesh.rank == 0 else None


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def load_unique_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    expected = unique_state(model)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, t in expected.items():
            t.copy_(state[name])


def build_model(args: ModelArgs, seed: int, device: torch.device) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed)
    return model.to(device)


def build(args: ModelArgs, mesh: ParallelMesh, cfg: Config) -> Parallelized:
    tp = mesh.group("tp")
    if tp.active:
        model = tensor.build(args, cfg.train.seed, mesh.device, tp, cfg.parallel.sp)
        loss_fn = tensor.VocabParallelLoss(tp)
    else:
        model = build_model(args, cfg.train.seed, mesh.device)
        loss_fn = token_loss_sum
    bucket_bytes = int(cfg.parallel.bucket_mb * 2**20)
    grad_sync = DataParallel(list(model.parameters()), mesh.group("dp_cp"), bucket_bytes)
    optimizer = build_optimizer(param_groups(model.named_parameters(), cfg.train.weight_decay),
                                cfg.train, mesh.device)
    schedule = SingleStage(model, loss_fn)
    return Parallelized(model, mesh, grad_sync, optimizer, schedule, loss_fn)
