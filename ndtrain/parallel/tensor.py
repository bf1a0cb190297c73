"""Tensor and sequence parallelism: Megatron-LM's intra-layer split (Shoeybi et al. 2019),
with the residual stream split along the sequence between layers (Korthikanti et al. 2022).

A decoder block has two tensor-parallel (TP) regions, attention and the MLP. Inside a region
the weights are split over the `t` ranks of `tp` so that nothing is communicated between
the first matmul and the last:

    x ─f─► wq wk wv (column-parallel) ─► attention over this rank's heads ─► wo (row-parallel) ─g─► +
    x ─f─► w1 w3 (column-parallel) ─► silu(gate)·up on this rank's features ─► w2 (row-parallel) ─g─► +

The conjugate operators at the edges carry all the communication:
- f enters a region: identity forward; backward, all-reduce of the input's gradient.
- g leaves it: all-reduce of the partial sums forward; identity backward.
Four all-reduces of b·s·h per layer and micro-batch: 8·b·s·h·(t−1)/t elements on the wire
(Narayanan et al. 2021).

Sequence parallelism (SP, `parallel.sp`) splits the residual stream between regions along
the sequence, so the norms, dropout and residual adds handle s/t positions per rank. f
becomes an all-gather (reduce-scatter backward) and g a reduce-scatter (all-gather
backward): the same bytes, and 1/t of the activation memory outside the regions. A norm
weight then sees only this rank's positions, so its gradient is a partial sum over tp:
the step completes it once, after the last micro-batch, in one all-reduce of every such
weight together (`sum_partial_grads`): 8·b·s·h·(t−1)/t per layer and micro-batch, plus
2·2h·(t−1)/t per layer and step.

The vocabulary is split too: the embedding looks up the rows it holds and leaves through g
(or the reduce-scatter); the head produces this rank's columns of the logits, and the loss
(`vocab_parallel_cross_entropy`) is computed from them with three reductions of b·s
numbers, never the full [b, s, vocab] on one rank. The vocabulary is padded to a multiple
of t with zero rows whose logits are masked to −inf, so padding changes no result.

Where each piece sits:
- `parallelize(model, group, sp, device)` swaps the plain model's modules for the ones
  named in PLAN; model/llama.py holds no parallel code. The entry f (or its SP all-gather)
  is applied once per region by the norm in front of it, because q, k, v (and gate, up)
  share one input.
- Grouped-query attention: KV heads are split like query heads when t divides their
  number; otherwise every rank keeps the whole (small) K and V projections, uses the head
  its query heads read, and the step sums the gradients of the ranks sharing it (the
  weight is marked partial, as a sequence-parallel norm weight is).
- Initialisation: `build` creates the swapped model on the meta device; parallel/construct.py
  then fills every rank's parameters with its slice of the full initial value, computing
  only that slice (model/init.py), so every layout starts from the same full weights.
- Random numbers: ranks of one TP group share one random stream (the trainer seeds by the
  rank without its tp coordinate). A random op on a split tensor draws the numbers of the
  full tensor and keeps its slice (`SequenceShardedDropout`), so dropout equals one device.
- Latent attention (model/mla.py): the up-projections wq_b (or wq) and wkv_b are
  column-parallel by heads, wo row-parallel; the down-projections wq_a and wkv_a and their
  norms are whole on every rank, their gradients partial over tp (marked like a q/k norm's).
- Biases and q/k norms (Qwen2, Qwen3): a column-parallel bias is split with the rows it
  adds to; a q/k norm weight is shared by all heads, so every rank keeps it whole and its
  gradient is partial over tp (marked like a sequence-parallel norm weight).
- gpt-oss: attention sinks split with the heads; the o_proj bias whole, added by rank 0.
  OLMo 2: regions entered without a norm (`RegionEntry`), q/k norms over all heads split
  with them, their statistics completed over tp (parallel/tensor_norms.py).
- LoRA adapters (model/lora.py) follow their base layer: a column-parallel layer's B is
  split by output rows and A stays whole, a row-parallel layer's A by input columns and B
  stays whole (its product joins the partial sums before g); the whole one's gradient is
  partial over tp, completed like a sequence-parallel norm weight's.
- The loss from vocabulary-split logits lives in parallel/vocab_loss.py.
- Split parameters carry `mark_sharded(p, ("tp",))` for the global gradient norm, their
  split (`split_of`) for `full_state`, which gathers the whole model, and their place in
  the whole tensor (`mark_region`) for checkpoints, which read and write any layout.
- Mixture-of-experts blocks: the experts are *not* split by TP. Every tp rank keeps the whole
  router, experts and shared experts and routes its own 1/tp of the positions (under SP
  the ones it holds; parallel/expert.py sets that up), so their gradients are partial sums
  over tp, completed once per step like a sequence-parallel norm weight's. The block's
  norm is then a plain norm outside any TP region.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ndtrain.comm import ops
from ndtrain.mesh import Group
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import MoE, RMSNorm, Transformer, rms_norm, softcap, widened
from ndtrain.model.lora import LoRA
from ndtrain.parallel import tensor_mtp
from ndtrain.parallel.placement import mark_partial, mark_region, mark_sharded
from ndtrain.parallel.tensor_dropout import SequenceShardedDropout
from ndtrain.parallel.vocab_loss import (VocabParallelCrossEntropy, VocabParallelNLL,  # noqa: F401 (re-exported)
                                         vocab_parallel_cross_entropy)

# ---------------------------------------------------------------------------------------
# The conjugate operators. The residual stream is [b, s, h]; SP splits dimension 1.


class CopyToTP(torch.autograd.Function):
    """f. Forward: identity. Backward: all-reduce (sum) of the gradient over tp.

    Every rank feeds the same input to its own slice of the weights, so each computes only
    part of the input's gradient; the full gradient is their sum. The incoming gradient is
    reduced in place: it is a fresh tensor made by the matmuls that consume f's output.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        ops.all_reduce(grad, ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g. Forward: all-reduce (sum) over tp of each rank's partial result. Backward: identity.

    After a row-parallel matmul each rank holds a partial sum of the output; the sum is
    the output. Its gradient is the same on every rank, so backward needs nothing.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.mark_dirty(x)
        ops.all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class GatherSequence(torch.autograd.Function):
    """f under SP. Forward: all-gather along the sequence, [b, s/t, h] → [b, s, h].
    Backward: reduce-scatter along the sequence, [b, s, h] → [b, s/t, h].

    The region needs every position; each rank's gradient of the gathered input is partial
    (its own weight slices), so backward sums and hands each rank its positions at once.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_sequence(grad, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """g under SP. Forward: reduce-scatter along the sequence, partial [b, s, h] → summed
    [b, s/t, h]. Backward: all-gather along the sequence, [b, s/t, h] → [b, s, h].

    The gradient of every position of the partial sums is the gradient of the sum at that
    position, which lives on the rank that holds it: gathering gives it to everyone.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return gather_sequence(grad, ctx.group), None


