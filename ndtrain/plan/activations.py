"""Activation bytes: what a decoder block keeps for its backward pass, tensor by tensor.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4 and Table 2) count the tensors a GPT layer saves, per token, in bytes with 16-bit
activations: 34·h + 5·a·s, of which 10·h live in the residual stream (layer norms, dropout
masks, the inputs of the two blocks), 24·h are split by tensor parallelism (Q, K, V, the
projections' inputs, the MLP's 4h-wide tensors) and 5·a·s is the attention core (softmax,
its dropout mask and output). With tensor parallelism t: 10 + 24/t; with sequence
parallelism the 10 are split too (34/t); selective recomputation drops the core's 5·a·s/t;
full recomputation keeps the layer input, 2·h.

The same bookkeeping, done for ndtrain's own block (`model/llama.py`, read off the tensors
autograd keeps on the CPU and checked against `train --dry-run` by tests/test_plan_memory.py):
- RMSNorm computes in fp32 (fp64 in fp64): it keeps the block input and the attention
  residual in fp32 (4·h each; in fp32 they are the tensors themselves), its 1/rms (4 bytes) and the
  normalised input in the compute dtype (c·h), twice per block;
- the inputs of the column-parallel matmuls (c·h each, attention and MLP): with sequence
  parallelism the *gathered* input is kept, so these two are never split by t;
- split by heads or features: the rotated q (c·h/t) and k (c·kv), v (c·kv), the attention
  output (c·h/t), the softmax statistics of the fused kernel (4 bytes per head and token,
  no s×s matrix), and SwiGLU's gate, silu(gate), up and their product (4·c·f/t);
- selective recomputation reruns the attention core (rotary, attention): the rotated q and
  k become the unrotated ones (same size) and only the softmax statistics (4 bytes per
  head and token) are saved: with a fused kernel there is no s×s matrix to save;
- full recomputation keeps the block input (c·h).
No dropout by default, so no masks. kv is the K/V width a rank holds: n_kv_heads·head_dim/t,
or one head when t exceeds the KV heads (replicated heads, parallel/tensor.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.model.args import ModelArgs

RESIDUAL, REGION, SPLIT = "residual", "region input", "split"


@dataclass(frozen=True)
class Saved:
    """One tensor a block keeps, in bytes per token of the micro-batch's full sequence on
    one rank *before* sequence parallelism: `where` says how SP divides it (residual: by t;
    region input: by t only where the implementation stores the split copy; split: already
    divided by t). `core`: inside the attention core, which selective recompute reruns."""

    name: str
    bytes_per_token: float
    where: str
    core: bool = False


def kv_width(args: ModelArgs, tp: int) -> int:
    """K (or V) features one tensor-parallel rank computes."""
    heads = args.n_kv_heads // tp if args.n_kv_heads % tp == 0 else 1
    return heads * args.head_dim


def wide(c: int) -> int:
    """Bytes of the values the model widens to fp32 (fp64 stays fp64): `llama.widened`."""
    return max(c, 4)


def moe_mlp(args: ModelArgs, c: int, tp: int, sp: bool, ep: int) -> list[Saved]:
    """What an MoE feed-forward (model/moe.py) keeps, per token of the micro-batch on the rank
    (a tp rank routes 1/t of them: SPLIT). Per routed token: the router's input when it is a
    copy (widened from a low precision, or the positions a tp rank takes without SP), its
    probabilities (fp32), top-k's sort indices over all E experts (int64, kept by the gather
    of the k weights), the slots' order (int64) and combine weights (fp32). Per slot (k per
    token): the experts' input rows, SwiGLU's four tensors of the expert width (seven for
    the clamped SwiGLU), the experts'
    output and its copy in token order (kept by index_copy), and that one widened for the
    weighted sum; under expert parallelism also the two all-to-alls' send and receive buffers
    (the in-flight exchanges stay referenced by autograd until backward): four more rows.
    The shared experts keep what a dense SwiGLU keeps."""
    h, fe, k, E, w = args.dim, args.expert_dim, args.moe_top_k, args.moe_experts, wide(c)
    router_input = w * h if (c < w or (tp > 1 and not sp)) else 0.0
    per_token = router_input + w * E + 8 * E + 8 * k + w * k
    rows = 2 + (4 if ep > 1 else 0)
    # SwiGLU keeps gate, silu(gate), up and their product; gpt-oss's clamped one seven: gate and
    # up (the clamps' inputs), the clamped gate, up + 1, σ(1.702·gate) and two products
    swiglu = 7 if args.moe_swiglu_limit else 4
    per_slot = rows * c * h + swiglu * c * fe + w * h
    terms = [Saved("router, top-k, order, weights", per_token / tp, SPLIT),
             Saved("routed slots (expert inputs, SwiGLU, outputs)", k * per_slot / tp, SPLIT)]
    if args.moe_shared_experts:
        terms.append(Saved("shared experts' SwiGLU", 4 * c * args.moe_shared_experts * fe / tp, SPLIT))
    return terms


def llama_block(args: ModelArgs, c: int, tp: int, cp: int = 1, cp_impl: str = "ring", moe: bool = False,
                sp: bool = False, ep: int = 1) -> list[Saved]:
    h, f, kv, w = args.dim, args.ffn_dim / tp, kv_width(args, tp), wide(c)
    q = args.n_heads * args.head_dim / tp
    mlp = moe_mlp(args, c, tp, sp, ep) if moe else [Saved("SwiGLU gate, silu, up, product", 4 * c * f, SPLIT)]
    terms = [
        Saved("block input (fp32)", w * h, RESIDUAL),
        Saved("attention residual (fp32)", w * h, RESIDUAL),
        Saved("norm 1/rms", 2 * w, RESIDUAL),
        Saved("normalised inputs", 2 * c * h, RESIDUAL),
        Saved("attention and MLP inputs", 2 * c * h, REGION),
        *(mla_saved(args, c, tp) if args.is_mla else
          [*core_saved(args, c, tp, cp, cp_impl), Saved("attention output", c * q, SPLIT)]),
        *mlp,
    ]
    if args.qk_norm:  # Qwen3: each q and k head's RMSNorm keeps its input (fp32), 1/rms and normalised
        heads = q / args.head_dim + kv / args.head_dim
        terms.append(Saved("q, k norms", (w + c) * (q + kv) + w * heads, SPLIT))
    return terms


def mla_saved(args: ModelArgs, c: int, tp: int) -> list[Saved]:
    """Latent attention (model/mla.py) in place of the core and the attention output: the
    query latent and the K/V latent (whole on every tp rank; each norm keeps its input
    widened, 1/rms, the normalised latent and its output, the up-projection's input), the
    assembled q and k and the values padded to their width (every head), the fused kernel's
    output at that width and its softmax statistics, and the output cut to the value width
    (wo's input). The rotations keep nothing but the shared tables."""
    w, heads, qk = wide(c), args.n_heads / tp, args.head_dim
    ranks = [args.q_lora_rank, args.kv_lora_rank] if args.q_lora_rank else [args.kv_lora_rank]
    latents = sum((w + 2 * c) * r + w for r in ranks)
    return [Saved("latents (query, K/V) and their norms", latents, REGION),
            Saved("q, k, v padded (all heads)", 3 * c * heads * qk, SPLIT, core=True),
            Saved("kernel output (padded)", c * heads * qk, SPLIT, core=True),
            Saved("softmax statistics", w * heads, SPLIT, core=True),
            Saved("attention output", c * heads * args.v_head_dim, SPLIT)]


def mtp_inputs(args: ModelArgs, c: int) -> float:
    """Bytes per token one multi-token prediction module (model/mtp.py) keeps before its
    block: its two input norms (the input widened, 1/rms, the normalised input and the output,
    as any RMSNorm here) and the projection's input (the two outputs, concatenated)."""
    w, h = wide(c), args.dim
    return 2 * ((w + 2 * c) * h + w) + 2 * c * h


def core_saved(args: ModelArgs, c: int, tp: int, cp: int, cp_impl: str) -> list[Saved]:
    """What the attention core keeps, per token this rank holds. The fused kernel, and ring
    attention (parallel/context/ring.py): the rotated q and k, v, the softmax statistics.
    All-gather attention keeps every rank's K and V (cp times its own); Ulysses keeps q, k, v
    and the output over the whole sequence for its heads (the same count as its tokens for
    every head; K/V heads repeated up to cp when there are fewer), and its output once more."""
    kv, w = kv_width(args, tp), wide(c)
    q, heads = args.n_heads * args.head_dim / tp, args.n_heads / tp
    stats = Saved("softmax statistics", w * heads, SPLIT, core=True)
    if cp > 1 and cp_impl == "allgather":
        return [Saved("q (rotated)", c * q, SPLIT, core=True), Saved("every rank's k, v", 2 * c * kv * cp, SPLIT, core=True),
                stats]
    if cp > 1 and cp_impl == "ulysses":
        kv_heads = kv // args.head_dim
        kv = (kv_heads if kv_heads % cp == 0 else cp) * args.head_dim
        return [Saved("q, k, v (all tokens, cp's heads)", c * (q + 2 * kv), SPLIT, core=True),
                Saved("attention output (heads)", c * q, SPLIT, core=True), stats]
    return [Saved("q, k (rotated)", c * (q + kv), SPLIT, core=True), Saved("v", c * kv, SPLIT, core=True), stats]


def llama_core_inputs(args: ModelArgs, c: int, tp: int) -> list[Saved]:
    """What selective recompute keeps of the core instead: its inputs q, k, v."""
    return [Saved("q, k, v (core inputs)", c * (args.n_heads * args.head_dim / tp + 2 * kv_width(args, tp)), SPLIT)]


def llama_mlp_bytes_per_token(args: ModelArgs, c: int, tp: int, sp: bool, moe: bool = False, ep: int = 1) -> float:
    """The part of a block's saved tensors its MLP holds (freed before attention's backward
    starts): SwiGLU's four (an MoE's terms), its input (gathered under SP), the attention
    residual (fp32), the second norm's 1/rms and normalised input."""
    w, r = wide(c), (tp if sp else 1)
    mlp = sum(x.bytes_per_token for x in moe_mlp(args, c, tp, sp, ep)) if moe else 4 * c * args.ffn_dim / tp
    return mlp + c * args.dim + (w * args.dim + w + c * args.dim) / r


def gpt_block(h: int, heads: int, s: int, tp: int) -> list[Saved]:
    """Korthikanti et al.'s GPT layer, 16-bit activations and 1-byte dropout masks."""
    return [
        Saved("layer norm inputs", 2 * 2 * h, RESIDUAL),
        Saved("dropout masks (attention, MLP outputs)", 2 * h, RESIDUAL),
        Saved("QKV and MLP inputs", 2 * 2 * h, REGION),
        Saved("Q, K", 4 * h / tp, SPLIT),
        Saved("V", 2 * h / tp, SPLIT),
        Saved("projection input", 2 * h / tp, SPLIT),
        Saved("GeLU input and output", 16 * h / tp, SPLIT),
        Saved("softmax, its dropout mask and output", 5 * heads * s / tp, SPLIT, core=True),
    ]


def per_token(terms: list[Saved], tp: int, sp: bool, region_split: bool) -> float:
    """Bytes per token of the full sequence on one rank. `region_split`: under SP the inputs
    of the column-parallel layers are kept split (Megatron) rather than gathered (ndtrain)."""
    total = 0.0
    for term in terms:
        divide = tp if sp and (term.where == RESIDUAL or (term.where == REGION and region_split)) else 1
        total += term.bytes_per_token / divide
    return total


def block_bytes_per_token(args: ModelArgs, c: int, tp: int, sp: bool, mode: str, cp: int = 1,
                          cp_impl: str = "ring", moe: bool = False, ep: int = 1) -> float:
    """ndtrain's block, per token a rank holds: mode is "none", "selective" or "full" (recomputed)."""
    if mode == "full":
        return c * args.dim / (tp if sp else 1)
    terms = llama_block(args, c, tp, cp, cp_impl, moe, sp, ep)
    if mode == "selective":
        terms = [x for x in terms if not x.core] + llama_core_inputs(args, c, tp)
    return per_token(terms, tp, sp, region_split=False)


def korthikanti_bytes_per_token(h: int, heads: int, s: int, tp: int, sp: bool, mode: str) -> float:
    """Korthikanti et al.'s layer under our bookkeeping (Table 2's rows)."""
    if mode == "full":
        return 2 * h
    terms = [x for x in gpt_block(h, heads, s, tp) if not (mode == "selective" and x.core)]
    return per_token(terms, tp, sp, region_split=True)


def head_bytes_per_token(args: ModelArgs, c: int, tp: int, sp: bool) -> float:
    """The final norm and the head's input: the last block's output in fp32, 1/rms, the
    normalised output (residual stream), the head's input (gathered under SP)."""
    r, w = (tp if sp else 1), wide(c)
    return (w * args.dim + w + c * args.dim) / r + c * args.dim


def recomputed(mode: str, layer: int) -> str:
    """How `train.recompute` treats global layer `layer`: none, selective or full."""
    if mode in ("none", "selective"):
        return mode
    every = 1 if mode == "full" else int(mode.split(":")[1])
    return "full" if layer % every == 0 else "none"
