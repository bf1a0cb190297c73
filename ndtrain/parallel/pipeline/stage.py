"""This rank's share of the pipeline: its chunks, one module holding them under the full
model's parameter names, the tied embedding across the first and last stage, and the
gathering of every stage's weights for a checkpoint.

Each chunk is a `Transformer(args, layer_ids, embed, head)`: the model's own code, holding
only some blocks, with the same parameter names and (by name) the same initial values as in
the full model. Transformations that swap modules (tensor parallelism) apply to each chunk;
`StageModel` is built after them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ndtrain.comm import ops
from ndtrain.config import Config
from ndtrain.mesh import DIMS, Group, ParallelMesh
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.parallel.pipeline.partition import chunk_counts, local_chunks, make_chunks
from ndtrain.parallel.pipeline.schedules import vshape
from ndtrain.parallel.placement import is_duplicate, mark_duplicate


def build_chunks(args: ModelArgs, mesh: ParallelMesh, cfg: Config, make: Callable) -> dict[int, Transformer]:
    """This rank's chunks, by their index in the pipeline. `make(layer_ids, embed, head)`
    builds one on mesh.device with the full model's initial values (parallelize.decoder)."""
    p = cfg.parallel
    counts = chunk_counts(args, p.pp * p.pp_virtual, cfg.train.seq_len, p.pp_split)
    specs = make_chunks(counts)
    chunks = {}
    for c in local_chunks(mesh.coord("pp"), p.pp, p.pp_virtual, vshape(p.pp_schedule)):
        spec = specs[c]
        chunk = make(spec.layer_ids, spec.embed, spec.head)
        copy = embedding_copy(chunk, args)
        if copy is not None:
            # The last stage's copy of the embedding (the tied head, multi-token prediction's
            # input embedding): its gradient is summed with the first stage's (TiedEmbedding),
            # and the global norm and checkpoints must count it once.
            mark_duplicate(copy)
        chunks[c] = chunk
    return chunks


def embedding_copy(chunk: nn.Module, args: ModelArgs) -> torch.Tensor | None:
    """The copy of the input embedding that a chunk with the output head and without the
    embedding holds: the tied head's weight, or multi-token prediction's embedding
    (model/mtp.py; one weight when both); None elsewhere."""
    if getattr(chunk, "output", None) is None or getattr(chunk, "tok_embeddings", None) is not None:
        return None
    if args.tie_embeddings:
        return chunk.output.weight
    mtp = getattr(chunk, "mtp_embeddings", None)
    return mtp.weight if mtp is not None else None


class StageModel(nn.Module):
    """The chunks of one rank as one module whose parameter names are the full model's
    ("layers.5.attention.wq.weight"), for the optimizer, checkpoints and gradient sync.
    It is never called: the schedule runs the chunks."""

    def __init__(self, chunks: dict[int, Transformer]):
        super().__init__()
        self.layers = nn.ModuleDict()
        for chunk in chunks.values():
            if chunk.tok_embeddings is not None:
                self.tok_embeddings = chunk.tok_embeddings
            self.layers.update(chunk.layers)
        for chunk in chunks.values():
            if chunk.output is not None:
                self.norm, self.output = chunk.norm, chunk.output
                if chunk.mtp is not None:  # multi-token prediction (model/mtp.py), with the head
                    self.mtp, self.mtp_embeddings = chunk.mtp, chunk.mtp_embeddings

    def forward(self, *args):
        raise RuntimeError("a pipeline stage is run by its schedule, chunk by chunk")


class TiedEmbedding:
    """Input embedding (first chunk) and its copy on the last chunk (the tied output head,
    multi-token prediction's input embedding: `embedding_copy`) are one weight held twice:
    after the backward pass their gradients are summed over the two, so both copies take the
    same optimizer step and stay equal. `grad_of(weight)` is where the layout keeps the
    weight's synchronised gradient (its fp32 accumulator, or its ZeRO slice: the two ends
    hold the weight alone in a flat buffer of the same size, so their slices line up). The
    ends are the first and last pipeline ranks, or (a V) both on the first rank: then the
    sum is local."""

    def __init__(self, mesh: ParallelMesh, model: nn.Module, grad_of: Callable[[torch.Tensor], torch.Tensor],
                 v_shape: bool = False, tied: bool = True):
        """`tied`: the copy is the output head (tied embeddings), else multi-token
        prediction's embedding (`model.mtp_embeddings`)."""
        self.grad_of = grad_of
        self.group: Group | None = None
        self.weights: list[torch.Tensor] = []
        copy = lambda: model.output.weight if tied else model.mtp_embeddings.weight  # noqa: E731 (last stage)
        if v_shape:
            if mesh.is_first_stage:
                self.weights = [model.tok_embeddings.weight, copy()]
            return
        for ranks in mesh.shape.group_ranks(("pp",)):  # every rank creates every group, in the same order
            ends = [ranks[0], ranks[-1]]
            pg = dist.new_group(ends)
            if mesh.rank in ends:
                self.group = Group("pp_ends", ends, ends.index(mesh.rank), pg, mesh.stats, mesh.device)
        if self.group is not None:
            self.weights = [model.tok_embeddings.weight if mesh.is_first_stage else copy()]

    def sync(self) -> None:
        if self.group is not None:
            ops.all_reduce(self.grad_of(self.weights[0]), self.group)
        elif self.weights:
            embedding, head = (self.grad_of(w) for w in self.weights)
            embedding += head
            head.copy_(embedding)


def stage_is_gathered_here(mesh: ParallelMesh) -> bool:
    """Whether this rank speaks for its stage when the full model is gathered: the rank at
    coordinate 0 of every dimension but pp."""
    return all(mesh.coords[d] == 0 for d in DIMS if d != "pp")


def gather_stages(model: nn.Module, state: dict[str, torch.Tensor], mesh: ParallelMesh) -> dict | None:
    """The full model on rank 0 from each stage's weights `state` (the stage's whole weights,
    on the rank that speaks for it). Duplicates (a tied head) are left out, as in the full
    model's own state. Collective over the pp group of rank 0; None elsewhere."""
    if not stage_is_gathered_here(mesh):
        return None
    duplicates = {name for name, p in model.named_parameters() if is_duplicate(p)}
    local = {k: v.detach().cpu() for k, v in state.items() if k not in duplicates}
    group = mesh.group("pp")
    out = [None] * group.size if mesh.rank == 0 else None
    dist.gather_object(local, out, dst=group.ranks[0], group=group.pg)
    if mesh.rank != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    for stage in out:
        full.update(stage)
    return full
