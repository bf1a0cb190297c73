"""Who holds the model states when they are not sharded (zero = 0), and the optimizer's
parameter groups.

`ReplicatedStates`: every rank of dp × cp holds the whole local model (all of it, or its
tensor-parallel shard, or its pipeline stage), and DP all-reduces its gradients. Under
mixed precision the optimizer updates fp32 masters (precision.py). `zero.ZeRO` is the
sharded counterpart with the same methods; the step, clipping, checkpoints and the memory
report read the states only through them.
"""

from __future__ import annotations

import torch
from torch import nn

from ndtrain.parallel.placement import OptimSlice, is_expert, partial_dims
from ndtrain.parallel.precision import MasterWeights


def decays(p: torch.Tensor) -> bool:
    """Matrices (linear weights, embeddings) decay; vectors (norm weights) do not."""
    return p.ndim >= 2


def muon_matrix(name: str, p: torch.Tensor) -> bool:
    """What Muon updates under train.optimizer = muon: a block's weight matrices (attention,
    MLP, shared experts) and the routed experts' stacks (each expert its own matrix); not
    embeddings, the output head, norms, biases or routers, which keep AdamW."""
    parts = name.split(".")
    return ("layers" in parts and "router" not in parts and p.requires_grad
            and (p.ndim == 2 or (p.ndim == 3 and is_expert(p))))


def decay_groups(decay: list, no_decay: list, weight_decay: float, muon: list = ()) -> list[dict]:
    """The optimizer's groups; `muon` (Muon's matrices) decays too, in a group marked "muon"."""
    groups = [{"params": list(muon), "weight_decay": weight_decay, "muon": True},
              {"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def param_groups(named_params, weight_decay: float, muon: bool = False) -> list[dict]:
    """AdamW groups: decoupled weight decay on matrices only; each parameter once. `muon`:
    Muon's matrices (`muon_matrix`) in a group of their own."""
    decay, no_decay, matrices, seen = [], [], [], set()
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (matrices if muon and muon_matrix(name, p) else decay if decays(p) else no_decay).append(p)
    return decay_groups(decay, no_decay, weight_decay, matrices)


class ReplicatedStates:
    """zero = 0: the model's own parameters (or their fp32 masters) are what the optimizer
    updates; `grad_sync` (parallel/data.py) owns the gradient buffers."""

    def __init__(self, model: nn.Module, grad_sync, masters: MasterWeights | None = None):
        self.model, self.grad_sync, self.masters = model, grad_sync, masters

    def param_groups(self, weight_decay: float, muon: bool = False) -> list[dict]:
        named = self.model.named_parameters()
        if self.masters is not None:
            named = ((n, self.masters.master_of(p)) for n, p in named if p.requires_grad)
        return param_groups(named, weight_decay, muon)

    def optim_params(self) -> list[torch.Tensor]:
        if self.masters is not None:
            return self.masters.masters
        return list({id(p): p for p in self.model.parameters() if p.requires_grad}.values())

    def grads_to_optimizer(self, unscale: float) -> None:
        if self.masters is not None:
            self.masters.grads_to_masters([self.grad_sync.grad_of(p) for p in self.masters.params], unscale)

    def partial_grads(self, dim: str) -> list[torch.Tensor]:
        """The synchronised gradients of the parameters marked partial over `dim`."""
        params = {id(p): p for p in self.model.parameters() if p.requires_grad and dim in partial_dims(p)}
        return [self.grad_sync.grad_of(p) for p in params.values()]

    def summed_grad(self, p: torch.Tensor) -> torch.Tensor:
        """Where `p`'s synchronised gradient is (for the pipeline's tied embedding)."""
        return self.grad_sync.grad_of(p)

    def replica_grads(self) -> list[torch.Tensor]:
        """The synchronised gradients a replica group sums with the others' (replicas/), one
        per parameter in registration order: not the buckets, whose layout is the ready
        order of this process's first backward (data.DataParallel._reorder). A restarted
        group's first step still has the registration order there, and where the two differ
        (a pipeline's first stage registers its layers before the embedding) the groups'
        buckets do not line up."""
        params = {id(p): p for p in self.model.parameters() if p.requires_grad}
        return [self.grad_sync.grad_of(p) for p in params.values()]

    def after_step(self) -> None:
        if self.masters is not None:
            self.masters.write_back()

    def drop_grads(self) -> None:
        if self.masters is not None:
            self.masters.drop_grads()

    def optim_slices(self) -> list[OptimSlice]:
        """What the optimizer updates, parameter by parameter: the parameter itself or its
        fp32 master, whole (checkpoint/layout.py reads and writes through this)."""
        out = []
        for name, p in self.model.named_parameters():  # a tied parameter once
            if p.requires_grad:
                holder = self.masters.master_of(p) if self.masters is not None else p
                out.append(OptimSlice(name, p, holder, 0, 0, p.numel()))
        return out

    def frozen_slices(self) -> list[OptimSlice]:
        """The parameters the optimizer does not update (a LoRA run's base weights), each
        whole: what checkpoints store and load besides `optim_slices`."""
        return [OptimSlice(name, p, p, 0, 0, p.numel()) for name, p in self.model.named_parameters()
                if not p.requires_grad]

    def buffers(self) -> dict[str, torch.Tensor]:
        return persistent_buffers(self.model)

    def local_state(self) -> dict[str, torch.Tensor]:
        return unique_state(self.model)

    def gathered_state(self) -> dict[str, torch.Tensor]:
        return self.local_state()

    def gathered_grads(self) -> dict[str, torch.Tensor]:
        """The optimizer's gradients (synchronised, unclipped) by parameter name."""
        out = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                out[name] = self.masters.master_of(p).grad if self.masters is not None else self.grad_sync.grad_of(p)
        return out

    # -- memory accounting (experts=True: only the routed experts' states) --------
    def param_tensors(self, experts: bool = False) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if is_expert(p) or not experts]

    def grad_tensors(self, experts: bool = False) -> list[torch.Tensor]:
        return [b.buffer for b in self.grad_sync.buckets if is_expert(b.params[0]) or not experts]

    def master_tensors(self, experts: bool = False) -> list[torch.Tensor]:
        return [m for m in (self.masters.masters if self.masters else []) if is_expert(m) or not experts]


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers (an MoE router's bias) by name: state that is not a
    parameter, never a parameter (under ZeRO-3 those are views into freed storage, and a
    tied one has two names)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in params}


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with each storage once (a tied weight under its first name)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def load_unique_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a full state (one tensor per storage, as `unique_state` names them) into `model`."""
    expected = unique_state(model)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, t in expected.items():
            t.copy_(state[name])
