"""Step time: compute at an assumed efficiency, communication, and the pipeline bubble.

Per pipeline stage (every rank of a stage does the same work):
- compute: the stage's chunks cost their forward FLOPs (`partition.chunk_costs`, the
  convention of `flops_per_token`: 2 per weight and token, plus the causal attention
  scores) per token; backward costs twice forward; a recomputed block runs its forward
  once more, selective recompute the attention scores. Tensor parallelism divides the work
  by t, context parallelism the tokens by cp. Rate: peak × efficiency.
- tensor (and sequence) parallelism, per block and micro-batch, exposed: 2 all-reduces
  forward and 2 backward of b·s·h values (Narayanan et al. 2021: 8·b·s·h·(t−1)/t on the
  wire), or under SP the same bytes as 4 all-gathers and 4 reduce-scatters (Korthikanti et
  al. 2022); plus the embedding's exit and the head's entry (one all-reduce each,
  4·b·s·h·(t−1)/t); recomputation repeats the forward's.
- context parallelism, per block and micro-batch: the bytes `parallel/context.wire_bytes`
  counts for the back end (ring: K/V around the ring, cp − 1 steps forward, again backward
  with the K/V gradients; allgather: an all-gather and a reduce-scatter of K/V; Ulysses:
  all-to-alls of q, k, v and the output), with a latency per message; ring attention's
  exchanges overlap its own compute on a GPU. Expert parallelism: two all-to-alls of the
  routed tokens per MoE block forward and two backward; the model has no MoE blocks yet,
  so the term is zero.
- pipeline: each micro-batch's activation and gradient cross each stage boundary (one
  send/recv of b·s·h/t values each way, exposed), and the bubble of the schedule
  (`schedules.theory_bubble`: (p−1)/m for AFAB and 1F1B, (p−1)/(v·m) interleaved,
  (p−1)(F+B−W)/(m(F+B+W)) for zero bubble) stretches the busiest stage.
- data parallelism / ZeRO, once per step over dp × cp: DP all-reduces the gradients;
  ZeRO-1 reduce-scatters them and all-gathers the parameters after the step; ZeRO-2
  reduce-scatters after every micro-batch; ZeRO-3 gathers the parameters in each
  micro-batch's forward and again in its backward (once without resharding) and
  reduce-scatters after each; under a pipeline ZeRO-2/3 are deferred (`parallel/zero.py`):
  one reduce-scatter per step, and ZeRO-3 gathers each chunk once for the whole step;
  HSDP all-reduces the shards across replicas. Each is priced
  message by message as the engine sends them (`dp_messages`: DP's buckets, ZeRO's units),
  since a collective's time is not linear in its size (latency; gloo's time per byte grows
  with the message). The reductions
  overlap the last backward (the gathers the compute they prefetch for) on a cluster whose
  collectives run beside the compute (GPUs); on this machine gloo's threads share the
  cores with the compute, so all of it counts.
A group's collectives use the link inside a node when its ranks fit in one (the mesh puts
tp innermost, then cp, dp_shard, dp_replicate, pp), else the link between nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ndtrain.config import Config, recompute_every
from ndtrain.model.args import ModelArgs, block_params, flops_per_token
from ndtrain.parallel.pipeline.partition import Chunk, chunk_costs
from ndtrain.parallel.pipeline.schedules import theory_bubble
from ndtrain.parallel.placement import flat_layout
from ndtrain.plan.cluster import Cluster
from ndtrain.plan.memory import BYTES, block_weights, padded_vocab, stage_chunks

INNER_TO_OUTER = ("tp", "cp", "dp_shard", "dp_replicate", "pp")


@dataclass
class StepTime:
    compute: float = 0.0
    recompute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    pp_messages: float = 0.0
    bubble: float = 0.0
    dp: float = 0.0
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp + self.cp + self.ep + self.pp_messages
                + self.bubble + self.dp)

    def as_dict(self) -> dict:
        return {"compute": self.compute, "recompute": self.recompute, "tp": self.tp, "cp": self.cp,
                "ep": self.ep, "pp_messages": self.pp_messages, "pp_bubble": self.bubble,
                "dp": self.dp, "total": self.total}


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


def collective(cluster: Cluster, cfg: Config, kind: str, dims: tuple[str, ...], nbytes: float) -> float:
    n = 1
    for d in dims:
        n *= sizes(cfg)[d]
    if n <= 1 or nbytes <= 0:
        return 0.0
    return cluster.link(kind, n, spans_nodes(cfg, dims, cluster.gpus_per_node)).seconds(kind, n, nbytes)


def stage_flops(cfg: Config, args: ModelArgs, chunks: list[Chunk]) -> tuple[float, float]:
    """(forward FLOPs of one micro-batch through the stage's chunks on one rank, the
    extra forward FLOPs recomputation adds)."""
    p, t = cfg.parallel, cfg.train
    tokens = t.micro_batch * t.seq_len / (p.tp * p.cp)
    forward = sum(chunk_costs(args, chunks, t.seq_len)) * tokens
    one_block = 2.0 * block_params(args) + 2.0 * t.seq_len * args.dim
    layers = [i for ch in chunks for i in ch.layer_ids]
    if t.recompute == "selective":
        extra = len(layers) * 2.0 * t.seq_len * args.dim  # the attention scores again
    elif t.recompute == "none":
        extra = 0.0
    else:
        every = recompute_every(t.recompute)
        extra = sum(1 for i in layers if i % every == 0) * one_block
    return forward, extra * tokens


def step_time(cfg: Config, args: ModelArgs, cluster: Cluster) -> tuple[StepTime, list[StepTime]]:
    """(the step, the busiest stage's breakdown; every stage's)."""
    p, t = cfg.parallel, cfg.train
    c = BYTES[t.precision]
    r = 4 if (t.reduce_fp32 and c == 2) else c
    rate = cluster.peak_flops(t.precision) * cluster.efficiency
    m = t.accumulation(p.dp)
    act = c * t.micro_batch * t.seq_len / p.cp * args.dim  # one micro-batch's hidden states, bytes
    stages = []
    for chunks in stage_chunks(cfg, args):
        st = StepTime()
        forward, extra = stage_flops(cfg, args, chunks)
        st.compute = 3 * forward * m / rate
        st.recompute = extra * m / rate
        blocks = sum(len(ch.layer_ids) for ch in chunks)
        ends = sum(ch.embed for ch in chunks) + sum(ch.head for ch in chunks)
        if p.tp > 1:
            # one all-reduce, or under SP one all-gather and one reduce-scatter (the same bytes)
            kinds = ("all_gather", "reduce_scatter") if p.sp else ("all_reduce",)
            pair = sum(collective(cluster, cfg, k, ("tp",), act) for k in kinds)
            # a block: two regions, each entered and left forward and backward: 4 pairs; the
            # embedding's exit and the head's entry: one each; a recomputed block's forward: 2
            recomputed_blocks = sum(1 for i in (i for ch in chunks for i in ch.layer_ids)
                                    if t.recompute not in ("none", "selective") and i % recompute_every(t.recompute) == 0)
            st.tp = (4 * blocks + ends + 2 * recomputed_blocks) * pair * m
        if p.cp > 1:
            st.cp = blocks * m * _context_parallel(cfg, args, cluster, c, rate)
        if p.pp > 1:
            hop = collective(cluster, cfg, "send_recv", ("pp",), act / (p.tp if p.sp else 1))
            st.pp_messages = 2 * hop * m * len(chunks)
        stages.append(st)
    for st, chunks in zip(stages, stage_chunks(cfg, args)):
        st.dp = _data_parallel(cfg, args, cluster, chunks, c, r, m, st, rate)
    busiest = max(stages, key=lambda s: s.total)
    step = StepTime(**{k: getattr(busiest, k) for k in ("compute", "recompute", "tp", "cp", "ep", "pp_messages", "dp")})
    if p.pp > 1:
        work = busiest.compute + busiest.recompute + busiest.tp + busiest.cp + busiest.pp_messages
        f = work / (3 * m * p.pp_virtual)  # one micro-batch's forward on one chunk (backward = 2 f)
        fwd, bwd, wgt = (f, f, f) if p.pp_schedule == "zb" else (f, 2 * f, 0.0)
        bubble = theory_bubble(p.pp_schedule, p.pp, p.pp_virtual, m, fwd, bwd, wgt)
        step.bubble = bubble * work
        step.detail["bubble_fraction"] = bubble
    return step, stages


def _context_parallel(cfg: Config, args: ModelArgs, cluster: Cluster, c: int, rate: float) -> float:
    """Seconds one block's context-parallel attention waits for messages, per micro-batch,
    forward and backward: the bytes `parallel/context.wire_bytes` counts for the back end,
    on the cp group's link, with a latency per message. Ring attention posts each step's
    exchange before computing the step: on a GPU only what the attention's own compute does
    not cover is exposed."""
    from ndtrain.parallel.context import wire_bytes
    from ndtrain.plan.activations import kv_width, wide

    p, t = cfg.parallel, cfg.train
    tokens = t.micro_batch * t.seq_len
    heads, kv_heads = args.n_heads // p.tp, kv_width(args, p.tp) // args.head_dim
    nbytes = wire_bytes(p.cp_impl, tokens, heads, kv_heads, args.head_dim, p.cp, c, wide(c))
    kind, messages = {"ring": ("send_recv", 3 * (p.cp - 1)), "allgather": ("all_gather", 2),
                      "ulysses": ("all_to_all", 8)}[p.cp_impl]
    link = cluster.link(kind, p.cp, spans_nodes(cfg, ("cp",), cluster.gpus_per_node))
    seconds = messages * link.latency_s + nbytes / link.busbw
    if p.cp_impl == "ring" and not cluster.shared_node:
        attention = 3 * 2.0 * t.seq_len * args.dim * tokens / (p.tp * p.cp) / rate  # its scores, forward and backward
        seconds = max(seconds - attention, 0.0)
    return seconds


def _root_weights(args: ModelArgs, ch: Chunk, tp: int) -> tuple[list, list]:
    """A chunk's root parameters (`memory.root_local`) as (elements, is a matrix): those whose
    gradients come first in backward (an untied or copied head, the final norm), and the
    embedding, whose gradient comes last."""
    table = padded_vocab(args, tp) // tp * args.dim
    first = []
    if ch.head:
        first = ([] if args.tie_embeddings and ch.embed else [(table, True)]) + [(args.dim, False)]
    return first, [(table, True)] if ch.embed else []


def dp_messages(cfg: Config, args: ModelArgs, chunks: list[Chunk]) -> list[int]:
    """The elements of each collective one data-parallel reduction of a rank's gradients
    issues. ZeRO (parallel/zero.py) reduces (and ZeRO-1/3 gathers) unit by unit (each block,
    then each chunk's root), one flat buffer per weight-decay group (matrices, vectors),
    each parameter and slice aligned (parallel/placement.flat_layout). Plain DP (parallel/data.py) packs the gradients, in the order
    backward produces them, into buckets of `parallel.bucket_mb` (in the parameters' dtype),
    a parameter larger than a bucket alone. Gloo's time per byte grows with the message
    (`bench comm`), and every message pays a latency, so the cut matters."""
    p = cfg.parallel
    block = list(reversed(block_weights(args, p.tp)))
    if p.zero:
        n = p.dp_shard * p.cp
        units = []
        for ch in chunks:
            first, last = _root_weights(args, ch, p.tp)
            # in registration order (the embedding first), as the flat buffers hold them
            units += [block_weights(args, p.tp)] * len(ch.layer_ids) + [last + first]
        return [n * flat_layout([k for k, matrix in u if matrix == group], n)[2] for u in units
                for group in (True, False) if any(matrix == group for _, matrix in u)]
    stream = []
    for ch in chunks:
        first, last = _root_weights(args, ch, p.tp)
        stream += first + block * len(ch.layer_ids) + last
    limit = p.bucket_mb * 2**20 / BYTES[cfg.train.precision]
    buckets, current = [], []
    for k, _ in stream:  # cut by the parameters' sizes; a bucket holds them aligned
        if current and sum(current) + k > limit:
            buckets.append(current)
            current = []
        current.append(k)
    return [flat_layout(b, 1)[1] for b in buckets + ([current] if current else [])]


def _data_parallel(cfg: Config, args: ModelArgs, cluster: Cluster, chunks: list[Chunk], c: int, r: int, m: int,
                   st: StepTime, rate: float) -> float:
    """Seconds of data-parallel / ZeRO communication a rank waits for in one step, message
    by message (`dp_messages`)."""
    p = cfg.parallel
    messages = dp_messages(cfg, args, chunks)
    shard_dims = ("dp_shard", "cp") if p.cp > 1 else ("dp_shard",)
    dp_dims = tuple(d for d in ("cp", "dp_shard", "dp_replicate") if sizes(cfg)[d] > 1) or ("dp_shard",)
    shard_dims = tuple(d for d in shard_dims if sizes(cfg)[d] > 1) or ("dp_shard",)

    def each(kind: str, dims: tuple[str, ...], nbytes: int, parts: int = 1) -> float:
        return sum(collective(cluster, cfg, kind, dims, nbytes * k / parts) for k in messages)

    rs, ag = each("reduce_scatter", shard_dims, r), each("all_gather", shard_dims, c)
    replicas = each("all_reduce", ("dp_replicate",), r, max(p.dp_shard * p.cp, 1))
    backward_last = 2 * st.compute / (3 * m)  # the last micro-batch's backward, which the reductions overlap
    overlap = not cluster.shared_node
    if p.zero == 0:
        reduce = each("all_reduce", dp_dims, r)
        return max(reduce - backward_last, 0.0) if overlap else reduce
    if p.zero == 1:
        reduce = rs + replicas
        return (max(reduce - backward_last, 0.0) if overlap else reduce) + ag
    if p.pp > 1:  # ZeRO-2/3 deferred under a pipeline (parallel/zero.py `defer`): once per step
        m = 1
    if p.zero == 2:
        reduce = m * rs + replicas
        return (max(reduce - m * backward_last, 0.0) if overlap else reduce) + ag
    gathers = m * (2 if p.reshard_after_forward else 1) * ag
    reduce = m * rs + replicas
    hidden = st.compute + st.recompute
    return max(gathers + reduce - hidden, 0.0) if overlap else gathers + reduce


def model_flops_per_step(cfg: Config, args: ModelArgs) -> float:
    """The FLOPs MFU counts (no recomputation): flops_per_token × tokens of the global batch."""
    t = cfg.train
    return flops_per_token(args, t.seq_len) * t.global_batch * t.seq_len