def gather_sequence(x: Tensor, group: Group) -> Tensor:
    """[b, s/t, ...] from every rank → [b, s, ...], ranks' chunks in order."""
    t, b = group.size, x.shape[0]
    out = x.new_empty((t * b, *x.shape[1:]))  # the collectives work along dim 0
    ops.all_gather(out, x.contiguous(), group)
    # [t, b, s/t, ...] → [b, t·s/t, ...]: a copy unless b = 1
    return out.view(t, *x.shape).transpose(0, 1).reshape(b, t * x.shape[1], *x.shape[2:])


def reduce_scatter_sequence(x: Tensor, group: Group) -> Tensor:
    """Partial [b, s, ...] on every rank → this rank's s/t positions of the sum."""
    t, b, s = group.size, x.shape[0], x.shape[1]
    chunks = x.reshape(b, t, s // t, *x.shape[2:]).transpose(0, 1).contiguous()
    out = x.new_empty(chunks.shape[1:])
    ops.reduce_scatter(out, chunks.flatten(0, 1), group)
    return out


def enter_region(x: Tensor, group: Group, sp: bool) -> Tensor:
    return GatherSequence.apply(x, group) if sp else CopyToTP.apply(x, group)


def leave_region(x: Tensor, group: Group, sp: bool) -> Tensor:
    return ReduceScatterSequence.apply(x, group) if sp else ReduceFromTP.apply(x, group)


# ---------------------------------------------------------------------------------------
# Split parameters


@dataclass(frozen=True)
class Split:
    """A parameter holds rank r's chunk of the full tensor along `dim`, whose size `full`
    is padded with zeros to a multiple of t first."""

    dim: int
    full: int


_SPLIT_ATTR = "_ndtrain_tp_split"


def split_of(p: Tensor) -> Split | None:
    return getattr(p, _SPLIT_ATTR, None)


def local_slice(full: Tensor, split: Split, group: Group) -> Tensor:
    """This rank's chunk of a full tensor (padded with zeros to t equal chunks)."""
    per_rank = math.ceil(split.full / group.size)
    pad = per_rank * group.size - split.full
    if pad:
        shape = list(full.shape)
        shape[split.dim] = pad
        full = torch.cat([full, full.new_zeros(shape)], dim=split.dim)
    return full.narrow(split.dim, group.rank * per_rank, per_rank)


# ---------------------------------------------------------------------------------------
# Layers. Each takes its (local) weight; `parallelize` below makes them from the plain ones.


class ColumnParallelLinear(nn.Module):
    """Y_r = X·A_rᵀ + b_r, A split by rows (output features), a bias with them: this
    rank's features of Y.

    The input must already be inside the region (the same full X on every rank); the
    output stays split for the row-parallel layer that ends the region.
    """

    linear = staticmethod(F.linear)  # the product; parallel/fp8.py may put an fp8 one here

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None, lora: LoRA | None = None):
        super().__init__()
        self.weight, self.bias, self.lora = weight, bias, lora

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x, self.weight, self.bias)
        return y if self.lora is None else y + self.lora(x)


