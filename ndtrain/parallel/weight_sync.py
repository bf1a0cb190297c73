"""Moving the training weights into the generation layout, by collectives on shards.

The generation layout (parallel/generation.py) holds, on every rank, the whole model cut
only by its own tensor parallelism (`rl.generate_tp`), with every expert. The training
layout may have the model cut by ZeRO-3 shards, tensor parallelism, expert parallelism and
pipeline stages. `sync_weights` fills the generation model parameter by parameter, in the
full model's order, every rank taking part in the same collectives in the same order:

1. on the stage that holds the parameter, its training-tp slice, whole over the rest:
   - ZeRO-3: the flat buffer holding it all-gathered over the flat's shard group (once per
     flat, dropped after its last parameter);
   - expert parallelism: the experts all-gathered over `ep`;
2. under pipeline parallelism, broadcast over `pp` from that stage (every pp group at once);
3. when the generation tp differs from the training tp: all-gathered over the training tp
   (on the stage that holds it, before step 2) into the whole tensor, of which each rank
   keeps its generation-tp slice.

No rank gathers the model for the others, nothing is pickled, and no rank holds more than
one flat buffer and one whole parameter beyond the two models. The bytes this takes are
read from the mesh's collective accounting (`comm/stats.py`, wire bytes sent by this rank).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ndtrain.comm import ops
from ndtrain.config import Config
from ndtrain.mesh import Group
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.parallel import tensor
from ndtrain.parallel.parallelize import Parallelized
from ndtrain.parallel.pipeline.partition import chunk_counts, local_chunks, make_chunks
from ndtrain.parallel.placement import expert_slice
from ndtrain.parallel.states import persistent_buffers


@dataclass
class Transfer:
    seconds: float = 0.0
    bytes: float = 0.0  # wire bytes this rank sent


def owners(args: ModelArgs, cfg: Config) -> dict[str, int]:
    """The pipeline stage holding each top-level part of the model ("tok_embeddings",
    "layers.3", "norm", "output"), as parallel/pipeline/stage.py places them."""
    p = cfg.parallel
    if p.pp == 1:
        return {}
    specs = make_chunks(chunk_counts(args, p.pp * p.pp_virtual, cfg.train.seq_len, p.pp_split))
    out = {}
    for stage in range(p.pp):
        for c in local_chunks(stage, p.pp, p.pp_virtual):
            out.update({f"layers.{i}": stage for i in specs[c].layer_ids})
            if specs[c].embed:
                out["tok_embeddings"] = stage
            if specs[c].head:
                out.update(norm=stage, output=stage)
    return out


def stage_of(name: str, table: dict[str, int]) -> int:
    """The stage of a full-model name in `owners`' table."""
    parts = name.split(".")
    return table[".".join(parts[:2])] if parts[0] == "layers" else table[parts[0]]


class StageValues:
    """This rank's training values by full-model name: its training-tp slice, whole over
    ZeRO-3 shards and expert parallelism. Collective over the shard and ep groups of the
    stage, so every rank of the stage asks for the same names in the same order."""

    def __init__(self, par: Parallelized):
        self.par, self.mesh = par, par.mesh
        self.params = dict(par.model.named_parameters())
        self.buffers = persistent_buffers(par.model)
        states = par.states
        self.flats = {}  # name -> (flat, param) under ZeRO-3
        if getattr(states, "stage", 0) == 3:
            self.flats = {states.names[id(p)]: (f, p) for f in states.flats + states.frozen for p in f.params}
        self.gathered: dict[int, tuple[Tensor, int]] = {}  # id(flat) -> (whole buffer, parameters still to read)

    @torch.no_grad()
    def __call__(self, name: str) -> Tensor:
        if name in self.buffers:
            return self.buffers[name]
        if name in self.flats:
            value = self._from_flat(*self.flats[name])
        else:
            value = self.params[name].detach()
        p = self.params[name]
        if expert_slice(p) is not None and self.mesh.group("ep").active:
            ep = self.mesh.group("ep")
            whole = value.new_empty((ep.size * value.shape[0], *value.shape[1:]))
            ops.all_gather(whole, value.contiguous(), ep)
            value = whole
        return value

    def _from_flat(self, f, p) -> Tensor:
        key = id(f)
        if key not in self.gathered:
            whole = torch.empty(f.full.numel(), dtype=f.shard.dtype, device=f.shard.device)
            ops.all_gather(whole, f.shard.contiguous(), f.group)
            self.gathered[key] = (whole, len(f.params))
        whole, left = self.gathered[key]
        value = f.view_of(whole, p).clone()
        if left == 1:
            del self.gathered[key]
        else:
            self.gathered[key] = (whole, left - 1)
        return value


