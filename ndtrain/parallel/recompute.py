"""Activation recomputation: trade compute for the memory of saved activations.

Backward needs tensors that forward saved (inputs of matmuls, softmax outputs, ...). A
*recomputed region* keeps only its inputs: while it runs forward, every tensor autograd
wants to save is replaced by its index, and the first time backward asks for one of them
the region runs forward again, with the same inputs and random state, and hands out the
tensors that second run saved. The gradients are therefore the same, bit for bit.

`train.recompute` chooses the regions:
- `none`: nothing is recomputed;
- `full`: every decoder block (keeps one hidden state per block);
- `every:K`: blocks 0, K, 2K, ... (by global layer index), a middle ground;
- `selective`: only each attention core (rotary, softmax attention, head merge), the part
  whose saved tensors grow with the sequence length but which costs few FLOPs to redo
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models").

Regions wrap a module's `forward` on the instance, so parameter names, module hooks (ZeRO-3
gathers a block in its forward pre-hook and before its backward) and state dicts are
untouched. The second run calls the original `forward` directly: the module's own hooks do
not fire twice.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from ndtrain.config import recompute_every
from ndtrain.model.moe import RoutingLog


class _Region:
    """One forward call of a recomputed region and, later, its second run."""

    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.devices = sorted({a.device.index for a in args
                               if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.count = 0
        self.saved: list[torch.Tensor] | None = None

    def pack(self, tensor: torch.Tensor) -> int:
        index, self.count = self.count, self.count + 1
        return index  # the tensor itself is dropped

    def unpack(self, index: int) -> torch.Tensor:
        if self.saved is None:
            self.saved = self._run_again()
        return self.saved[index]

    def _run_again(self) -> list[torch.Tensor]:
        saved: list[torch.Tensor] = []

        def keep(t):
            # Neither list nor graph may hold the tensor with its grad_fn: the second run's
            # graph would then reach itself through objects Python's collector cannot see
            # (an output saved by its own node), and the whole region would leak.
            saved.append(t.detach())
            return None  # the second run's graph is never differentiated

        # Detached inputs: the second run builds a graph of its own, which is thrown away.
        args = [_for_rerun(a) for a in self.args]
        kwargs = {k: _for_rerun(v) for k, v in self.kwargs.items()}
        with torch.random.fork_rng(devices=self.devices), torch.enable_grad(), \
                saved_tensors_hooks(keep, _never):
            torch.set_rng_state(self.cpu_rng)
            for d, state in zip(self.devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, d)
            self.fn(*args, **kwargs)
        if len(saved) != self.count:
            raise RuntimeError(f"recomputation saved {len(saved)} tensors where forward saved "
                               f"{self.count}: the region is not deterministic")
        return saved


def _never(_):
    raise RuntimeError("the graph of a recomputation cannot be differentiated")


def _for_rerun(a):
    """An argument of the second run: tensors detached; a routing log that records nothing
    (the first run already reported the MoE statistics and loss terms)."""
    if isinstance(a, RoutingLog):
        return a.rerun()
    return a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a


def run_recomputed(fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, keeping none of its saved activations (see module docstring).
    Called through `_opaque()`, so opaque to torch.compile: a compiled block around a region
    breaks its graph there, and a compiled `fn` inside one is the same code in both runs
    (parallel/compile.py)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    region = _Region(fn, args, kwargs)
    with saved_tensors_hooks(region.pack, region.unpack):
        return fn(*args, **kwargs)


@functools.cache
def _opaque():
    """`run_recomputed` excluded from torch.compile's tracing, made on first use:
    `torch.compiler.disable` imports dynamo (about a second), which a process that builds no
    optimizer (a command's parent, `plan`, `prepare`) never needs; torch.optim imports it in
    every training rank anyway, so the fork servers preload it (supervisor.BASE_PRELOAD)."""
    return torch.compiler.disable(run_recomputed)


def recompute_module(module: nn.Module) -> None:
    """Make every forward call of `module` a recomputed region."""
    module.forward = functools.partial(_opaque(), module.forward)


def regions(model: nn.Module, spec: str) -> dict[str, nn.Module]:
    """The modules `spec` names, by name, in every decoder (a pipeline stage may hold several).
    The benchmarks hand the same regions to torch's checkpointing (bench/common.py)."""
    if spec == "none":
        return {}
    found = {}
    every = recompute_every(spec)
    for name, module in model.named_modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, nn.ModuleDict):
            continue
        for key, block in layers.items():
            prefix = f"{name}.layers.{key}" if name else f"layers.{key}"
            if spec == "selective":
                found[f"{prefix}.attention.core"] = block.attention.core
            elif int(key) % every == 0:
                found[prefix] = block
    return found


def apply_recompute(model: nn.Module, spec: str) -> list[str]:
    """Make the regions `spec` names recomputed; returns their names."""
    wrapped = regions(model, spec)
    for module in wrapped.values():
        recompute_module(module)
    return list(wrapped)
