"""A layout's training state as pieces of global tensors: what each rank writes, and how any
layout reads any checkpoint.

The state of training is, for every parameter of the whole model, three global tensors:
`weight/NAME` (the values the optimizer updates: the fp32 masters under bf16/fp16, the
parameters themselves otherwise), `exp_avg/NAME` and `exp_avg_sq/NAME` (AdamW's moments), or
`momentum_buffer/NAME` for the matrices Muon updates (train.optimizer = muon),
plus a few numbers in meta.json (the step, AdamW's step count, the fp16 loss scale).

What a rank holds of them comes from two facts each dimension states about itself:
- `states.optim_slices()` (parallel/states.py, parallel/zero.py): each tensor the
  optimizer updates, and the flat range of which local parameter it holds (a ZeRO shard
  holds a range of its flat buffer, the parameter or its master holds all of it); and
  `states.frozen_slices()`, the same for the weights that do not train (LoRA's base), which
  have no moments;
- `placement.region_of(param)`: where that local parameter sits in the global one (a
  tensor-parallel chunk; a pipeline stage holds whole parameters under global names).
A new dimension that splits parameters only marks their regions; one that shards states
lists its slices. Nothing here knows a dimension by name.

Writing: a piece replicated over some mesh dimensions (a DP replica, a tp-replicated norm)
is written once, and the copies share the work: the pieces of each replication group are
dealt out by size to its ranks, so replicated states are written in parallel too.
Reading: every rank fills each of its pieces from the overlapping stored pieces
(checkpoint/slices.py), reading only the rows it needs, then `states.after_step()` turns
the loaded masters into compute parameters as after an optimizer step (the ZeRO-1/2
all-gather included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ndtrain.checkpoint import store
from ndtrain.checkpoint.slices import Piece
from ndtrain.checkpoint.store import CheckpointError
from ndtrain.mesh import DIMS, ParallelMesh
from ndtrain.model.lora import is_adapter
from ndtrain.parallel.placement import is_duplicate, region_of, shard_dims
from ndtrain.parallel.states import persistent_buffers

MOMENTS = ("exp_avg", "exp_avg_sq")
MUON_STATE = ("momentum_buffer",)  # Muon's (train/muon.py), on the tensors of its "muon" groups
# A tied head held apart from the embedding (on the last pipeline stage) is the embedding.
TIED = {"output.weight": "tok_embeddings.weight", "mtp_embeddings.weight": "tok_embeddings.weight"}
MTP_COPY = {"mtp_embeddings.weight": "tok_embeddings.weight"}  # a pipeline's last stage (model/mtp.py)


@dataclass
class Held:
    """Elements of one global tensor this rank holds: `data` (1-D) is `piece` of it."""

    key: str  # "weight/layers.0.attention.wq.weight"
    piece: Piece
    data: torch.Tensor
    replicated: tuple[str, ...]  # mesh dimensions holding equal copies
    duplicate: bool  # a second copy on this pipeline (the tied head): never written


def held(states, tie_embeddings: bool, moments=None, kinds=("weight",)) -> list[Held]:
    """This rank's pieces of the global tensors of `kinds`. `moments` maps each optimizer
    tensor to its state (`optimizer.state`); a tensor without state has no moments yet.
    With the weights come the model's persistent buffers (`buffer/NAME`: an MoE router's
    bias), whole on every rank of a stage."""
    out = []
    # The weights the optimizer does not update (LoRA's base) are stored too, without moments.
    frozen = [(s, ("weight",)) for s in states.frozen_slices()] if "weight" in kinds else []
    for s, its_kinds in [(s, kinds) for s in states.optim_slices()] + frozen:
        region = region_of(s.param)
        piece = Piece(region.shape, region.offsets, tuple(s.param.shape), s.start, s.stop)
        name = TIED.get(s.name, s.name) if tie_embeddings else MTP_COPY.get(s.name, s.name)
        replicated = replicated_dims(s.holder)
        for kind in its_kinds:
            t = s.holder if kind == "weight" else (moments or {}).get(s.holder, {}).get(kind)
            if t is not None:
                data = t.detach().view(-1)[s.at:s.at + s.stop - s.start]
                out.append(Held(f"{kind}/{name}", piece, data, replicated, is_duplicate(s.holder)))
    if "weight" in kinds:
        everywhere = tuple(d for d in DIMS if d != "pp")
        out += [Held(f"buffer/{name}", Piece.whole(b.shape), b.detach().view(-1), everywhere, False)
                for name, b in states.buffers().items()]
    return out


def replicated_dims(holder: torch.Tensor) -> tuple[str, ...]:
    """The mesh dimensions holding equal copies of what `holder` holds. A routed expert's
    shard (split over "ep", mesh.py) has its copies on the ranks with the same experts:
    dp_replicate, edp_shard (unless ZeRO shards it there too) and tp."""
    dims = shard_dims(holder)
    candidates = ("dp_replicate", "edp_shard", "tp") if "ep" in dims else tuple(d for d in DIMS if d != "pp")
    return tuple(d for d in candidates if d not in dims)


def my_share(pieces: list[Held], mesh: ParallelMesh) -> list[Held]:
    """The pieces this rank writes: each replication group deals its pieces out to its
    ranks, largest load last, so each element is written once and copies share the work.
    Every rank of a group holds the same pieces, so each computes the same deal."""
    groups: dict[tuple[str, ...], list[Held]] = {}
    for h in pieces:
        if not h.duplicate:
            groups.setdefault(h.replicated, []).append(h)
    mine = []
    for dims, items in groups.items():
        live = [d for d in dims if mesh.size(d) > 1]
        size = math.prod(mesh.size(d) for d in live)
        index = 0
        for d in live:
            index = index * mesh.size(d) + mesh.coord(d)
        loads = [0] * size
        for h in sorted(items, key=lambda h: h.key):
            j = loads.index(min(loads))
            loads[j] += h.data.numel() * h.data.element_size()
            if j == index:
                mine.append(h)
    return mine


def finite(t: torch.Tensor) -> bool:
    """Whether every element is finite: a NaN or inf anywhere makes the sum NaN or inf (one
    pass, no temporary); a sum that overflows on finite values is checked element-wise."""
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def all_finite(pieces: list[Held], device: torch.device) -> bool:
    """Whether every element written is finite, agreed by every rank."""
    ok = all(finite(h.data) for h in pieces)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0.0 if ok else 1.0], device=device)
        dist.all_reduce(flag)
        ok = flag.item() == 0
    return ok


def save(run_dir, step: int, par, optimizer: torch.optim.Optimizer, tie_embeddings: bool, meta: dict,
         keep: int = 0):
    """Write the layout's training state as a checkpoint of global tensors. Refuses (on
    every rank) to write NaN or inf. Collective."""
    return store.save(run_dir, step, *share(step, par, optimizer, tie_embeddings, meta), keep)


def share(step: int, par, optimizer: torch.optim.Optimizer, tie_embeddings: bool, meta: dict,
          extra: tuple[dict, tuple[str, ...]] | None = None) -> tuple[list, dict]:
    """What this rank writes of the layout's training state, (key, piece, live 1-D data)
    each, and meta.json's facts. `extra`: more tensors shaped as the optimizer's, ({holder:
    {kind: tensor}}, kinds) (DiLoCo's anchors and outer momentum, replicas/diloco.py).
    Refuses (on every rank) NaN or inf. Collective."""
    pieces = held(par.states, tie_embeddings, optimizer.state, ("weight",) + MOMENTS + MUON_STATE)
    if extra is not None:
        pieces += held(par.states, tie_embeddings, *extra)
    mine = my_share(pieces, par.mesh)
    if not all_finite(mine, par.mesh.device):
        raise CheckpointError(f"step {step}: the weights or optimizer moments hold NaN or inf; "
                              "not saving them as a checkpoint")
    steps = {float(s["step"]) for s in optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(f"step {step}: the optimizer's tensors disagree on their step count {sorted(steps)}")
    mesh = par.mesh
    meta = {**meta, "optimizer_step": steps.pop() if steps else 0,
            "mesh": dict(zip(DIMS, mesh.shape.sizes))}
    return [(h.key, h.piece, h.data) for h in mine], meta


@torch.no_grad()
def load(source, par, tie_embeddings: bool, optimizer: torch.optim.Optimizer | None = None,
         optimizer_step: float = 0) -> bool:
    """Fill this rank's weights (and, given an optimizer and a source that has them, AdamW's
    moments) from `source` (checkpoint/sources.py), whatever layout wrote it. Returns
    whether moments were loaded. Collective (the ZeRO-1/2 all-gather after loading)."""
    with_moments = optimizer is not None and source.has("exp_avg")
    moments = {}
    muon = {id(t) for group in (optimizer.param_groups if optimizer else []) if group.get("muon") for t in group["params"]}
    if optimizer is not None and source.has("momentum_buffer") and not muon:
        raise CheckpointError("the checkpoint holds Muon's momentum (train.optimizer = muon); an AdamW run cannot "
                              "continue it: set train.optimizer=muon")
    if with_moments:  # filled in place where AdamW has them already, else new
        # Every tensor the optimizer updates, also one that holds no parameter's part (a ZeRO
        # slice of alignment padding only): it takes zero moments and the same step count.
        # Muon's tensors take its momentum: from the source, or zeros (an AdamW run continued
        # with Muon; the trainer says so).
        holders = [t for group in optimizer.param_groups for t in group["params"]]
        moments = {t: {k: _moment(optimizer.state.get(t, {}).get(k), t)
                       for k in (MUON_STATE if id(t) in muon else MOMENTS)} for t in holders}
    kinds = ("weight",) + (MOMENTS if with_moments else ()) + (MUON_STATE if with_moments and muon and source.has("momentum_buffer") else ())
    for h in held(par.states, tie_embeddings, moments, kinds):
        if (h.key.startswith("buffer/") or is_adapter(h.key)) and not source.holds(h.key):
            continue  # a source without the buffer (HF weights) or the LoRA adapter: its initial value
        source.fill(h.key, h.piece, h.data)
    if with_moments:
        install_moments(optimizer, moments, optimizer_step)
    par.states.after_step()  # masters → compute parameters, as after a step
    return with_moments


def _moment(current: torch.Tensor | None, holder: torch.Tensor) -> torch.Tensor:
    fits = current is not None and current.shape == holder.shape and current.dtype == holder.dtype
    return current if fits else torch.zeros_like(holder)


def install_moments(optimizer: torch.optim.Optimizer, moments: dict, step: float) -> None:
    """Give AdamW its state through `load_state_dict`, which casts and places each tensor
    as this torch version's AdamW expects."""
    state, i = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in moments:
                state[i] = {"step": torch.tensor(float(step)), **moments[p]}
            i += 1
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


@torch.no_grad()
def load_model(source, model: torch.nn.Module) -> None:
    """Fill a model's parameters from `source`: a plain one-process model (generate,
    convert), or one whose split parameters carry their regions (a tensor-parallel one: RL's
    generation layout), each reading only its box."""
    for name, p in model.named_parameters():  # a tied parameter once, under its first name
        if is_adapter(name) and not source.holds(f"weight/{name}"):
            p.zero_()  # a source without LoRA adapters (the base model): they add nothing
            continue
        region = region_of(p)
        data = torch.empty(p.numel(), dtype=p.dtype)
        source.fill(f"weight/{name}", Piece(region.shape, region.offsets, tuple(p.shape)), data)
        p.copy_(data.view(p.shape).to(p.device))
    for name, b in persistent_buffers(model).items():  # an MoE router's bias steers its choices
        if source.holds(f"buffer/{name}"):
            source.fill(f"buffer/{name}", Piece.whole(b.shape), b.detach().view(-1))