class RowParallelLinear(nn.Module):
    """Y = Σ_r X_r·B_rᵀ, B split by columns (input features): each rank multiplies its
    features of X, and g (or the SP reduce-scatter) sums the partial results."""

    linear = staticmethod(F.linear)

    def __init__(self, weight: nn.Parameter, group: Group, sp: bool, lora: LoRA | None = None,
                 bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.group, self.sp, self.lora = weight, group, sp, lora
        # gpt-oss's o_proj bias: whole on every rank, added to rank 0's partial sum only (so
        # once to the total); rank 0's gradient is the whole one, the others' 0: partial over tp.
        self.bias = mark_partial(bias, ("tp",)) if bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x, self.weight, self.bias if self.group.rank == 0 else None)
        if self.lora is not None:  # B·(A_r·x_r): a partial sum too, completed by the same reduction
            y = y + self.lora(x)
        return leave_region(y, self.group, self.sp)


class ReplicatedHeadsLinear(nn.Module):
    """The K or V projection when there are fewer KV heads than tp ranks.

    Every rank keeps the whole weight (kv_heads·head_dim rows, small) and computes only the
    head its query heads read; the ranks sharing a head each hold part of its gradient. The
    weight is marked partial over tp: the step sums its gradient once, after the last
    micro-batch (`sum_partial_grads`), and every copy stays equal.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, head_dim: int, n_kv_heads: int,
                 group: Group, lora: LoRA | None = None):
        super().__init__()
        self.weight, self.group = mark_partial(weight, ("tp",)), group
        self.bias = mark_partial(bias, ("tp",)) if bias is not None else None
        head = group.rank // (group.size // n_kv_heads)  # query heads are split contiguously
        self.rows = slice(head * head_dim, (head + 1) * head_dim)
        self.lora = lora
        if lora is not None:
            lora.rows = self.rows

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight[self.rows], self.bias[self.rows] if self.bias is not None else None)
        return y if self.lora is None else y + self.lora(x)


class RegionEntryNorm(nn.Module):
    """RMSNorm, then the entry into the TP region it feeds (f, or the SP all-gather).

    Under SP the norm sees this rank's positions only, so its weight's gradient is a
    partial sum: the weight is marked partial over tp, and the step completes the sum once,
    after the last micro-batch (`sum_partial_grads`).
    """

    def __init__(self, weight: nn.Parameter, eps: float, group: Group, sp: bool, offset: float = 0.0):
        super().__init__()
        self.weight, self.eps, self.group, self.sp, self.offset = weight, eps, group, sp, offset
        if sp:
            mark_partial(weight, ("tp",))

    def forward(self, x: Tensor) -> Tensor:
        return enter_region(self.normed(x), self.group, self.sp)

    def normed(self, x: Tensor) -> Tensor:  # before the entry: what the MTP modules read (tensor_mtp.py)
        return rms_norm(x, self.weight, self.eps, self.offset)


class RegionEntry(nn.Module):
    """The entry into a TP region with no norm in front of it (OLMo 2's block)."""

    def __init__(self, group: Group, sp: bool):
        super().__init__()
        self.group, self.sp = group, sp

    def forward(self, x: Tensor) -> Tensor:
        return enter_region(x, self.group, self.sp)


@torch.no_grad()
def sum_partial_grads(grads: list[Tensor], group: Group) -> None:
    """Complete the gradients that each tp rank holds only part of (`partial_dims`): one
    fp32 all-reduce of all of them together, once per step, after the last backward and the
    data-parallel reduction (both sums, so their order does not matter). Megatron does the
    same for its sequence-parallel norm weights. Collective over tp; every rank must pass
    the same shapes in the same order."""
    if not grads or not group.active:
        return
    flat = torch.cat([widened(g.reshape(-1)) for g in grads])
    ops.all_reduce(flat, group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class VocabParallelEmbedding(nn.Module):
    """The lookup table split by rows (tokens): each rank embeds the tokens it holds, zeros
    for the others, and g (or the SP reduce-scatter) sums the ranks' rows."""

    def __init__(self, weight: nn.Parameter, group: Group, sp: bool):
        super().__init__()
        self.weight, self.group, self.sp = weight, group, sp
        self.start = group.rank * weight.shape[0]

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return leave_region(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group, self.sp)


class VocabParallelHead(nn.Module):
    """The output projection split by rows (tokens): this rank's columns of the logits,
    soft-capped like the plain head's (Gemma 2). Columns of the padding are −inf (after
    the cap), so they take no probability."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: Group, softcap: float = 0.0):
        super().__init__()
        self.weight, self.softcap = weight, softcap
        self.real = max(0, min(weight.shape[0], vocab_size - group.rank * weight.shape[0]))

    def forward(self, x: Tensor) -> Tensor:
        logits = F.linear(x, self.weight)
        if self.softcap:
            logits = softcap(logits, self.softcap)
        if self.real < self.weight.shape[0]:
            padding = torch.arange(self.weight.shape[0], device=x.device) >= self.real
            logits = logits.masked_fill(padding, float("-inf"))
        return logits


# ---------------------------------------------------------------------------------------
# The plan: which module of the plain model becomes which parallel module


@dataclass
class Context:
    args: ModelArgs
    group: Group
    sp: bool
    # plain parameter → its replacement, so a tied head shares the embedding's
    made: dict[int, nn.Parameter] = field(default_factory=dict)
    name: str = ""  # the module being swapped, e.g. "layers.3.ffn_norm"

    def param(self, plain: nn.Parameter, split_dim: int | None = None) -> nn.Parameter:
        """The local parameter standing for `plain` (on the meta device, like the plain
        model: parallel/construct.py gives it memory and its value): whole, or this rank's
        chunk along `split_dim`, marked as split over tp."""
        if id(plain) not in self.made:
            shape = list(plain.shape)
            if split_dim is not None:
                shape[split_dim] = math.ceil(shape[split_dim] / self.group.size)
            p = nn.Parameter(torch.empty(shape, device="meta"))
            if split_dim is not None:
                setattr(p, _SPLIT_ATTR, Split(split_dim, plain.shape[split_dim]))
                mark_sharded(p, ("tp",))
                offsets = [0] * len(shape)
                offsets[split_dim] = self.group.rank * shape[split_dim]
                mark_region(p, plain.shape, offsets)
            self.made[id(plain)] = p
        return self.made[id(plain)]


def _embedding(m: nn.Embedding, c: Context) -> nn.Module:
    return VocabParallelEmbedding(c.param(m.weight, 0), c.group, c.sp)


def _head(m: nn.Linear, c: Context) -> nn.Module:
    return VocabParallelHead(c.param(m.weight, 0), c.args.vocab_size, c.group, m.softcap)


def _entry_norm(m: RMSNorm, c: Context) -> nn.Module:
    if not isinstance(m, RMSNorm):  # OLMo 2: no norm before the region
        return RegionEntry(c.group, c.sp)
    return RegionEntryNorm(c.param(m.weight), m.eps, c.group, c.sp, m.offset)


def _adapter(m: nn.Linear, c: Context, a_dim: int | None, b_dim: int | None) -> LoRA | None:
    """The LoRA adapter of `m`, if it has one, split with its base weight: a column-parallel
    layer's B by its output rows (A whole), a row-parallel layer's A by its input columns (B
    whole). The whole one sees the sum of every rank's part of its gradient only after the
    step's tp reduction: it is marked partial, like a sequence-parallel norm weight."""
    lora = getattr(m, "lora", None)
    if not isinstance(lora, LoRA):
        return None
    a, b = c.param(lora.a, a_dim), c.param(lora.b, b_dim)
    for p, dim in ((a, a_dim), (b, b_dim)):
        if dim is None:
            mark_partial(p, ("tp",))
    return LoRA(a, b, lora.scale, lora.dropout)


def _column(m: nn.Linear, c: Context) -> nn.Module:
    bias = c.param(m.bias, 0) if m.bias is not None else None  # split with the rows it adds to
    return ColumnParallelLinear(c.param(m.weight, 0), bias, _adapter(m, c, None, 0))


def _row(m: nn.Linear, c: Context) -> nn.Module:
    bias = c.param(m.bias) if m.bias is not None else None
    return RowParallelLinear(c.param(m.weight, 1), c.group, c.sp, _adapter(m, c, 1, None), bias)


def _attention(m: nn.Module, c: Context) -> nn.Module:
    """Attention sinks (gpt-oss) are one logit per query head: split with the heads."""
    if getattr(m, "sinks", None) is not None:
        m.sinks = c.param(m.sinks, 0)
    return m


def _kv(m: nn.Linear, c: Context) -> nn.Module:
    if c.args.n_kv_heads % c.group.size == 0:
        return _column(m, c)
    bias = c.param(m.bias) if m.bias is not None else None
    return ReplicatedHeadsLinear(c.param(m.weight), bias, c.args.head_dim, c.args.n_kv_heads, c.group,
                                 _adapter(m, c, None, None))


def _head_norm(m: RMSNorm, c: Context) -> nn.Module:
    """A q/k norm weight is shared by every head, and each rank normalises only its own
    heads: the whole weight on every rank, its gradient partial over tp. OLMo 2's norm over
    all heads: split with them, its statistics completed over tp (parallel/tensor_norms.py)."""
    if c.args.qk_norm_all:
        from ndtrain.parallel.tensor_norms import WholeWidthNorm
        return WholeWidthNorm(c.param(m.weight, 0), m.eps, m.weight.shape[0], c.group)
    m.weight = mark_partial(c.param(m.weight), ("tp",))
    return m


def _replicated(m: nn.Linear, c: Context) -> nn.Module:
    """Latent attention's down-projections (wq_a, wkv_a): inside the region, whole on every
    rank (each feeds every head); a rank's gradient covers its own heads only, so it is
    partial over tp, like a q/k norm weight's."""
    m.weight = mark_partial(c.param(m.weight), ("tp",))
    if isinstance(getattr(m, "lora", None), LoRA):  # its adapter (model/lora.py): whole too, partial gradients
        m.lora.a, m.lora.b = (mark_partial(c.param(p), ("tp",)) for p in (m.lora.a, m.lora.b))
    return m


def _dropout(m: nn.Dropout, c: Context) -> nn.Module:
    return SequenceShardedDropout(m.p, c.group) if c.sp else m


def _moe_layer(c: Context) -> bool:  # an MTP module's block is of the last block's kind
    return c.args.is_moe_layer(c.args.n_layers - 1 if c.name.startswith("mtp.") else int(c.name.split(".")[1]))


def _ffn_norm(m: RMSNorm, c: Context) -> nn.Module:
    """The norm before the MLP enters its TP region; before an MoE, it stays a plain norm
    (or no norm: OLMo 2's block without pre-norms)."""
    if _moe_layer(c):
        return _plain_norm(m, c) if isinstance(m, RMSNorm) else m
    return _entry_norm(m, c)


def _plain_norm(m: RMSNorm, c: Context) -> nn.Module:
    """A norm outside any TP region (before an MoE; Gemma 2's norms after attention and the
    MLP, on the region's output): whole on every rank, under SP on this rank's positions, so
    its gradient is partial."""
    m.weight = c.param(m.weight)
    if c.sp:
        mark_partial(m.weight, ("tp",))
    return m


def _feed_forward(m: nn.Module, c: Context) -> nn.Module:
    """A dense MLP is swapped weight by weight (below). An MoE keeps every weight whole on
    every tp rank, a partial gradient."""
    if not isinstance(m, MoE):
        return m
    for module in m.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, mark_partial(c.param(p), ("tp",)))
    return m


Swap = Callable[[nn.Module, Context], nn.Module]

PLAN: dict[str, Swap] = {
    "tok_embeddings": _embedding,
    "layers.*.attention": _attention,
    "layers.*.attention_norm": _entry_norm,
    "layers.*.attention.wq": _column,
    "layers.*.attention.wk": _kv,
    "layers.*.attention.wv": _kv,
    "layers.*.attention.wo": _row,
    "layers.*.attention.q_norm": _head_norm,
    "layers.*.attention.k_norm": _head_norm,
    # latent attention (model/mla.py): heads split, the down-projections and their norms whole
    "layers.*.attention.wq_a": _replicated,
    "layers.*.attention.q_a_norm": _head_norm,
    "layers.*.attention.wq_b": _column,
    "layers.*.attention.wkv_a": _replicated,
    "layers.*.attention.kv_a_norm": _head_norm,
    "layers.*.attention.wkv_b": _column,
    "layers.*.dropout": _dropout,
    "layers.*.ffn_norm": _ffn_norm,
    "layers.*.attention_post_norm": _plain_norm,
    "layers.*.ffn_post_norm": _plain_norm,
    "layers.*.feed_forward": _feed_forward,
    "layers.*.feed_forward.w1": _column,  # gate
    "layers.*.feed_forward.w3": _column,  # up
    "layers.*.feed_forward.w2": _row,  # down
    "norm": _entry_norm,
    "output": _head,
}
PLAN.update(tensor_mtp.plan(PLAN, _plain_norm, _entry_norm, _embedding))  # multi-token prediction (model/mtp.py)


def parallelize(model: Transformer, group: Group, sp: bool) -> Transformer:
    """Swap the modules named in PLAN for their tensor-parallel versions, in place. The
    new parameters are this rank's chunks, on the meta device."""
    c = Context(model.args, group, sp)
    for name, module in list(model.named_modules()):
        swap = next((fn for pattern, fn in PLAN.items() if fnmatchcase(name, pattern)), None)
        if swap is not None:
            c.name = name
            model.set_submodule(name, swap(module, c))
    left = [n for n, p in model.named_parameters() if id(p) not in {id(q) for q in c.made.values()}]
    if left:  # a plain weight left in place would be trained as a replica: wrong, silently
        raise ValueError(f"tensor parallelism has no plan for {left[:3]}")
    return model


def build(args: ModelArgs, group: Group, sp: bool, layer_ids=None, embed: bool = True,
          head: bool = True) -> Transformer:
    """This rank's tensor-parallel model (or pipeline chunk: `layer_ids`, `embed`, `head` as
    in `Transformer`), laid out on the meta device with its modules swapped: no memory yet
    (parallel/construct.py materialises this rank's chunks with their slices of the full
    initial values)."""
    with torch.device("meta"):
        model = Transformer(args, layer_ids, embed, head)
    return parallelize(model, group, sp)


def full_state(model: nn.Module, state: dict[str, Tensor], group: Group) -> dict[str, Tensor]:
    """The full tensors of `state` (this rank's parameters, or their gradients, by name):
    split ones are gathered over tp and lose their padding. Collective over tp."""
    params = dict(model.named_parameters())
    out = {}
    for name, t in state.items():
        split = split_of(params[name]) if name in params else None
        if split is None or not group.active:
            out[name] = t
            continue
        chunks = t.new_empty((group.size * t.shape[0], *t.shape[1:]))
        ops.all_gather(chunks, t.contiguous(), group)
        chunks = chunks.view(group.size, *t.shape).unbind(0)
        out[name] = torch.cat(chunks, dim=split.dim).narrow(split.dim, 0, split.full)
    return out
