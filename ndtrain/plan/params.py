"""The parameters a rank holds, and their model states.

Model states (parameters, gradients, optimizer state) follow Rajbhandari et al. 2020
through `parallel/zero.model_state_bytes`, applied to the parameters a rank holds: its
tensor-parallel shards (vocabulary padded to a multiple of t, K/V weights replicated when t
exceeds the KV heads) of its pipeline chunks (the cost-balanced split of
`parallel/pipeline/partition.py`; a tied embedding has a copy on the last stage); a mixture
of experts' routed experts split over ep and sharded over dp_shard·cp/ep (plan/experts.py).
"""

from __future__ import annotations

import functools

from ndtrain.config import Config
from ndtrain.model.args import ModelArgs
from ndtrain.parallel.pipeline.partition import Chunk, chunk_counts, local_chunks, make_chunks
from ndtrain.parallel.pipeline.schedules import vshape
from ndtrain.parallel.zero import model_state_bytes
from ndtrain.plan.experts import expert_weights, moe_dense_weights

# fp8: parameters and activations in bf16 (train.fp8_base) until the planner models fp8 (issue 25)
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "fp8": 2, "nvfp4": 2}


def padded_vocab(args: ModelArgs, tp: int) -> int:
    return -(-args.vocab_size // tp) * tp


def block_weight_groups(args: ModelArgs, tp: int, layer: int = 0) -> tuple[list, list]:
    """One block's dense parameters on one tensor-parallel rank, in registration order, as
    (elements, is a matrix): (those split by t: heads and features, a q/k/v bias with its
    rows, K/V weights whole when t exceeds the KV heads, the norms (and Qwen3's q/k norms)
    whole, gpt-oss's sinks split with the heads and its o_proj bias whole; an MoE block's
    router (and its bias) and shared experts, whole on every tp rank). Its routed
    experts are apart (plan/experts.expert_weights). Matrices and vectors are ZeRO's two flat
    buffers per unit (weight decay or not)."""
    h, q, kv, f = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    kv_local = kv // tp if args.n_kv_heads % tp == 0 else kv  # replicated K/V weights
    bias = args.qkv_bias
    sinks = [(args.n_heads // tp, False)] if args.attn_sinks else []  # gpt-oss: split with the heads
    weights = [(h, False), *sinks, (h * q // tp, True), *([(q // tp, False)] if bias else []),
               (h * kv_local, True), *([(kv_local, False)] if bias else []),
               (h * kv_local, True), *([(kv_local, False)] if bias else []), (q // tp * h, True),
               *([(h, False)] if args.o_bias else [])]  # gpt-oss's o_proj bias: whole
    if args.is_mla:
        weights = [(h, False), *mla_weights(args, tp)]
    if args.qk_norm:
        weights += [(q // tp, False), (kv_local, False)] if args.qk_norm_all else [(args.head_dim, False)] * 2
    weights.append((h, False))
    if not args.pre_norm:  # OLMo 2: no norms before the sublayers
        weights = weights[1:-1]
    post = [(h, False)] * 2 if args.sandwich_norm else []  # Gemma 2, OLMo 2: after attention and the MLP
    if args.is_moe_layer(layer):
        return weights + post, moe_dense_weights(args)
    return weights + [(h * f // tp, True), (h * f // tp, True), (f // tp * h, True)] + post, []


def mla_weights(args: ModelArgs, tp: int) -> list[tuple[int, bool]]:
    """Latent attention's parameters on one tp rank, in registration order (model/mla.py):
    the down-projections and their norms whole, the up-projections and wo split by heads."""
    h, heads, qk = args.dim, args.n_heads // tp, args.head_dim
    r, kvr, rope = args.q_lora_rank, args.kv_lora_rank, args.qk_rope_head_dim
    query = [(h * r, True), (r, False), (r * heads * qk, True)] if r else [(h * heads * qk, True)]
    return query + [(h * (kvr + rope), True), (kvr, False),
                    (kvr * heads * (args.qk_nope_head_dim + args.v_head_dim), True), (heads * args.v_head_dim * h, True)]


def block_weights(args: ModelArgs, tp: int, layer: int = 0) -> list[tuple[int, bool]]:
    """One block's dense parameters on one tensor-parallel rank (`block_weight_groups`)."""
    split, whole = block_weight_groups(args, tp, layer)
    return split + whole


def block_local(args: ModelArgs, tp: int, layer: int = 0) -> int:
    """Dense parameters of one block on one tensor-parallel rank (`block_weights`)."""
    return sum(n for n, _ in block_weights(args, tp, layer))


def block_experts(args: ModelArgs, layer: int, ep: int) -> int:
    """Routed-expert parameters of one block on one rank."""
    return sum(n for n, _ in expert_weights(args, ep)) if args.is_moe_layer(layer) else 0


def root_local(args: ModelArgs, chunk: Chunk, tp: int) -> int:
    """Embedding, final norm and head held by a chunk, on one tensor-parallel rank."""
    table = padded_vocab(args, tp) // tp * args.dim
    n = table if chunk.embed else 0
    if chunk.head:
        n += args.dim
        if not (args.tie_embeddings and chunk.embed):
            n += table  # untied head, or a tied head's copy on the last stage
        if args.mtp_depth and not chunk.embed and not args.tie_embeddings:
            n += table  # multi-token prediction's copy of the embedding (model/mtp.py; tied: the head)
    return n


def stage_chunks(cfg: Config, args: ModelArgs) -> list[list[Chunk]]:
    """Each pipeline rank's chunks, cut as the engine cuts them (partition.py)."""
    p = cfg.parallel
    return _stage_chunks(args, p.pp, p.pp_virtual, cfg.train.seq_len, p.pp_split, vshape(p.pp_schedule))


@functools.lru_cache(maxsize=4096)
def _stage_chunks(args: ModelArgs, pp: int, v: int, seq_len: int, split: str, v_shape: bool) -> list[list[Chunk]]:
    chunks = make_chunks(chunk_counts(args, pp * v, seq_len, split))
    return [[chunks[c] for c in local_chunks(r, pp, v, v_shape)] for r in range(pp)]


def stage_split(cfg: Config, args: ModelArgs, chunks: list[Chunk]) -> tuple[int, int]:
    """(dense, routed-expert) parameters of a pipeline rank's chunks on one rank."""
    tp, ep = cfg.parallel.tp, cfg.parallel.ep
    dense = sum(block_local(args, tp, i) for ch in chunks for i in ch.layer_ids)
    experts = sum(block_experts(args, i, ep) for ch in chunks for i in ch.layer_ids)
    mtp = args.mtp_depth if any(ch.head for ch in chunks) else 0  # with the head (model/mtp.py)
    last = args.n_layers - 1  # each module: two norms, the projection, a block of the last one's kind, a norm
    dense += mtp * (3 * args.dim + 2 * args.dim * args.dim + block_local(args, tp, last))
    experts += mtp * block_experts(args, last, ep)
    return dense + sum(root_local(args, ch, tp) for ch in chunks), experts


def stage_params(cfg: Config, args: ModelArgs, chunks: list[Chunk]) -> int:
    return sum(stage_split(cfg, args, chunks))


def stage_states(cfg: Config, args: ModelArgs, chunks: list[Chunk]) -> dict[str, float]:
    """A rank's model states (parallel/zero.model_state_bytes): dense ones sharded by ZeRO over
    dp_shard × cp, routed experts over the ranks holding the same experts, dp_shard·cp/ep."""
    p = cfg.parallel
    dense, experts = stage_split(cfg, args, chunks)
    c = BYTES[cfg.train.precision]
    muon = stage_muon(cfg, args, chunks) if cfg.train.optimizer == "muon" else 0  # one moment, not two
    a = model_state_bytes(dense - muon, p.zero, p.dp_shard * p.cp, c)
    m = model_state_bytes(muon, p.zero, p.dp_shard * p.cp, c, moments=1)
    b = model_state_bytes(experts, p.zero, max(p.dp_shard * p.cp // p.ep, 1), c,
                          moments=1 if cfg.train.optimizer == "muon" else 2)
    return {k: a[k] + m[k] + b[k] for k in a}


def stage_muon(cfg: Config, args: ModelArgs, chunks: list[Chunk]) -> int:
    """The dense parameters Muon updates on one rank of a pipeline rank's chunks: the blocks'
    matrices (attention, MLP, shared experts), not the router (the first of an MoE block's whole weights)."""
    tp, n = cfg.parallel.tp, 0
    for i in (i for ch in chunks for i in ch.layer_ids):
        split, whole = block_weight_groups(args, tp, i)
        n += sum(k for k, matrix in split if matrix) + sum(k for k, _ in whole[1:])
    return n
