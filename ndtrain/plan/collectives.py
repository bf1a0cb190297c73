"""Collectives in the plan: which link a group's messages take, what one costs, and the
messages data parallelism and ZeRO send, as the engine cuts them.

A collective of S bytes over n ranks takes α + S·factor(n)/β (plan/calibration.py) on the
link inside a node when the group's ranks fit in one, else on the link between nodes. The
mesh (mesh.py) lays ranks out as pp, dp_replicate, dp_shard, cp, tp (tp fastest); an expert
group (ep) is ep consecutive ranks of dp_shard × cp.
"""

from __future__ import annotations

from ndtrain.config import Config
from ndtrain.model.args import ModelArgs
from ndtrain.parallel.pipeline.partition import Chunk
from ndtrain.parallel.placement import flat_layout
from ndtrain.plan.cluster import Cluster
from ndtrain.plan.experts import expert_weights
from ndtrain.plan.params import BYTES, block_weight_groups, block_weights, padded_vocab

INNER_TO_OUTER = ("tp", "cp", "dp_shard", "dp_replicate", "pp")


def sizes(cfg: Config) -> dict[str, int]:
    p = cfg.parallel
    return {"tp": p.tp, "cp": p.cp, "dp_shard": p.dp_shard, "dp_replicate": p.dp_replicate, "pp": p.pp}


def spans_nodes(cfg: Config, dims: tuple[str, ...], gpus_per_node: int) -> bool:
    """Whether a group over `dims` (adjacent in the mesh) reaches beyond one node: its
    ranks lie `stride` apart, stride the product of the dimensions inside it."""
    s = sizes(cfg)
    inner = min(INNER_TO_OUTER.index(d) for d in dims)
    stride = 1
    for d in INNER_TO_OUTER[:inner]:
        stride *= s[d]
    span = stride
    for d in dims:
        span *= s[d]
    return span > gpus_per_node


