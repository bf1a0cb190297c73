"""The generation layout: the model RL samples from, made from the training layout.

Sampling one token at a time wants every weight of a layer at hand and no collective per
token beyond tensor parallelism's. So generation runs under its own layout
(`GenerationLayout`): tensor parallelism of `rl.generate_tp` ranks (by default the
training's tp), and data parallelism over the `world / generate_tp` groups of consecutive
ranks, each holding the whole model (its tp shard of it, every expert) and generating its
own share of the rows:

- **tensor parallelism**: a group generates together, each rank with its shard of every
  weight and the KV cache of its heads; the logits are gathered over the group
  (`GatheredLogits`) so every rank of it draws the same token. Sequence parallelism is off
  (one new token cannot be split along the sequence); a mixture of experts runs whole on
  every rank of the group (experts are never split by tp).
- **the training model itself** generates where it already has that form: the same tp,
  no pipeline, ZeRO below 3, no context parallelism, no sequence parallelism under tp, and
  for an MoE model no tp and no expert parallelism (whose blocks split the tokens or the
  experts of each forward). Otherwise the generation model is a copy, made once, whose
  weights are refilled from the training layout by collectives on the shards before each
  rollout (parallel/weight_sync.py), timed and counted (`Transfer`).

`frozen_copy` always copies (RL's reference policy). Rows are dealt to the generation
ranks and every rank receives every row (`gather_rows`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ndtrain.comm import ops
from ndtrain.config import Config
from ndtrain.mesh import Group, ParallelMesh
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.parallel import expert, tensor
from ndtrain.parallel.construct import replace_parameters
from ndtrain.parallel.parallelize import Parallelized
from ndtrain.parallel.precision import compute_dtype
from ndtrain.parallel.vocab_loss import VocabParallelNLL
from ndtrain.parallel.weight_sync import Transfer, sync_weights


class GatheredLogits(nn.Module):
    """A tensor-parallel model whose logits come out whole: this rank's vocabulary
    columns all-gathered over tp, the padding columns cut off."""

    def __init__(self, model: Transformer, group: Group):
        super().__init__()
        self.model, self.group, self.args = model, group, model.args

    @property
    def nll(self) -> VocabParallelNLL:
        """Each position's loss from this rank's logit columns (a `head_fn`'s, model/loss.chunked_nll)."""
        return VocabParallelNLL(self.group)

    def forward(self, x: Tensor, **kwargs) -> Tensor:
        if kwargs.get("head_fn") is not None:  # the head's output goes to the function: nothing to gather
            return self.model(x, **kwargs)
        local = self.model(x, **kwargs)
        parts = local.new_empty((self.group.size * local.shape[0], *local.shape[1:]))
        ops.all_gather(parts, local.contiguous(), self.group)
        return torch.cat(parts.chunk(self.group.size), dim=-1)[..., :self.args.vocab_size]


def sampling_view(model: nn.Module, group: Group) -> nn.Module:
    """What the sampler calls: the model, or under tensor parallelism the model with its
    logits gathered over the tp `group`."""
    return GatheredLogits(model, group) if group.active else model


class GenerationLayout:
    """The generation ranks and their tensor-parallel groups: `rl.generate_tp` consecutive
    ranks each (the training tp group when the sizes agree). Every rank creates every new
    group, in the same order, as `new_group` requires."""

    def __init__(self, mesh: ParallelMesh, cfg: Config):
        self.mesh = mesh
        size = cfg.rl.generate_tp or mesh.size("tp")
        self.tp = self._tp_group(mesh, size)
        self.rank, self.count = mesh.rank // size, mesh.world // size
        self.world = (Group("world", list(range(mesh.world)), mesh.rank, dist.group.WORLD, mesh.stats, mesh.device)
                      if mesh.world > 1 else Group("world", [0], 0, None, mesh.stats, mesh.device))

    @staticmethod
    def _tp_group(mesh: ParallelMesh, size: int) -> Group:
        if size == mesh.size("tp"):
            return mesh.group("tp")
        mine = None
        for first in range(0, mesh.world, size):
            ranks = list(range(first, first + size))
            pg = dist.new_group(ranks) if size > 1 else None
            if mesh.rank in ranks:
                mine = Group("generate_tp", ranks, ranks.index(mesh.rank), pg, mesh.stats, mesh.device)
        return mine

    @property
    def ranks(self) -> tuple[int, int]:
        """(this rank's index among the generation ranks, their number)."""
        return self.rank, self.count


def empty_generation_model(par: Parallelized, cfg: Config, args: ModelArgs, tp: Group) -> Transformer:
    """A generation-layout model (plain, or tensor-parallel over `tp` without SP) in the
    compute dtype, its weights still to be filled, the routers' biases zero."""
    device = par.mesh.device
    if tp.active:
        model = tensor.build(args, tp, sp=False)
    else:
        with torch.device("meta"):
            model = Transformer(args)
    dtype = compute_dtype(cfg.train.precision, cfg.train.fp8_base)
    replace_parameters(model, lambda p: torch.empty(p.shape, dtype=dtype, device=device))
    model.reset_rope(device)
    expert.materialize_buffers(model, device)
    return model


def is_generation_ready(cfg: Config, args: ModelArgs) -> bool:
    """The training model can generate as it is (the module's doc)."""
    p = cfg.parallel
    same_tp = cfg.rl.generate_tp in (0, p.tp)
    moe_ok = not args.is_moe or (p.tp == 1 and p.ep == 1)
    return same_tp and moe_ok and p.pp == 1 and p.zero < 3 and p.cp == 1 and not (p.tp > 1 and p.sp)


class Generator:
    """The model rollouts sample from, under the generation layout, with the training
    model's current weights (`model()`, collective when it copies), and the last
    transfer's time and bytes."""

    def __init__(self, par: Parallelized, cfg: Config, args: ModelArgs, layout: GenerationLayout):
        self.par, self.cfg, self.args, self.layout = par, cfg, args, layout
        self.copy: Transformer | None = None
        self.transfer = Transfer()

    def model(self) -> nn.Module:
        if is_generation_ready(self.cfg, self.args):
            self.transfer = Transfer()
            return sampling_view(self.par.model, self.layout.tp)
        if self.copy is None:
            self.copy = empty_generation_model(self.par, self.cfg, self.args, self.layout.tp).requires_grad_(False)
        self.transfer = sync_weights(self.par, self.cfg, self.args, self.copy, self.layout.tp)
        return sampling_view(self.copy, self.layout.tp)


def frozen_copy(par: Parallelized, cfg: Config, args: ModelArgs, layout: GenerationLayout) -> nn.Module:
    """A copy of the current weights under the generation layout, that training does not
    change. Collective."""
    model = empty_generation_model(par, cfg, args, layout.tp).requires_grad_(False)
    sync_weights(par, cfg, args, model, layout.tp)
    return sampling_view(model, layout.tp)


def gather_rows(mine: Tensor, layout: GenerationLayout) -> Tensor:
    """Every generation rank's `mine` [n, ...] (the same n everywhere), concatenated in
    generation-rank order, on every rank (all-gathered over the world; the ranks of a
    generation tp group hold the same rows, so one of each group is kept)."""
    world = layout.world
    if not world.active:
        return mine
    parts = mine.new_empty((world.size * mine.shape[0], *mine.shape[1:]))
    ops.all_gather(parts, mine.contiguous(), world)
    return parts.view(world.size, *mine.shape)[::layout.tp.size].flatten(0, 1)
