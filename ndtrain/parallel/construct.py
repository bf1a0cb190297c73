"""Meta-device construction: every layout is laid out without memory, then each rank
materialises and initialises only what it keeps.

`parallelize.build` creates the model (or this rank's pipeline chunks) on the meta device,
where a parameter has a shape and carries its placement marks but holds no memory; tensor
parallelism swaps modules there too (its parameters are this rank's chunk, still on meta).
Then exactly one owner gives each parameter its memory and its value:
- ZeRO (parallel/zero.py) packs a unit's parameters into a flat buffer, allocates and fills
  only this rank's slice (and its fp32 master); under ZeRO-3 the full buffer gets memory
  only while a unit is gathered. The parameters become views into the buffer.
- otherwise `materialize` allocates each parameter whole (it is replicated over dp × cp).

Values come from model/init.py: each element of a parameter's initial value is a function of
the seed, the global parameter name and the element's global index (a counter-based
generator), so a rank computes exactly the elements it keeps, on its device, and every
layout starts from the weights one process starts from, bit for bit. Initialisation work
and memory per rank are proportional to its shard (`Initializer.generated` counts the
elements; tests/test_init.py checks it). `ndtrain train --dry-run` prints the construction
peak per rank.

A meta parameter cannot become a real one in place, so each is replaced by a new
`nn.Parameter` in every module that holds it: a parameter held twice (a tied embedding and
head) stays one object, and the placement marks (shard dims, regions, tensor-parallel
splits) move to the new object.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ndtrain.mesh import Group
from ndtrain.model.args import ModelArgs
from ndtrain.model.init import Region, initial_values
from ndtrain.parallel.placement import expert_slice
from ndtrain.parallel.tensor import split_of


def parameter_names(model: nn.Module) -> dict[int, str]:
    """Global name of every parameter by identity (a tied parameter: its first name)."""
    return {id(p): n for n, p in model.named_parameters()}


class Initializer:
    """`init(p, lo, hi)`: flat elements lo .. hi − 1 (default: all) of the fp32 initial value
    of what parameter `p` of `model` holds (this rank's tensor-parallel chunk of the full
    initial value, its experts of a stack split by expert parallelism, or all of it), on
    `device`. Only those elements are computed (model/init.py); `generated` counts them."""

    def __init__(self, model: nn.Module, args: ModelArgs, seed: int, tp: Group, device: torch.device | str = "cpu"):
        self.names, self.args, self.seed, self.tp, self.device = parameter_names(model), args, seed, tp, device
        self.generated = 0

    def region(self, p: nn.Parameter) -> Region:
        """Where p's tensor sits in the full parameter."""
        full, offset = list(p.shape), [0] * p.ndim
        split, experts = split_of(p), expert_slice(p)
        if experts is not None and experts[1] != p.shape[0]:  # this rank's experts of the stack
            offset[0], full[0] = experts
        if split is not None:  # a tensor-parallel chunk, padded to t equal chunks
            full[split.dim] = split.full
            offset[split.dim] = self.tp.rank * math.ceil(split.full / self.tp.size)
        return Region(tuple(full), tuple(offset), tuple(p.shape))

    def __call__(self, p: nn.Parameter, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        values = initial_values(self.names[id(p)], self.region(p), self.args, self.seed, lo, hi, self.device)
        self.generated += values.numel()
        return values


def initializer(model: nn.Module, args: ModelArgs, seed: int, tp: Group,
                device: torch.device | str = "cpu") -> Initializer:
    return Initializer(model, args, seed, tp, device)


def new_parameter(old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter holding `data` with `old`'s marks. Made empty and given its data after:
    one made from a view of a ZeRO buffer directly would share the buffer's version counter,
    and every regather would look like an in-place change to autograd."""
    q = nn.Parameter(torch.empty(0, dtype=data.dtype, device=data.device), requires_grad=old.requires_grad)
    q.data = data
    q.__dict__.update(old.__dict__)  # placement marks live in the instance dict
    return q


def swap_parameters(model: nn.Module, new: dict[int, nn.Parameter]) -> None:
    """Put `new[id(p)]` in place of every parameter p of `model`, in every module holding it."""
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[key] = new[id(p)]


def replace_parameters(model: nn.Module, make: Callable[[nn.Parameter], torch.Tensor]) -> dict[int, nn.Parameter]:
    """Put a parameter holding `make(p)` in place of every parameter p of `model`; returns
    {id(old): new}."""
    new = {id(p): new_parameter(p, make(p)) for p in {id(p): p for p in model.parameters()}.values()}
    swap_parameters(model, new)
    return new


@torch.no_grad()
def materialize(model: nn.Module, init: Initializer, device: torch.device) -> None:
    """Every parameter allocated on `device` with its initial value (fp32)."""
    replace_parameters(model, lambda p: init(p).to(device).view(p.shape))
