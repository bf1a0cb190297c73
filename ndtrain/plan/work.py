"""What one micro-batch asks of a rank, kernel by kernel: the matmuls (with their shapes),
the memory-bound elementwise traffic and the number of operations, for each pass.

A pipeline chunk's work for one micro-batch splits into the passes a schedule orders:
- F, the forward;
- B, the input gradients (and the recomputed forward of what `train.recompute` reruns,
  counted apart as `recompute`);
- W, the weight gradients (a separate pass only under zero bubble; otherwise part of B).
A forward matmul X[m×k]·Wᵀ costs two backward ones: the input gradient (m×n by n×k) and the
weight gradient (n×m by m×k). The attention core (QKᵀ and AV, the causal half, one fused
kernel) has no weights: its backward is input gradients only, twice the forward.

Shapes are what the rank computes: heads and features divided by t, the micro-batch's
tokens by cp (all of them for the column-parallel matmuls under SP, which gather first); a
mixture-of-experts block routes 1/t of the tokens on each tp rank (parallel/expert.py) and
runs its E/ep experts on the slots it receives, k per routed token, `imbalance` times the
average on the busiest rank. Under fp8 (`fp8=True`) the block's linear layers (attention
projections, MLP, routed and shared experts) run in fp8; the router, the attention core,
the embedding and the head do not.

A GPU prices the matmuls' FLOPs at its peak (plan/compute.py) and nothing else; this
machine's calibration prices every term.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ndtrain.model.args import ModelArgs
from ndtrain.plan.activations import kv_width, recomputed, wide


@dataclass(frozen=True)
class Matmul:
    m: int  # rows of the output (tokens)
    k: int  # the reduction
    n: int  # columns of the output
    times: float = 1.0  # how many (batched heads, experts; 0.5 for the causal half)
    fp8: bool = False

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.times


@dataclass(frozen=True)
class Attention:
    """A fused causal attention kernel: `times` (rows × heads) of s_q queries against s_k keys,
    head_dim d; `passes` 1 forward, 2 its backward (the flash backward)."""

    times: float
    s_q: int
    s_k: int
    d: int
    passes: int = 1

    @property
    def flops(self) -> float:
        """QKᵀ and AV, the causal half: 2 · 2·s_q·s_k·d / 2 per head and row, per pass."""
        return 2.0 * self.s_q * self.s_k * self.d * self.times * self.passes


@dataclass
class Work:
    matmuls: list[Matmul] = field(default_factory=list)
    elementwise: float = 0.0  # bytes read and written by memory-bound operations
    ops: float = 0.0  # operations dispatched (each costs a fixed overhead on a CPU)
    attention: list[Attention] = field(default_factory=list)
    splits: float = 0.0  # blocks whose backward zero bubble splits into B and W (a fixed cost each)
    experts: float = 0.0  # local experts an MoE block's loop visits (a fixed cost each on a CPU)

    def __add__(self, other: "Work") -> "Work":
        return Work(self.matmuls + other.matmuls, self.elementwise + other.elementwise, self.ops + other.ops,
                    self.attention + other.attention, self.splits + other.splits, self.experts + other.experts)

    @property
    def flops(self) -> float:
        return sum(mm.flops for mm in self.matmuls) + sum(a.flops for a in self.attention)


@dataclass(frozen=True)
class Passes:
    """One micro-batch through one chunk: forward, input gradients, weight gradients, and the
    recomputed forward (part of B in time)."""

    forward: Work
    inputs: Work
    weights: Work
    recompute: Work


def backward(forward: Work) -> tuple[Work, Work]:
    """(input gradients, weight gradients) of a forward: each weight matmul gives one of each,
    a weightless one (attention) two input gradients; elementwise work twice over."""
    inputs, weights = [], []
    for mm in forward.matmuls:
        inputs.append(Matmul(mm.m, mm.n, mm.k, mm.times, mm.fp8))
        weights.append(Matmul(mm.n, mm.m, mm.k, mm.times, mm.fp8))
    attention = [Attention(a.times, a.s_q, a.s_k, a.d, 2) for a in forward.attention]
    # autograd runs about 1.8 operations per forward one (counted on the model, forward and backward)
    return (Work(inputs, 2 * forward.elementwise, 1.35 * forward.ops, attention, experts=forward.experts),
            Work(weights, 0.0, 0.45 * forward.ops))


@dataclass(frozen=True)
class Shape:
    """What the work of a micro-batch on one rank depends on."""

    args: ModelArgs
    tokens: int  # the micro-batch's tokens this rank computes (after cp)
    rows: int  # sequences in the micro-batch
    seq_len: int
    tp: int
    cp: int
    ep: int
    c: int  # bytes per value in the compute dtype
    fp8: bool = False
    imbalance: float = 1.0  # the busiest rank's routed slots over the average
    cp_impl: str = "ring"
    low: str = "fp8"  # the peak the fp8-flagged matmuls run at: fp8, or fp4 (NVFP4)
    base_layers: frozenset = frozenset()  # blocks whose linears stay in the compute dtype (NVFP4's tail)

    def attention(self) -> Work:
        """The scores QKᵀ and the weighted sum AV, causal half, over rows and heads: the queries
        this rank holds against the whole sequence, on fused attention kernels. Under ring and
        all-gather context parallelism the engine runs them block by block
        (parallel/context/fused.py) and merges the partial results in fp32: per step, the
        queries copied to head layout, the running output and its log-sum-exp merged (about 6
        passes over the rank's queries' outputs in fp32), some 15 operations."""
        a = self.args
        heads, q = self.rows * (a.n_heads // self.tp), self.seq_len // self.cp
        kernel = Work(ops=1.0, attention=[Attention(heads, q, self.seq_len, a.head_dim)])
        if self.cp == 1 or self.cp_impl == "ulysses":
            return kernel
        steps = self.cp if self.cp_impl == "ring" else 1
        width = heads * q * a.head_dim  # the rank's queries (and outputs) over all its heads
        return kernel + Work([], steps * (2 * self.c + 6 * 4) * width, 15.0 * steps)

    def dense_block(self, layer: int) -> Work:
        a, t, T, c = self.args, self.tp, self.tokens, self.c
        q, kv, f = a.n_heads * a.head_dim // t, kv_width(a, t), a.ffn_dim // t
        w, h = wide(c), a.dim
        fp8 = self.fp8 and layer not in self.base_layers
        attention = [Matmul(T, h, q, fp8=fp8), Matmul(T, h, kv, fp8=fp8), Matmul(T, h, kv, fp8=fp8),
                     Matmul(T, q, h, fp8=fp8)]
        # elementwise bytes per token: two RMSNorms in fp32 (about 6 passes of w·h each), the
        # rotary embedding of q and k (about 8 passes), two residual additions (3 passes each)
        norms_residual_rotary = 12 * w * h + 6 * c * h + 8 * c * (q + kv)
        # operations per block forward, counted on the model (aten ops): 60 for the attention
        # half and the norms, 16 for a SwiGLU MLP
        work = Work(attention, norms_residual_rotary * T, 59.0) + self.attention()
        if a.is_moe_layer(layer):
            return work + self.moe_mlp()
        mlp = [Matmul(T, h, f, fp8=fp8), Matmul(T, h, f, fp8=fp8), Matmul(T, f, h, fp8=fp8)]
        return work + Work(mlp, 5 * c * f * T, 16.0)  # silu and the product: 5 passes of f

    def moe_mlp(self) -> Work:
        """Router (fp32), the routed experts on this rank's received slots, shared experts."""
        a, c, h, fe = self.args, self.c, self.args.dim, self.args.expert_dim
        routed = self.tokens // self.tp  # each tp rank routes its share of the positions
        local = a.moe_experts // self.ep
        rows = routed * a.moe_top_k * self.imbalance / local  # per local expert, on the busiest rank
        mm = [Matmul(routed, h, a.moe_experts),
              Matmul(round(rows), h, fe, local, self.fp8), Matmul(round(rows), h, fe, local, self.fp8),
              Matmul(round(rows), fe, h, local, self.fp8)]
        if a.moe_shared_experts:
            s = a.moe_shared_experts * fe
            mm += [Matmul(routed, h, s, fp8=self.fp8), Matmul(routed, h, s, fp8=self.fp8),
                   Matmul(routed, s, h, fp8=self.fp8)]
        slots = routed * a.moe_top_k * self.imbalance
        # softmax and top-k over E, the slots gathered, sorted, scattered back and weighted
        elementwise = 12 * a.moe_experts * routed + slots * (6 * c * h + 5 * c * fe)
        return Work(mm, elementwise, 30.0, experts=float(local))  # a loop over the local experts on a CPU

    def embedding(self) -> Work:
        """The lookup forward; its backward (`embedding_backward`) fills a whole table."""
        return Work([], 2 * self.c * self.args.dim * self.tokens, 2.0)

    def embedding_backward(self) -> Work:
        """A dense [V/t, h] gradient zeroed, scattered into and added to the table's."""
        rows = -(-self.args.vocab_size // self.tp)
        return Work([], 4 * self.c * rows * self.args.dim + 3 * self.c * self.args.dim * self.tokens, 4.0)

    def head(self) -> Work:
        """Final norm, the head's matmul and the loss (log-softmax over the vocabulary, fp32)."""
        a, T, c = self.args, self.tokens, self.c
        v = -(-a.vocab_size // self.tp)
        w = wide(c)
        return Work([Matmul(T, a.dim, v)], 6 * w * a.dim * T + 4 * w * v * T, 13.0)


def chunk_passes(shape: Shape, layers, embed: bool, head: bool, recompute: str, split: bool = False) -> Passes:
    """One micro-batch through a chunk holding `layers` (global indices), the embedding
    and/or the head; `split`: zero bubble splits each block's backward (B, then W)."""
    forward, rerun = Work(), Work()
    for i in layers:
        block = shape.dense_block(i)
        forward = forward + block
        mode = recomputed(recompute, i)
        if mode == "full":
            rerun = rerun + block
        elif mode == "selective":
            rerun = rerun + shape.attention()
    if head:
        forward = forward + shape.head()
    inputs, weights = backward(forward)
    weights.splits = float(len(layers)) if split else 0.0
    if embed:  # no input gradient: the lookup's backward fills the table's gradient
        forward, weights = shape.embedding() + forward, weights + shape.embedding_backward()
    return Passes(forward, inputs, weights, rerun)