def whole_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """The whole (unsplit) shape of every parameter of the full model, by name."""
    with torch.device("meta"):
        return {n: p.shape for n, p in Transformer(args).named_parameters()}


def stage_values(par: Parallelized, cfg: Config, args: ModelArgs, names: list[str],
                 whole: set[str]) -> Iterator[tuple[str, Tensor | None, int]]:
    """For each name in the order given: (name, its value, the pipeline stage that holds it).
    The value is computed on that stage only (None on the others): its training-tp slice,
    whole over ZeRO-3's shards and expert parallelism, and whole over the training tp too for
    the names in `whole`. Collective over each stage's shard, ep and tp groups, so every rank
    asks for the same names in the same order. What the value may be: a view of the live
    parameter (no copy), so it is read before the optimizer changes the weights."""
    mesh = par.mesh
    values = StageValues(par)
    table, pp = owners(args, cfg), mesh.group("pp")
    for name in names:
        stage = stage_of(name, table) if pp.active else 0
        value = values(name) if stage == mesh.coord("pp") else None
        if value is not None and name in whole:
            value = _whole_over_tp(value, values.params[name], mesh.group("tp"))
        yield name, value, stage


@torch.no_grad()
def sync_weights(par: Parallelized, cfg: Config, args: ModelArgs, target: nn.Module, gen_tp: Group) -> Transfer:
    """Copy the training weights (and persistent buffers: the routers' biases) into
    `target`, a generation-layout model whose tensor parallelism is `gen_tp`. Collective
    over every rank. Returns the time and this rank's bytes."""
    mesh = par.mesh
    t0, sent0 = time.perf_counter(), mesh.stats.wire()
    pp = mesh.group("pp")
    shapes = whole_shapes(args)
    targets = dict(target.named_parameters()) | persistent_buffers(target)
    moves_whole = set() if gen_tp.size == mesh.size("tp") else set(shapes)  # each rank keeps its generation-tp slice
    for name, value, stage in stage_values(par, cfg, args, list(targets), moves_whole):
        p, whole = targets[name], name in moves_whole
        if pp.active:  # the stage that holds it sends it to the others of its pp group
            shape = shapes[name] if whole else p.shape
            buf = (value.to(p.dtype).contiguous() if value is not None else
                   torch.empty(shape, dtype=p.dtype, device=mesh.device))
            ops.broadcast(buf, pp, src=stage)
            value = buf
        if whole and tensor.split_of(p) is not None:
            value = tensor.local_slice(value, tensor.split_of(p), gen_tp)
        p.copy_(value)
    if mesh.device.type == "cuda":
        torch.cuda.synchronize(mesh.device)
    return Transfer(time.perf_counter() - t0, mesh.stats.wire() - sent0)


def _whole_over_tp(value: Tensor, p: nn.Parameter, tp: Group) -> Tensor:
    """The whole tensor of a training parameter `p` split over tp (its padding cut off)."""
    split = tensor.split_of(p)
    if split is None or not tp.active:
        return value
    chunks = value.new_empty((tp.size * value.shape[0], *value.shape[1:]))
    ops.all_gather(chunks, value.contiguous(), tp)
    parts = chunks.view(tp.size, *value.shape).unbind(0)
    return torch.cat(parts, dim=split.dim).narrow(split.dim, 0, split.full)
