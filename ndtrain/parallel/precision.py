"""Mixed precision: compute in bf16 or fp16, update fp32 master weights, scale fp16 losses.

`train.precision` picks the compute dtype: fp32, bf16, fp16, or fp64 (CPU only: the layout
proofs run in it, so that round-off cannot hide a wrong result); fp8 runs the block linears'
matmuls in fp8 (parallel/fp8.py) and everything else in `train.fp8_base` (bf16 by default),
with that dtype's masters. Under bf16 or fp16:
1. The model's parameters and the gradients autograd writes are in the compute dtype, so
   the matmuls and the activations they save run at half the bytes.
2. The optimizer never sees them. It updates fp32 *master* weights: one per parameter here
   (`MasterWeights`, for replicated parameters, zero = 0), or one flat shard per ZeRO
   buffer (parallel/zero.py). Gradients accumulate over micro-batches in fp32 (the DP
   buckets, ZeRO's full or sharded gradient buffers: each micro-batch's bf16 gradient is
   added into them as soon as autograd produces it), so 32 micro-batches never add up in
   bf16; that accumulator is the master's gradient. After the step, the compute parameters
   receive the master rounded to the compute dtype. Masters start from the fp32 initial values, so at every moment
   `param == master.to(compute dtype)`, which is why a checkpoint needs only both parts to
   resume bit for bit.
3. Gradients are *reduced* in fp32 by default (`train.reduce_fp32`): a low-precision bucket
   is widened to fp32 for the collective and the sum is rounded once when stored. With
   `train.reduce_fp32 = false` the collective runs in the compute dtype, at half the bytes.
4. fp16 has 5 exponent bits: small gradients underflow to zero. `LossScaler` multiplies the
   loss by a power of two S before backward (so every gradient is S times larger, exactly)
   and the fp32 master gradients are multiplied by 1/S. A step whose gradients hold an inf
   or NaN is skipped and S halves; after `loss_scale_window` good steps S doubles. If a
   step overflows at `loss_scale_min`, the scale cannot save it and the run stops.

Whether a step overflowed is read from the global gradient norm that clipping computes
anyway (parallel/clip.py): it is inf or NaN on every rank as soon as one element anywhere is,
so every rank skips the same steps without a collective of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from ndtrain.parallel.placement import copy_placement

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def compute_dtype(precision: str, fp8_base: str = "bf16") -> torch.dtype:
    """The dtype of parameters and activations. Under fp8 (parallel/fp8.py) only the block
    linears' matmul operands are fp8; everything else is `fp8_base`."""
    return DTYPES[fp8_base if precision in ("fp8", "nvfp4") else precision]


def muon_ns_precision(choice: str, precision: str, fp8_base: str = "bf16") -> str:
    """The precision of Muon's Newton–Schulz iteration (train.muon_ns_dtype), as a key of
    DTYPES: `auto` is bf16, as torch.optim.Muon and Keller Jordan's code always run it, except
    where the run computes in fp64 (the layout proofs), which iterate in fp64."""
    if choice == "auto":
        return "fp64" if compute_dtype(precision, fp8_base) == torch.float64 else "bf16"
    return choice


def has_masters(dtype: torch.dtype) -> bool:
    """Whether parameters in `dtype` need fp32 masters for the optimizer (bf16, fp16). In
    fp32, and in fp64 (the CPU layout proofs), the parameters are their own masters."""
    return dtype in (torch.bfloat16, torch.float16)


def reduce_dtype(precision: str, reduce_fp32: bool, fp8_base: str = "bf16") -> torch.dtype:
    dtype = compute_dtype(precision, fp8_base)
    return torch.float32 if reduce_fp32 and has_masters(dtype) else dtype


def master_like(values: torch.Tensor, placement_of: torch.Tensor) -> nn.Parameter:
    """An fp32 master holding `values`, with the placement of the parameter it stands for
    (so the global gradient norm counts it exactly once)."""
    master = nn.Parameter(values.detach().to(torch.float32, copy=True))
    return copy_placement(placement_of, master)


def cast_parameters(params: list[nn.Parameter], dtype: torch.dtype) -> None:
    """Store parameters in `dtype` in place (the module keeps the same Parameter objects)."""
    with torch.no_grad():
        for p in params:
            if p.dtype != dtype:
                p.data = p.data.to(dtype)


class MasterWeights:
    """fp32 masters of replicated low-precision parameters (zero = 0).

    Built while the parameters are still fp32, before they are cast to the compute dtype.
    `masters[i]` belongs to `params[i]`; the optimizer is built on the masters.
    """

    def __init__(self, params: list[nn.Parameter]):
        self.params = list({id(p): p for p in params if p.requires_grad}.values())
        self.masters = [master_like(p, p) for p in self.params]
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters)}

    def master_of(self, p: nn.Parameter) -> nn.Parameter:
        return self._master_of[id(p)]

    @torch.no_grad()
    def grads_to_masters(self, grads: list[torch.Tensor], unscale: float) -> None:
        """Each master's gradient: its parameter's synchronised gradient (`grads[i]`, the fp32
        accumulator of parallel/data.py: taken as it is, no copy), unscaled."""
        for m, g in zip(self.masters, grads, strict=True):
            m.grad = g.float()
            if unscale != 1.0:
                m.grad.mul_(unscale)

    @torch.no_grad()
    def write_back(self) -> None:
        """After the step: the parameters take the updated masters, rounded."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
        self.drop_grads()

    def drop_grads(self) -> None:
        for m in self.masters:
            m.grad = None


class LossScaleExhausted(RuntimeError):
    """fp16 gradients overflowed even at the minimum loss scale."""


class LossScaler:
    """Dynamic loss scaling for fp16: back off on overflow, grow after a window of good steps."""

    GROWTH, BACKOFF = 2.0, 0.5  # powers of two: scaling and unscaling are exact

    def __init__(self, init: float, window: int, min_scale: float):
        self.scale, self.window, self.min_scale = float(init), window, float(min_scale)
        self.good_steps = 0

    def update(self, finite: bool) -> bool:
        """Record a step's outcome; True when the step should be applied."""
        if finite:
            self.good_steps += 1
            if self.good_steps == self.window:
                self.scale *= self.GROWTH
                self.good_steps = 0
            return True
        if self.scale <= self.min_scale:
            raise LossScaleExhausted(
                f"fp16 gradients are not finite even at the minimum loss scale {self.min_scale:g} "
                "(train.loss_scale_min); the model diverged or fp16 cannot hold its gradients: "
                "try train.precision=bf16 or a lower train.lr")
        self.scale = max(self.scale * self.BACKOFF, self.min_scale)
        self.good_steps = 0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
