"""One optimizer step on a layout: forward and backward (the layout's), the global-norm
clip, the fp16 loss scale, AdamW, and the memory those moments hold.

`Parallelized` (parallel/parallelize.py) knows where the work runs; `TrainStep` owns what a
step does with the result: the optimizer and its learning rate, the loss scaler, and the
memory report (observe/memory.py).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from ndtrain.config import Config
from ndtrain.data.batch import MicroBatch
from ndtrain.observe.memory import MemoryReport, measure_peak, model_state_bytes
from ndtrain.parallel.clip import clip_grad_norm_, grad_norm
from ndtrain.parallel.fp8 import saved_fp8_bytes
from ndtrain.parallel.parallelize import Parallelized
from ndtrain.parallel.precision import DTYPES, LossScaler, muon_ns_precision
from ndtrain.train.optim import build_optimizer, set_lr


class TrainStep:
    def __init__(self, par: Parallelized, cfg: Config):
        t = cfg.train
        self.par, self.mesh = par, par.mesh
        muon = t.optimizer == "muon"
        groups = par.states.param_groups(t.weight_decay, muon)
        ns = DTYPES[muon_ns_precision(t.muon_ns_dtype, t.precision, t.fp8_base)]
        where = (par.states.optim_slices(), par.mesh.stage_group(), ns) if muon else None
        self.optimizer = build_optimizer(groups, t, par.mesh.device, where)
        self.scaler = None
        if t.precision == "fp16" and t.loss_scaler:
            self.scaler = LossScaler(t.loss_scale_init, t.loss_scale_window, t.loss_scale_min)
        self.memory = MemoryReport()
        self.fp8 = t.precision in ("fp8", "nvfp4")
        self._grad_norm: torch.Tensor | None = None

    def forward_backward(self, micro_batches: list[MicroBatch], n_targets: float | torch.Tensor,
                         measure_memory: bool = False) -> torch.Tensor:
        """The layout's forward and backward of every micro-batch, under the fp16 loss scale
        (a power of two: exact). `measure_memory` records the peak the passes allocate.
        `n_targets` may be a 0-dim fp32 tensor on the device (the trainer's: no host sync)."""
        scale = self.scaler.scale if self.scaler else 1.0
        held = self.held_bytes() if measure_memory else 0
        meter = measure_peak(self.mesh.device) if measure_memory else nullcontext()
        if measure_memory and self.fp8:
            saved_fp8_bytes(self.par.model, reset=True)
        with meter as peak:
            local = self.par.forward_backward(micro_batches, n_targets / scale, 1.0 / scale)
        if measure_memory:
            self.memory.activations, self.memory.peak = peak["bytes"], held + peak["bytes"]
            if self.fp8:
                self.memory.fp8_saved = saved_fp8_bytes(self.par.model, reset=True)
        return local / scale

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm; returns the norm (fp64, on the device)."""
        self._grad_norm = clip_grad_norm_(self.par.states.optim_params(), max_norm, self.mesh)
        return self._grad_norm

    def optimizer_step(self, lr: float) -> bool:
        """Apply the step; False when the fp16 loss scaler skipped it (gradients not finite).
        Under fp16 this reads the norm on the host: the one host sync of an fp16 step (the
        scale of the next step depends on it; docs/architecture.md, "Host syncs")."""
        par = self.par
        if self.scaler is not None:
            norm = self._grad_norm
            if norm is None:
                norm = grad_norm(par.states.optim_params(), self.mesh)
            if not self.scaler.update(math.isfinite(norm.item())):  # raises at the minimum scale
                par.states.drop_grads()
                par.grad_sync.zero_grad()
                self._grad_norm = None
                return False
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        par.states.after_step()
        par.after_step()
        # Right after the step, while the gradients still exist: the moment model states peak.
        m = self.memory
        m.params, m.grads, m.optimizer = model_state_bytes(par.states, self.optimizer)
        if par.balance is not None:  # an MoE model: the routed experts' share
            m.expert_params, m.expert_grads, m.expert_optimizer = model_state_bytes(par.states, self.optimizer, True)
        par.grad_sync.zero_grad()
        self._grad_norm = None
        return True

    def held_bytes(self) -> int:
        return sum(model_state_bytes(self.par.states, self.optimizer))
