"""From a plain model to this rank's share of an N-D layout.

`build(args, mesh, cfg)` builds the single-device model (or, under pipeline parallelism,
only this rank's chunks), gives it the same initial weights every layout gives it, applies
each dimension's transformation in a fixed order and returns a `Parallelized`: the local
module plus the objects that run a step on it. The trainer only talks to `Parallelized`, so
adding a dimension changes this file and that dimension's module, never the trainer.

Order of the transformations (each one is a no-op when its dimension has size 1):
1. tensor/sequence parallel module swaps   (parallel/tensor.py)
2. activation recomputation wrappers       (parallel/recompute.py)
3. gradient synchronisation over dp × cp:  DP buckets (parallel/data.py) or ZeRO (parallel/zero.py),
   each with the compute dtype and fp32 masters of parallel/precision.py
4. the schedule: one stage, or a pipeline  (parallel/pipeline/)

Who holds the model states is `Parallelized.states`: `ReplicatedStates` (zero = 0: the
model's own parameters, plus fp32 masters under mixed precision) or `zero.ZeRO` (flat
shards). The optimizer updates `states.optim_params()`, clipping measures their gradients,
and checkpoints and the memory report read the states through the same few methods.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ndtrain.comm import ops
from ndtrain.config import Config
from ndtrain.mesh import ParallelMesh
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.observe.memory import MemoryReport, measure_peak, optimizer_tensors, storage_bytes
from ndtrain.parallel import tensor
from ndtrain.parallel.data import DataParallel
from ndtrain.parallel.pipeline.executor import PipelineSchedule
from ndtrain.parallel.pipeline.stage import StageModel, TiedEmbedding, build_chunks, gather_stages
from ndtrain.parallel.placement import partial_dims
from ndtrain.parallel.precision import (LossScaler, MasterWeights, cast_parameters, compute_dtype,
                                        reduce_dtype)
from ndtrain.parallel.recompute import apply_recompute
from ndtrain.parallel.zero import ZeRO
from ndtrain.train.clip import clip_grad_norm_, grad_norm
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
    schedule: SingleStage | PipelineSchedule
    loss_fn: Callable = token_loss_sum
    # mesh dims over which model / optimizer states are identical copies (for checkpoints)
    model_replicated: tuple[str, ...] = REPLICATED_MODEL_DIMS
    optim_replicated: tuple[str, ...] = REPLICATED_MODEL_DIMS
    extra: dict = field(default_factory=dict)
    states: "ReplicatedStates | ZeRO | None" = None  # None: the model's own parameters
    scaler: LossScaler | None = None  # fp16 only
    memory: MemoryReport = field(default_factory=MemoryReport)

    def __post_init__(self):
        if self.states is None:
            self.states = ReplicatedStates(self.model, self.grad_sync)
        self._grad_norm: float | None = None

    # -- one step -------------------------------------------------------------------
    def forward_backward(self, micro_batches: list[MicroBatch], n_targets: float,
                         measure_memory: bool = False) -> torch.Tensor:
        """Forward and backward of every micro-batch, gradients synchronised and handed to
        the optimizer's tensors. `measure_memory` records the peak the passes allocate."""
        scale = self.scaler.scale if self.scaler else 1.0  # a power of two: exact
        held = self.held_bytes() if measure_memory else 0
        meter = measure_peak(self.mesh.device, self._working_bytes) if measure_memory else nullcontext()
        with meter as peak:
            local = self.schedule.run(micro_batches, n_targets / scale, self.grad_sync)
        tp = self.mesh.group("tp")
        if tp.active:  # once per step: the sum of gradients each tp rank holds a part of
            tensor.sum_partial_grads(self.states.partial_grads("tp"), tp)
        if measure_memory:
            self.memory.activations, self.memory.peak = peak["bytes"], held + peak["bytes"]
        self.states.grads_to_optimizer(1.0 / scale)
        return local / scale

    def clip_grad_norm(self, max_norm: float) -> float:
        self._grad_norm = clip_grad_norm_(self.states.optim_params(), max_norm, self.mesh)
        return self._grad_norm

    def optimizer_step(self, lr: float) -> bool:
        """Apply the step; False when the fp16 loss scaler skipped it (gradients not finite)."""
        if self.scaler is not None:
            norm = self._grad_norm
            if norm is None:
                norm = grad_norm(self.states.optim_params(), self.mesh).item()
            if not self.scaler.update(math.isfinite(norm)):  # raises at the minimum scale
                self.states.drop_grads()
                self.grad_sync.zero_grad()
                self._grad_norm = None
                return False
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.states.after_step()
        self._measure_model_states()
        self.grad_sync.zero_grad()
        self._grad_norm = None
        return True

    def evaluate(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        return self.schedule.evaluate(micro_batches)

    def reduce_loss(self, local: torch.Tensor) -> float:
        """The step's loss from each rank's share: summed over dp × cp, and over pp, where
        only the last stage holds a loss."""
        total = ops.all_reduce_scalars([float(local)], self.mesh.group("dp_cp"))
        return ops.all_reduce_scalars(total, self.mesh.group("pp"))[0]

    # -- memory -----------------------------------------------------------------------
    def _measure_model_states(self) -> None:
        """Bytes held right after the optimizer step, while the gradients still exist:
        the moment model states peak (observe/memory.py)."""
        seen: set = set()
        self.memory.params = storage_bytes(self.states.param_tensors(), seen)
        self.memory.grads = storage_bytes(self.states.grad_tensors(), seen)
        self.memory.optimizer = storage_bytes(self.states.master_tensors() + optimizer_tensors(self.optimizer), seen)

    def held_bytes(self) -> int:
        s = self.states
        return storage_bytes(s.param_tensors() + s.grad_tensors() + s.master_tensors()
                             + optimizer_tensors(self.optimizer))

    def _working_bytes(self) -> int:
        return getattr(self.states, "gathered_bytes", 0)

    # -- state ----------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (or ZeRO-3 slices) by name, each storage once."""
        return self.states.local_state()

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.states.load_local_state(state)

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (None elsewhere). Collective: over the
        ZeRO-3 shards, then over tp on the first data-parallel replica, then over pp
        (every stage sends its weights to rank 0)."""
        state = self.states.gathered_state()
        if self.mesh.coord("dp_cp") != 0:
            return None
        state = tensor.full_state(self.model, state, self.mesh.group("tp"))
        if self.mesh.shape.pp > 1:
            return gather_stages(self.model, state, self.mesh)
        return state if self.mesh.rank == 0 else None

    def optim_state(self) -> dict:
        """The optimizer's moments, plus fp32 masters and the loss scale where they exist."""
        return {"optimizer": self.optimizer.state_dict(), **self.states.extra_state(),
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_optim_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.states.load_extra_state(state)
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


class ReplicatedStates:
    """zero = 0: every rank of dp × cp holds the whole local model, and DP all-reduces its
    gradients. Under mixed precision the optimizer updates fp32 masters (precision.py)."""

    def __init__(self, model: nn.Module, grad_sync: GradSync, masters: MasterWeights | None = None):
        self.model, self.grad_sync, self.masters = model, grad_sync, masters

    def param_groups(self, weight_decay: float) -> list[dict]:
        named = self.model.named_parameters()
        if self.masters is not None:
            named = ((n, self.masters.master_of(p)) for n, p in named if p.requires_grad)
        return param_groups(named, weight_decay)

    def optim_params(self) -> list[torch.Tensor]:
        if self.masters is not None:
            return self.masters.masters
        return list({id(p): p for p in self.model.parameters() if p.requires_grad}.values())

    def grads_to_optimizer(self, unscale: float) -> None:
        if self.masters is not None:
            self.masters.grads_to_masters(unscale)

    def partial_grads(self, dim: str) -> list[torch.Tensor]:
        """The synchronised gradients of the parameters marked partial over `dim`."""
        params = {id(p): p for p in self.model.parameters() if dim in partial_dims(p)}.values()
        return [p.grad for p in params if p.grad is not None]

    def after_step(self) -> None:
        if self.masters is not None:
            self.masters.write_back()

    def drop_grads(self) -> None:
        if self.masters is not None:
            self.masters.drop_grads()

    def local_state(self) -> dict[str, torch.Tensor]:
        return unique_state(self.model)

    def load_local_state(self, state: dict[str, torch.Tensor]) -> None:
        load_unique_state(self.model, state)

    def gathered_state(self) -> dict[str, torch.Tensor]:
        return self.local_state()

    def extra_state(self) -> dict:
        return {"masters": [m.detach() for m in self.masters.masters] if self.masters else []}

    @torch.no_grad()
    def load_extra_state(self, state: dict) -> None:
        for m, saved in zip(self.masters.masters if self.masters else [], state["masters"], strict=True):
            m.copy_(saved)

    def param_tensors(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def grad_tensors(self) -> list[torch.Tensor]:
        buckets = getattr(self.grad_sync, "buckets", None)
        if buckets is not None:
            return [b.buffer for b in buckets]
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def master_tensors(self) -> list[torch.Tensor]:
        return list(self.masters.masters) if self.masters else []


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


def build_model(args: ModelArgs, seed: int, device: torch.device, layer_ids=None, embed: bool = True,
                head: bool = True) -> Transformer:
    model = Transformer(args, layer_ids, embed, head)
    model.init_weights(seed)
    return model.to(device)


def decoder(args: ModelArgs, mesh: ParallelMesh, cfg: Config):
    """`make(layer_ids, embed, head)`: this rank's share of (part of) the decoder, with the
    weights every layout starts from; tensor-parallel modules when tp > 1."""
    tp = mesh.group("tp")

    def make(layer_ids=None, embed: bool = True, head: bool = True) -> Transformer:
        if tp.active:
            return tensor.build(args, cfg.train.seed, mesh.device, tp, cfg.parallel.sp, layer_ids, embed, head)
        return build_model(args, cfg.train.seed, mesh.device, layer_ids, embed, head)
    return make


def build(args: ModelArgs, mesh: ParallelMesh, cfg: Config) -> Parallelized:
    t, p = cfg.train, cfg.parallel
    tp = mesh.group("tp")
    loss_fn = tensor.VocabParallelLoss(tp) if tp.active else token_loss_sum
    pipelined = mesh.shape.pp > 1
    # The whole model, or under pipeline parallelism only this rank's chunks; module swaps
    # (tensor parallelism, in `decoder`) and recomputation wrappers apply to each chunk,
    # before StageModel gathers them under the full model's names for ZeRO or DP.
    make = decoder(args, mesh, cfg)
    chunks = build_chunks(args, mesh, cfg, make) if pipelined else {0: make()}
    for chunk in chunks.values():
        apply_recompute(chunk, t.recompute)
    model = StageModel(chunks) if pipelined else chunks[0]
    dtype, rdtype = compute_dtype(t.precision), reduce_dtype(t.precision, t.reduce_fp32)
    if p.zero:
        states = grad_sync = ZeRO(model, mesh, p.zero, dtype, rdtype, p.reshard_after_forward)
        # Optimizer slices differ across dp_shard × cp; stage 3 splits the parameters too.
        optim_replicated = ("dp_replicate",)
        model_replicated = optim_replicated if p.zero == 3 else REPLICATED_MODEL_DIMS
    else:
        masters = MasterWeights(list(model.parameters())) if dtype != torch.float32 else None
        cast_parameters(list(model.parameters()), dtype)
        bucket_bytes = int(p.bucket_mb * 2**20)
        grad_sync = DataParallel(list(model.parameters()), mesh.group("dp_cp"), bucket_bytes, rdtype)
        states = ReplicatedStates(model, grad_sync, masters)
        model_replicated = optim_replicated = REPLICATED_MODEL_DIMS
    optimizer = build_optimizer(states.param_groups(t.weight_decay), t, mesh.device)
    scaler = None
    if t.precision == "fp16" and t.loss_scaler:
        scaler = LossScaler(t.loss_scale_init, t.loss_scale_window, t.loss_scale_min)
    if pipelined:
        tied = TiedEmbedding(mesh, model) if args.tie_embeddings else None
        schedule = PipelineSchedule(chunks, mesh, p.pp_schedule, p.pp_virtual, loss_fn, tied)
    else:
        schedule = SingleStage(model, loss_fn)
    return Parallelized(model, mesh, grad_sync, optimizer, schedule, loss_fn, model_replicated=model_replicated,
                        optim_replicated=optim_replicated, states=states, scaler=scaler)
