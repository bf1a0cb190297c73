"""The generation layout: the model RL samples from, made from the training layout.

Sampling one token at a time wants every weight of a layer at hand and no collective per
token beyond tensor parallelism's. So generation runs under its own layout, derived from
the training one:

- **tensor parallelism stays**: a tp group generates together, tensor-parallel, each rank
  with its shard of every weight and the KV cache of its heads; the logits are gathered
  over tp (`GatheredLogits`) so every rank of the group draws the same token. Sequence
  parallelism is off (one new token cannot be split along the sequence).
- **every other dimension becomes data parallelism**: each rank holds the whole model (its
  tp shard of it) and generates its own share of the rows. Under DP and ZeRO-1/2 that is
  the training model itself; under context parallelism (whose attention expects the zigzag
  shard of a whole sequence) and sequence parallelism, a plain copy of the rank's own
  weights; under ZeRO-3 and pipeline parallelism, whose ranks hold part of the model, the
  weights are gathered (`Parallelized.full_model_state`, then broadcast), once per rollout
  phase, into a copy that is dropped after it: the training states are never touched.

`generation_model` picks the cheapest of the three; `frozen_copy` always copies (RL's
reference policy). Rows are dealt to the `world / tp` *generation ranks* (`generation_rank`)
and their results gathered back to every rank (`gather_rows`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ndtrain.comm import ops
from ndtrain.config import Config
from ndtrain.mesh import Group, ParallelMesh
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.parallel import tensor
from ndtrain.parallel.construct import replace_parameters
from ndtrain.parallel.parallelize import Parallelized
from ndtrain.parallel.precision import compute_dtype


class GatheredLogits(nn.Module):
    """A tensor-parallel model whose logits come out whole: this rank's vocabulary
    columns all-gathered over tp, the padding columns cut off."""

    def __init__(self, model: Transformer, group: Group):
        super().__init__()
        self.model, self.group, self.args = model, group, model.args

    def forward(self, x: Tensor, **kwargs) -> Tensor:
        local = self.model(x, **kwargs)
        parts = local.new_empty((self.group.size * local.shape[0], *local.shape[1:]))
        ops.all_gather(parts, local.contiguous(), self.group)
        return torch.cat(parts.chunk(self.group.size), dim=-1)[..., :self.args.vocab_size]


def sampling_view(model: nn.Module, group: Group) -> nn.Module:
    """What the sampler calls: the model, or under tensor parallelism the model with its
    logits gathered over the tp `group`."""
    return GatheredLogits(model, group) if group.active else model


def empty_generation_model(par: Parallelized, cfg: Config, args: ModelArgs) -> Transformer:
    """A generation-layout model (plain, or tensor-parallel without SP) in the compute
    dtype, its weights still to be filled."""
    tp, device = par.mesh.group("tp"), par.mesh.device
    if tp.active:
        model = tensor.build(args, tp, sp=False)
    else:
        with torch.device("meta"):
            model = Transformer(args)
    dtype = compute_dtype(cfg.train.precision, cfg.train.fp8_base)
    replace_parameters(model, lambda p: torch.empty(p.shape, dtype=dtype, device=device))
    model.reset_rope(device)
    return model


@torch.no_grad()
def _copy_local(source: nn.Module, target: nn.Module) -> None:
    """Parameters by name: the same layout of weights (CP and SP change modules, not weights)."""
    mine = dict(source.named_parameters())
    for name, p in target.named_parameters():
        p.copy_(mine[name])


@torch.no_grad()
def _copy_gathered(par: Parallelized, target: nn.Module, args: ModelArgs) -> None:
    """The whole model gathered on rank 0 (`full_model_state`), broadcast to every rank
    (over tp, then dp × cp, then pp: rank 0 is first in each), each rank keeping its tp
    slice. Collective."""
    mesh, tp = par.mesh, par.mesh.group("tp")
    state = par.full_model_state()
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Transformer(args).named_parameters()}
    for name, p in target.named_parameters():  # a tied head once, under the embedding's name
        buf = (state[name].to(mesh.device, p.dtype) if state is not None else
               torch.empty(shapes[name], dtype=p.dtype, device=mesh.device))
        for dim in ("tp", "dp_cp", "pp"):
            ops.broadcast(buf, mesh.group(dim), src=0)
        split = tensor.split_of(p)
        p.copy_(tensor.local_slice(buf, split, tp) if split is not None else buf)


def is_generation_ready(par: Parallelized, cfg: Config) -> bool:
    """The training model can generate as it is: whole on each rank (or its tp shard),
    plain attention, no sequence split."""
    p = cfg.parallel
    return p.pp == 1 and p.zero < 3 and p.cp == 1 and not (p.tp > 1 and p.sp)


def generation_model(par: Parallelized, cfg: Config, args: ModelArgs) -> nn.Module:
    """The model to sample from under the generation layout (see the module's doc), with
    the training model's current weights. Collective under ZeRO-3 and pipeline
    parallelism."""
    if is_generation_ready(par, cfg):
        return sampling_view(par.model, par.mesh.group("tp"))
    return frozen_copy(par, cfg, args)


def frozen_copy(par: Parallelized, cfg: Config, args: ModelArgs) -> nn.Module:
    """A copy of the current weights under the generation layout, that training does not
    change. Collective under ZeRO-3 and pipeline parallelism."""
    model = empty_generation_model(par, cfg, args)
    if cfg.parallel.pp == 1 and cfg.parallel.zero < 3:
        _copy_local(par.model, model)
    else:
        _copy_gathered(par, model, args)
    return sampling_view(model.requires_grad_(False), par.mesh.group("tp"))


def generation_rank(mesh: ParallelMesh) -> tuple[int, int]:
    """(this rank's index among the generation ranks, their number): the ranks of one tp
    group generate together; tp is the innermost mesh dimension."""
    tp = mesh.size("tp")
    return mesh.rank // tp, mesh.world // tp


def gather_rows(mine: Tensor, mesh: ParallelMesh) -> Tensor:
    """Every generation rank's `mine` [n, ...] (the same n everywhere), concatenated in
    generation-rank order, on every rank: all-gathered over dp × cp, then over pp."""
    out = mine
    for name in ("dp_cp", "pp"):
        group = mesh.group(name)
        if group.active:
            parts = out.new_empty((group.size * out.shape[0], *out.shape[1:]))
            ops.all_gather(parts, out.contiguous(), group)
            out = parts
    return out