def group_seconds(cluster: Cluster, kind: str, n: int, spans: bool, nbytes: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return cluster.link(kind, n, spans).seconds(kind, n, nbytes)


def collective(cluster: Cluster, cfg: Config, kind: str, dims: tuple[str, ...], nbytes: float) -> float:
    n = 1
    for d in dims:
        n *= sizes(cfg)[d]
    return group_seconds(cluster, kind, n, spans_nodes(cfg, dims, cluster.gpus_per_node), nbytes)


def _root_weights(args: ModelArgs, ch: Chunk, tp: int) -> tuple[list, list]:
    """A chunk's root parameters (`memory.root_local`) as (elements, is a matrix): those whose
    gradients come first in backward (an untied or copied head, the final norm), and the
    embedding, whose gradient comes last."""
    table = padded_vocab(args, tp) // tp * args.dim
    first = []
    if ch.head:
        first = ([] if args.tie_embeddings and ch.embed else [(table, True)]) + [(args.dim, False)]
    return first, [(table, True)] if ch.embed else []


def _stream(args: ModelArgs, layer: int, tp: int, ep: int, experts: bool) -> list[tuple[int, bool]]:
    """One block's parameters in registration order (the dense ones, or its routed experts)."""
    if experts:
        return expert_weights(args, ep) if args.is_moe_layer(layer) else []
    return block_weights(args, tp, layer)


def _flats(args: ModelArgs, layer: int, tp: int, ep: int, experts: bool) -> list[list[tuple[int, bool]]]:
    """One block's ZeRO flat buffers (parallel/zero.py keys them by placement, decay group and
    expert or not), as lists of (elements, a linear layer's weight): the dense matrices
    (split by t), the vectors, under TP the MoE weights every tp rank holds whole; or the
    rank's routed experts."""
    if experts:
        return [[(n, True) for n, _ in expert_weights(args, ep)]] if args.is_moe_layer(layer) else []
    split, whole = block_weight_groups(args, tp, layer)
    moe = [(n, k > 0) for k, (n, _) in enumerate(whole)]  # the router (first) runs in bf16, shared experts in fp8
    matrices = [(n, True) for n, matrix in split if matrix]
    flats = [matrices + moe, [(n, False) for n, matrix in split if not matrix]] if tp == 1 else \
        [matrices, [(n, False) for n, matrix in split if not matrix], moe]  # tp > 1: the MoE weights are whole
    return [f for f in flats if f]


def dp_flats(cfg: Config, args: ModelArgs, chunks: list[Chunk], experts: bool = False) -> list[tuple[int, int]]:
    """The collectives one data-parallel reduction of a rank's gradients issues, each as
    (elements, of which the weights of linear layers). ZeRO (parallel/zero.py) reduces (and
    ZeRO-1/3 gathers) unit by unit (each block, then each chunk's root), one flat buffer per
    placement and decay group, each parameter and slice aligned (parallel/placement.flat_layout;
    shard group dense: dp_shard × cp; experts: dp_shard·cp/ep). Plain DP (parallel/data.py) packs the gradients, in the order backward
    produces them, into buckets of `parallel.bucket_mb` (in the parameters' dtype), a
    parameter larger than a bucket alone; experts in buckets of their own. Gloo's time per
    byte grows with the message (`bench comm`), and every message pays a latency, so the cut
    matters."""
    p = cfg.parallel
    if experts and not args.is_moe:
        return []
    if p.zero:
        n = p.dp_shard * p.cp // (p.ep if experts else 1)
        units = []
        for ch in chunks:
            units += [f for i in ch.layer_ids for f in _flats(args, i, p.tp, p.ep, experts)]
            if not experts:
                first, last = _root_weights(args, ch, p.tp)
                root = last + first  # registration order: the embedding first
                units += [[(k, False) for k, matrix in root if matrix == group] for group in (True, False)]
        return [(n * flat_layout([k for k, _ in f], n)[2], sum(k for k, linear in f if linear)) for f in units if f]
    stream = []
    for ch in chunks:
        first, last = _root_weights(args, ch, p.tp)
        blocks = [(k, matrix) for i in reversed(ch.layer_ids)
                  for k, matrix in reversed(_stream(args, i, p.tp, p.ep, experts))]
        stream += blocks if experts else [(k, False) for k, _ in first] + blocks + [(k, False) for k, _ in last]
    limit = p.bucket_mb * 2**20 / BYTES[cfg.train.precision]
    buckets, sizes, linear = [], [], 0
    for k, lin in stream:  # cut by the parameters' sizes; a bucket holds them aligned
        if sizes and sum(sizes) + k > limit:
            buckets.append((flat_layout(sizes, 1)[1], linear))
            sizes, linear = [], 0
        sizes.append(k)
        linear += k if lin else 0
    return buckets + [(flat_layout(sizes, 1)[1], linear)] if sizes else buckets


def dp_messages(cfg: Config, args: ModelArgs, chunks: list[Chunk], experts: bool = False) -> list[int]:
    """The elements of each collective (`dp_flats`)."""
    return [n for n, _ in dp_flats(cfg, args, chunks, experts)]


def dp_group_seconds(cfg: Config, args: ModelArgs, cluster: Cluster, chunks: list[Chunk], experts: bool,
                     c: int, r: int, gather_bytes: float | None) -> tuple[float, float, float, float]:
    """(reduce-scatters, all-gathers, all-reduces over dp × cp, HSDP's all-reduces across replicas)
    of one pass over the rank's dense (or expert) gradients and parameters. `gather_bytes`:
    bytes per linear weight in the all-gathers (fp8), else c."""
    p = cfg.parallel
    flats = dp_flats(cfg, args, chunks, experts)
    if not flats:
        return 0.0, 0.0, 0.0, 0.0
    ep = p.ep if experts else 1
    shard = p.dp_shard * p.cp // ep
    spans_shard = spans_nodes(cfg, ("dp_shard", "cp"), cluster.gpus_per_node)
    spans_dp = spans_nodes(cfg, ("cp", "dp_shard", "dp_replicate"), cluster.gpus_per_node)
    spans_rep = spans_nodes(cfg, ("dp_replicate",), cluster.gpus_per_node)
    g = c if gather_bytes is None else gather_bytes
    rs = sum(group_seconds(cluster, "reduce_scatter", shard, spans_shard, n * r) for n, _ in flats)
    ag = sum(group_seconds(cluster, "all_gather", shard, spans_shard, (n - lin) * c + lin * g) for n, lin in flats)
    reduce = sum(group_seconds(cluster, "all_reduce", shard * p.dp_replicate, spans_dp, n * r) for n, _ in flats)
    replicas = sum(group_seconds(cluster, "all_reduce", p.dp_replicate, spans_rep, n * r / max(shard, 1))
                   for n, _ in flats)
    return rs, ag, reduce, replicas
