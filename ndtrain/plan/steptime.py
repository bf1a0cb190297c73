"""Step time: each pipeline chunk's passes per micro-batch, the schedule simulated, then what
happens once per step.

Per micro-batch and chunk (every rank of a stage does the same work), three passes:
F (forward), B (backward; under zero bubble the input gradients only) and W (zero bubble's
weight gradients), each its compute (plan/work.py: the matmuls and the rest, priced by the
cluster's compute model, plan/compute.py) plus the communication that waits inside it:
- recomputation reruns forwards inside B (`train.recompute`; selective: the attention core);
- tensor (and sequence) parallelism, per block: 2 all-reduces in F and 2 in B of b·s·h
  values (Narayanan et al. 2021: 8·b·s·h·(t−1)/t on the wire per layer), under SP the same
  bytes as all-gathers and reduce-scatters (Korthikanti et al. 2022); the embedding's exit
  (F) and the head's entry (B); a recomputed block's forward again (B);
- context parallelism, per block: the bytes `parallel/context.wire_bytes` counts for the
  back end (ring: K/V around the ring; allgather: an all-gather and a reduce-scatter of K/V;
  Ulysses: all-to-alls of q, k, v and the output), a third in F and two thirds in B, with a
  latency per message; on a GPU ring attention hides its exchanges behind its own compute;
- expert parallelism, per MoE block: the count exchange and the two row all-to-alls
  (dispatch, combine) in F, the two row all-to-alls again in B (plan/experts.py), the rows
  scaled by the load imbalance;
- pipeline parallelism: after F the activation goes to the next stage, after B the gradient
  to the previous one (one send/recv of b·s·h/t values each, exposed).
The schedule then orders the passes (plan/pipeline.py simulates the engine's own action
lists for every schedule; with one stage the micro-batches run back to back): the step's
length, and the bubble as what it adds to the busiest stage.

Once per step, after the last backward:
- data parallelism / ZeRO over dp × cp (experts over the ranks holding the same experts):
  DP all-reduces the gradients; ZeRO-1 reduce-scatters them and all-gathers the parameters
  after the optimizer; ZeRO-2 reduce-scatters after every micro-batch; ZeRO-3 gathers each
  unit before its forward and again before its backward (once without resharding) and
  reduce-scatters after each backward; under a pipeline ZeRO-2/3 defer (`parallel/zero.py`):
  a chunk's units are gathered once at the step's first forward and kept until it ends, and
  reduce-scattered once after the last backward; HSDP all-reduces the shards across
  replicas; with fp8 all-gathers (`train.fp8_all_gather`) the block's linear weights travel
  in one byte each. Priced message by message as the engine sends them (`dp_messages`: DP's
  buckets, ZeRO's units), since a collective's time is not linear in its size. On a cluster
  whose collectives run beside the compute (GPUs) the reductions overlap the last backward
  and the gathers the compute; on this machine gloo shares the cores, so all of it counts;
- MoE weights' gradients, partial over tp (every tp rank routes its own positions), are
  all-reduced over tp (counted with the data-parallel reductions);
- the optimizer step (zeroing, clip, AdamW on the rank's shard), priced on this machine once
  `bench plan` measured it; left out on GPUs (memory-bound, about 1% of a step).
A group's collectives use the link inside a node when its ranks fit in one (the mesh puts
tp innermost, then cp, dp_shard, dp_replicate, pp; an expert group is ep consecutive ranks
of dp_shard × cp), else the link between nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ndtrain.config import Config
from ndtrain.model.args import ModelArgs
from ndtrain.parallel.pipeline.partition import Chunk
from ndtrain.plan.activations import recomputed
from ndtrain.plan.cluster import Cluster
from ndtrain.plan.collectives import collective, dp_group_seconds, group_seconds, spans_nodes
from ndtrain.plan.experts import a2a_bytes, counts_bytes
from ndtrain.plan.fp8 import Fp8
from ndtrain.plan.params import BYTES, stage_chunks, stage_split
from ndtrain.plan.pipeline import bubble_fraction

SPLIT = ("zb", "zbv", "dualpipev")  # schedules that split backwards into B and W
from ndtrain.plan.work import Shape, Work, chunk_passes

PARTS = ("compute", "recompute", "tp", "cp", "ep", "pp_messages")


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
    optimizer: float = 0.0
    detail: dict = field(default_factory=dict)

    @property
    def busy(self) -> float:
        return sum(getattr(self, k) for k in PARTS)

    @property
    def total(self) -> float:
        return self.busy + self.bubble + self.dp + self.optimizer

    def as_dict(self) -> dict:
        return {"compute": self.compute, "recompute": self.recompute, "tp": self.tp, "cp": self.cp,
                "ep": self.ep, "pp_messages": self.pp_messages, "pp_bubble": self.bubble,
                "dp": self.dp, "optimizer": self.optimizer, "total": self.total}


@dataclass
class ChunkTime:
    """One micro-batch through one chunk: seconds of each pass and of each part."""

    forward: float = 0.0
    backward: float = 0.0  # under zero bubble the input gradients only
    weights: float = 0.0  # zero bubble's W
    parts: dict = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def add(self, part: str, seconds: float, into: str) -> None:
        self.parts[part] += seconds
        setattr(self, into, getattr(self, into) + seconds)


def micro_shape(cfg: Config, args: ModelArgs, fp8: Fp8 | None, imbalance: float) -> Shape:
    p, t = cfg.parallel, cfg.train
    return Shape(args, t.micro_batch * t.seq_len // p.cp, t.micro_batch, t.seq_len, p.tp, p.cp, p.ep,
                 BYTES[t.precision], fp8 is not None, imbalance, p.cp_impl,
                 fp8.peak_key if fp8 is not None else "fp8", fp8.tail(args) if fp8 is not None else frozenset())


def chunk_time(cfg: Config, args: ModelArgs, cluster: Cluster, ch: Chunk, n_chunks: int, shape: Shape,
               rate: float) -> ChunkTime:
    p, t = cfg.parallel, cfg.train
    model = cluster.compute_model(t.precision, shape.low)
    split = p.pp_schedule in SPLIT and p.pp > 1
    passes = chunk_passes(shape, ch.layer_ids, ch.embed, ch.head, t.recompute, split)
    psi = stage_split(cfg, args, [ch])
    g = 4 if shape.c < 4 else shape.c  # the gradient accumulator's bytes (fp32 under bf16/fp16)
    accumulate = Work([], 3.0 * g * sum(psi), 0.0)  # each micro-batch's gradients added into the buffers
    ct = ChunkTime()
    ct.add("compute", model.seconds(passes.forward), "forward")
    ct.add("compute", model.seconds(passes.inputs, backward=True), "backward")
    ct.add("compute", model.seconds(passes.weights + accumulate, backward=True), "weights" if split else "backward")
    ct.add("recompute", model.seconds(passes.recompute), "backward")
    c = shape.c
    act = c * shape.tokens * args.dim  # one micro-batch's hidden states on this rank, bytes
    blocks = len(ch.layer_ids)
    if p.tp > 1:
        kinds = ("all_gather", "reduce_scatter") if p.sp else ("all_reduce",)
        pair = sum(collective(cluster, cfg, k, ("tp",), act) for k in kinds)
        rerun = sum(1 for i in ch.layer_ids if recomputed(t.recompute, i) == "full")
        ct.add("tp", (2 * blocks + ch.embed) * pair, "forward")
        ct.add("tp", (2 * blocks + ch.head + 2 * rerun) * pair, "backward")
    if p.cp > 1:
        each = blocks * _context_parallel(cfg, args, cluster, c, rate)
        ct.add("cp", each / 3, "forward")
        ct.add("cp", 2 * each / 3, "backward")
    moe = sum(1 for i in ch.layer_ids if args.is_moe_layer(i))
    if p.ep > 1 and moe:
        rows = a2a_bytes(args, shape.tokens, p.tp, c, shape.imbalance)
        a2a = group_seconds(cluster, "all_to_all", p.ep, _ep_spans(cfg, cluster), rows)
        counts = group_seconds(cluster, "all_to_all", p.ep, _ep_spans(cfg, cluster), counts_bytes(args))
        ct.add("ep", moe * (2 * a2a + counts), "forward")
        ct.add("ep", moe * 2 * a2a, "backward")
    if p.pp > 1:
        hop = collective(cluster, cfg, "send_recv", ("pp",), act / (p.tp if p.sp else 1))
        ct.add("pp_messages", hop * (ch.index < n_chunks - 1), "forward")
        ct.add("pp_messages", hop * (ch.index > 0), "backward")
    return ct


def _ep_spans(cfg: Config, cluster: Cluster) -> bool:
    """An expert group is ep consecutive ranks of dp_shard × cp, each tp ranks apart."""
    return cfg.parallel.tp * cfg.parallel.ep > cluster.gpus_per_node


def step_time(cfg: Config, args: ModelArgs, cluster: Cluster, fp8: Fp8 | None = None,
              imbalance: float = 1.0) -> tuple[StepTime, list[StepTime]]:
    """(the step, the busiest stage's breakdown; every stage's)."""
    p, t = cfg.parallel, cfg.train
    m = t.accumulation(p.dp)
    rate = cluster.peak_flops(t.precision) * cluster.efficiency
    shape = micro_shape(cfg, args, fp8, imbalance)
    per_stage = stage_chunks(cfg, args)
    n_chunks = p.pp * p.pp_virtual
    times = {ch.index: chunk_time(cfg, args, cluster, ch, n_chunks, shape, rate)
             for chunks in per_stage for ch in chunks}
    stages = []
    for chunks in per_stage:
        st = StepTime()
        for part in PARTS:
            setattr(st, part, m * sum(times[ch.index].parts[part] for ch in chunks))
        st.dp = data_parallel(cfg, args, cluster, chunks, m, st, fp8) + moe_tp_reduction(cfg, args, cluster, chunks)
        st.optimizer = cluster.compute_model(t.precision).optimizer_seconds(optimizer_params(cfg, args, chunks))
        if t.optimizer == "muon":
            st.optimizer += muon_seconds(cfg, args, cluster, chunks, rate)
        stages.append(st)
    if p.pp > 1:
        # the first chunk's B (nothing) and W (whole) follow from lists.deferred in the simulation
        costs = tuple((times[c].forward, times[c].backward, times[c].weights) for c in range(n_chunks))
        span, fraction = bubble_fraction(p.pp_schedule, p.pp, p.pp_virtual, m, costs)
    else:
        span, fraction = stages[0].busy, 0.0
    busiest = max(stages, key=lambda s: s.busy)
    after = max(stages, key=lambda s: s.dp + s.optimizer)
    step = StepTime(**{k: getattr(busiest, k) for k in PARTS})
    step.bubble = max(span - busiest.busy, 0.0) if p.pp > 1 else 0.0
    step.dp, step.optimizer = after.dp, after.optimizer
    step.detail["bubble_fraction"] = fraction
    return step, stages


def muon_seconds(cfg: Config, args: ModelArgs, cluster: Cluster, chunks: list[Chunk], rate: float) -> float:
    """Muon's extra time on a rank (parallel/muon.muon_costs): its share of the stage's Newton–Schulz FLOPs
    at the rate of the iteration's precision (bf16 by default: parallel/precision.muon_ns_precision; `rate`
    is the compute precision's), and the owners' two all-to-alls over the stage's ranks."""
    from ndtrain.parallel.muon import muon_costs
    from ndtrain.parallel.precision import muon_ns_precision
    from ndtrain.plan.params import stage_muon
    p, t = cfg.parallel, cfg.train
    n = p.dp * p.cp * p.tp
    dense, experts = stage_muon(cfg, args, chunks), stage_split(cfg, args, chunks)[1]
    held = dense / (p.dp_shard * p.cp if p.zero else 1) + experts / (max(p.dp_shard * p.cp // p.ep, 1) if p.zero else 1)
    costs = muon_costs(args, n * p.pp, p.pp, held, t.muon_ns_steps, 4)
    link = cluster.link("all_to_all", n, n > cluster.gpus_per_node)
    ns = muon_ns_precision(t.muon_ns_dtype, t.precision, t.fp8_base)
    ns_rate = rate if ns == t.precision else cluster.peak_flops(ns) * cluster.efficiency
    return costs["ns_flops"] / ns_rate + 2 * link.seconds("all_to_all", n, costs["bytes"] / 2)


def optimizer_params(cfg: Config, args: ModelArgs, chunks: list[Chunk]) -> float:
    """Parameters the optimizer updates on a rank: its share under ZeRO (dense over dp_shard × cp,
    experts over dp_shard·cp/ep)."""
    p = cfg.parallel
    dense, experts = stage_split(cfg, args, chunks)
    if not p.zero:
        return dense + experts
    shard = p.dp_shard * p.cp
    return dense / shard + experts / max(shard // p.ep, 1)


def moe_tp_reduction(cfg: Config, args: ModelArgs, cluster: Cluster, chunks: list[Chunk]) -> float:
    """The all-reduce over tp of the MoE weights' gradients (router, the rank's experts and the
    shared ones: every tp rank holds them whole and routes its own positions)."""
    from ndtrain.plan.experts import expert_weights, moe_dense_weights

    p = cfg.parallel
    if p.tp == 1 or not args.is_moe:
        return 0.0
    moe = sum(1 for ch in chunks for i in ch.layer_ids if args.is_moe_layer(i))
    per_block = sum(n for n, _ in moe_dense_weights(args) + expert_weights(args, p.ep))
    r = 4 if (cfg.train.reduce_fp32 and BYTES[cfg.train.precision] == 2) else BYTES[cfg.train.precision]
    return collective(cluster, cfg, "all_reduce", ("tp",), moe * per_block * r)


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


def data_parallel(cfg: Config, args: ModelArgs, cluster: Cluster, chunks: list[Chunk], m: int, st: StepTime,
                  fp8: Fp8 | None) -> float:
    """Seconds of data-parallel / ZeRO communication a rank waits for in one step, message
    by message (plan/collectives.dp_messages), dense and expert parameters each over their
    own group."""
    p = cfg.parallel
    c = BYTES[cfg.train.precision]
    r = 4 if (cfg.train.reduce_fp32 and c == 2) else c
    gather_bytes = fp8.gathered_bytes if fp8 is not None and fp8.all_gather else None
    rs, ag, reduce, replicas = (sum(x) for x in zip(*(
        dp_group_seconds(cfg, args, cluster, chunks, experts, c, r, gather_bytes) for experts in (False, True))))
    backward_last = 2 * st.compute / (3 * m)  # the last micro-batch's backward, which the reductions overlap
    overlap = not cluster.shared_node
    if fp8 is not None and fp8.all_gather and p.zero == 3:  # one amax all-reduce for every weight, per step
        ag += collective(cluster, cfg, "all_reduce", ("dp_shard",), 4.0 * fp8.scales(args, chunks))
    if p.zero == 0:
        return max(reduce - backward_last, 0.0) if overlap else reduce
    if p.zero == 1:
        reduce = rs + replicas
        return (max(reduce - backward_last, 0.0) if overlap else reduce) + ag
    if p.pp > 1:  # ZeRO-2/3 deferred under a pipeline (parallel/zero.py `defer`): once per step
        m = 1
    if p.zero == 2:
        reduce = m * rs + replicas
        return (max(reduce - m * backward_last, 0.0) if overlap else reduce) + ag
    # ZeRO-3: gathered for each forward and again for each backward; once without resharding,
    # and once per step under a pipeline (deferred: kept gathered from the first forward)
    gathers = m * (2 if p.reshard_after_forward and p.pp == 1 else 1) * ag
    reduce = m * rs + replicas
    hidden = st.compute + st.recompute
    return max(gathers + reduce - hidden, 0.0) if overlap else gathers + reduce
