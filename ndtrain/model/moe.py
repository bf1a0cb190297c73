"""Mixture of experts: the feed-forward of an MoE block. A router sends each token to k of E
experts (SwiGLU MLPs); their outputs are summed with the router's weights.

    x ─► router (fp32) ─► k experts and weights per token
      └► slots sorted by expert ─► dispatch: experts on their tokens ─► back to token order
                                                                      ─► Σ_k weight·output (fp32)
      └► shared experts (every token) ───────────────────────────────────────────────────► +

Router (`model.moe_router`), in fp32 (fp64 in the fp64 proofs), from logits l = W·x:
- softmax_topk: p = softmax(l) over the E experts, the k largest, their p as weights;
- topk_softmax: the k largest logits, softmax over those k as weights;
- sigmoid: s = sigmoid(l), the k largest, their s as weights (DeepSeek-V3).
With `moe_groups` > 1 the choice is group-limited (DeepSeek-V3): the experts are split into
groups of consecutive indices, a group scores the sum of its two best (biased) scores, and
each token chooses its k among the experts of its `moe_topk_groups` best groups.
The selection may add a per-expert bias (the aux-loss-free balancing of DeepSeek-V3, updated
by the step: parallel/expert.py) that never enters the weights. `moe_norm_topk` divides the k
weights by their sum, `moe_route_scale` multiplies them. Top-k is a stable sort: ties go to
the lower expert index, on every device.

Capacity (`model.moe_capacity` = c > 0): each expert takes at most ceil(c·T·k/E) of the T·k
slots of one forward on this rank, the first ones in token order; the rest are dropped (their
output is zero, the token goes on through the residual). T is the tokens this rank routes in
one forward, so the drop depends on the micro-batch: equal to one process's with the same
`train.micro_batch`. Dropless (c = 0) is the default.

Combine: the k outputs of a token are multiplied by their weights and summed in fp32, in
slot order, so the result does not depend on where the experts ran.

Load-balancing loss (Switch/GShard form, computed per sequence): for a row of T tokens,
f_e = (slots of the row routed to e) / (k·T) and P_e = mean over its tokens of p_e, where p is
the router's distribution (the softmax; for sigmoid, s normalised to sum 1), and the row's
loss is E·Σ_e f_e·P_e (1 when perfectly balanced). Written as a sum over tokens,
Σ_t E·Σ_e f_{row(t),e}·p_te = Σ_rows T·loss_row, it takes the form of the token loss: the step
adds coefficient × it to the token-loss sum and divides both by the global target count
(DESIGN.md principle 5), so every layout computes the same objective. A row's f needs the
counts of all its tokens: `LocalTokens.row_sum` completes them where a row is split over
ranks (tensor and context parallelism swap that module).

Nothing here knows about parallelism. Three child modules are the seams the parallel code
replaces: `tokens` (which tokens this rank routes, how to complete row sums), `dispatch` (how
expert-sorted tokens reach their experts: here a call, under expert parallelism two
all-to-alls) and `experts` (all E here, E/ep under expert parallelism).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .args import ModelArgs
from .dtypes import widened

_GROUPED_MM = getattr(F, "grouped_mm", None)  # torch >= 2.9


# ---------------------------------------------------------------------------------------
# What the MoE blocks hand the training step


@dataclass
class RoutingLog:
    """Filled by the MoE blocks during the training forwards of one step.

    `aux_coef` is the load-balancing loss coefficient (train.moe_aux_loss). After each
    forward, `take_loss()` is the sum of that forward's aux losses (coefficient × the balance
    term in sum-over-tokens form), or None; the schedule adds it to the token-loss sum. Per
    block (by layer key), summed over the step: `counts[key]` slots routed to each expert
    (before any drop), `balance[key]` the balance term's sum over this rank's tokens,
    `dropped[key]` slots dropped by capacity. Recomputation runs a block again with
    `rerun()`, which does the same work and records nothing.
    """

    aux_coef: float = 0.0
    keep: bool = True
    counts: dict[str, Tensor] = field(default_factory=dict)
    balance: dict[str, Tensor] = field(default_factory=dict)
    dropped: dict[str, Tensor] = field(default_factory=dict)
    pending: list[Tensor] = field(default_factory=list)
    mtp: object = None  # multi-token prediction's step (model/mtp.MTPStep): its losses join `pending`

    def record(self, key: str, counts: Tensor, balance: Tensor, dropped: Tensor, loss: Tensor | None) -> None:
        if not self.keep:
            return
        for table, value in ((self.counts, counts), (self.balance, balance), (self.dropped, dropped)):
            value = value.detach().double()
            table[key] = table[key] + value if key in table else value
        if loss is not None:
            self.pending.append(loss)

    def take_loss(self) -> Tensor | None:
        """The aux losses of the forward just run (summed), or None; forgets them."""
        if not self.pending:
            return None
        loss, self.pending = sum(self.pending[1:], self.pending[0]), []
        return loss

    def rerun(self) -> "RoutingLog":
        return RoutingLog(self.aux_coef, keep=False)


# ---------------------------------------------------------------------------------------
# Router


@dataclass
class Routes:
    experts: Tensor  # [T, k] expert of each slot, best first
    weights: Tensor  # [T, k] combine weights (fp32, or fp64)
    probs: Tensor  # [T, E] the router's distribution over experts, for the balance loss


def top_k(scores: Tensor, k: int) -> Tensor:
    """Indices of the k largest scores per row, best first; ties to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


class Router(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.kind, self.k = args.moe_router, args.moe_top_k
        self.normalise, self.scale = args.moe_norm_topk, args.moe_route_scale
        self.groups, self.topk_groups = args.moe_groups, args.moe_topk_groups
        self.weight = nn.Parameter(torch.empty(args.moe_experts, args.dim))
        # A learned bias of the logits (gpt-oss), unlike `expert_bias`, which only steers the choice.
        self.bias = nn.Parameter(torch.empty(args.moe_experts)) if args.moe_router_bias else None
        # Added to the scores for the choice only (DeepSeek-V3); fp32, checkpointed.
        self.register_buffer("expert_bias", torch.zeros(args.moe_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> Routes:
        bias = widened(self.bias) if self.bias is not None else None
        logits = F.linear(widened(x), widened(self.weight), bias)
        if self.kind == "sigmoid":
            scores = logits.sigmoid()
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            scores = probs = logits.softmax(-1)
        if self.kind == "topk_softmax":
            experts = top_k(self._limited(logits + self.expert_bias), self.k)
            weights = logits.gather(-1, experts).softmax(-1)
        else:
            experts = top_k(self._limited(scores + self.expert_bias), self.k)
            weights = scores.gather(-1, experts)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.scale != 1.0:
            weights = weights * self.scale
        return Routes(experts, weights, probs)

    def _limited(self, choice: Tensor) -> Tensor:
        """Group-limited choice (DeepSeek-V3): the experts outside each token's
        `topk_groups` best groups set to −inf; a group scores the sum of its two best."""
        if self.groups == 1:
            return choice
        grouped = choice.view(choice.shape[0], self.groups, -1)
        best = top_k(torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1), self.topk_groups)
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


# ---------------------------------------------------------------------------------------
# Experts


class _LoopMatmul(torch.autograd.Function):
    """Rows grouped by expert times each expert's weight, one matmul per expert; one autograd
    node, so the zero-bubble split sees each weight used once."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts: list[int]) -> Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        out = x.new_empty(x.shape[0], w.shape[1])
        for g, (a, b) in enumerate(_bounds(counts)):
            if b > a:
                torch.matmul(x[a:b], w[g].t(), out=out[a:b])
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = x.new_zeros(x.shape)
            for g, (a, b) in enumerate(_bounds(ctx.counts)):
                if b > a:
                    torch.matmul(grad[a:b], w[g], out=gx[a:b])
        if ctx.needs_input_grad[1]:
            gw = torch.zeros_like(w)
            for g, (a, b) in enumerate(_bounds(ctx.counts)):
                if b > a:
                    torch.matmul(grad[a:b].t(), x[a:b], out=gw[g])
        return gx, gw, None


def _bounds(counts: list[int]):
    ends = list(itertools.accumulate(counts))
    return zip([0] + ends[:-1], ends)


def grouped(x: Tensor, w: Tensor) -> bool:
    """Whether `expert_matmul` runs one grouped GEMM (CUDA, bf16, where torch has it)."""
    aligned = x.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0  # 16-byte rows for the kernel
    return _GROUPED_MM is not None and x.is_cuda and x.dtype == torch.bfloat16 and aligned


def expert_matmul(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """x [N, in] grouped by expert (counts[g] rows for expert g; or counts [G, S], the rows of
    expert g in S consecutive groups, which this product does not tell apart) times
    w [G, out, in]ᵀ. On CUDA in bf16, one grouped GEMM where torch has it (the counts stay
    on the device); otherwise a loop over experts, which reads the counts on the host (free
    when they are a host tensor: `Experts.forward`)."""
    if counts.dim() == 2:
        counts = counts.sum(1)
    if grouped(x, w):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return _GROUPED_MM(x, w.transpose(-2, -1), offs=offs)
    return _LoopMatmul.apply(x, w, counts.tolist())


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float, alpha: float = 1.702) -> Tensor:
    """gpt-oss's gate: (clamp(up, ±limit) + 1)·g·σ(alpha·g) with g = min(gate, limit)."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


def _plus_bias(y: Tensor, bias: Tensor | None, counts: Tensor) -> Tensor:
    """y [N, out] grouped by expert (counts as `expert_matmul` takes them) + each row's
    expert's bias [n, out]."""
    if bias is None:
        return y
    per_expert = (counts.sum(1) if counts.dim() == 2 else counts).to(bias.device)
    return y + bias.repeat_interleave(per_expert, dim=0, output_size=y.shape[0]).to(y.dtype)


class Experts(nn.Module):
    """n SwiGLU MLPs, weights stacked: w1, w3 [n, hidden, dim] (gate, up), w2 [n, dim, hidden].
    `matmuls` maps each weight's name to the grouped product it runs (`expert_matmul`; a
    precision may put its own in: parallel/fp8.py). gpt-oss: biases w1_bias, w3_bias
    [n, hidden], w2_bias [n, dim] (`bias`), and the clamped SwiGLU (`limit` > 0)."""

    def __init__(self, n: int, dim: int, hidden: int, bias: bool = False, limit: float = 0.0):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.limit = limit
        if bias:
            self.w1_bias = nn.Parameter(torch.empty(n, hidden))
            self.w3_bias = nn.Parameter(torch.empty(n, hidden))
            self.w2_bias = nn.Parameter(torch.empty(n, dim))
        self.matmuls: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = dict.fromkeys(("w1", "w2", "w3"), expert_matmul)

    def forward(self, x: Tensor, counts: Tensor, host_counts: Tensor | None = None) -> Tensor:
        """x [N, dim], the rows of expert 0, then expert 1, ...: counts[g] rows each (or
        counts [n, S]: expert_matmul), on the device; `host_counts`: the same on the host,
        where the caller knows them. Unless all three products are grouped GEMMs (which take
        the counts on the device), the products read the counts on the host: they get a host
        copy, made here at most once per call."""
        mm = self.matmuls
        on_device = all(f is expert_matmul for f in mm.values()) and grouped(x, self.w1)
        if not on_device:
            counts = host_counts if host_counts is not None else counts.cpu()
        gate, up = (_plus_bias(mm[w](x, getattr(self, w), counts), getattr(self, f"{w}_bias", None), counts)
                    for w in ("w1", "w3"))
        h = clamped_swiglu(gate, up, self.limit) if self.limit else F.silu(gate) * up
        return _plus_bias(mm["w2"](h, self.w2, counts), getattr(self, "w2_bias", None), counts)


class SharedExperts(nn.Module):
    """The experts every token goes through: one SwiGLU MLP as wide as all of them."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ---------------------------------------------------------------------------------------
# The seams a layout replaces


class LocalTokens(nn.Module):
    """Which tokens this rank routes, and how per-row sums are completed. On one device: the
    whole micro-batch, nothing to complete. (Tensor parallelism routes 1/tp of the positions
    on each rank; context parallelism holds part of every row: parallel/expert.py.)"""

    def enter(self, x: Tensor) -> Tensor:
        return x

    def leave(self, y: Tensor) -> Tensor:
        return y

    def row_sum(self, t: Tensor) -> Tensor:
        """Per-row statistics [b, ...] summed over every rank holding part of the rows."""
        return t

    def loss_sum(self, loss: Tensor) -> Tensor:
        """A loss over this rank's tokens, completed over the ranks that split the
        micro-batch's tokens but compute one token loss (tensor parallelism)."""
        return loss


class LocalDispatch(nn.Module):
    """Expert-sorted tokens through the experts held here (all of them)."""

    def plan(self, counts: Tensor) -> Tensor:
        """What `forward` needs to know of the counts, started before the tokens are sorted
        (expert parallelism exchanges them with the other ranks meanwhile)."""
        return counts

    def forward(self, x: Tensor, counts: Tensor, experts: Experts,
                meanwhile: Callable[[], Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        """Returns the experts' outputs in x's order, and `meanwhile()` (work that may overlap
        the dispatch; None if not given)."""
        side = meanwhile() if meanwhile is not None else None
        return experts(x, counts), side


# ---------------------------------------------------------------------------------------
# The block


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_experts, self.k, self.capacity = args.moe_experts, args.moe_top_k, args.moe_capacity
        self.router = Router(args)
        self.experts = Experts(args.moe_experts, args.dim, args.expert_dim, args.moe_expert_bias, args.moe_swiglu_limit)
        shared = args.moe_shared_experts * args.expert_dim
        self.shared = SharedExperts(args.dim, shared) if shared else None
        self.tokens = LocalTokens()
        self.dispatch = LocalDispatch()

    def forward(self, x: Tensor, routing: RoutingLog | None = None, layer_key: str = "") -> Tensor:
        mine = self.tokens.enter(x)
        b, s, d = mine.shape
        flat = mine.reshape(b * s, d)
        routes = self.router(flat)
        slots = routes.experts.reshape(-1)  # [T·k], token-major
        counts = slots.new_zeros(self.n_experts).scatter_add_(0, slots, torch.ones_like(slots))  # no host sync
        kept = counts.clamp(max=self._capacity(slots)) if self.capacity > 0 else counts
        plan = self.dispatch.plan(kept)  # expert parallelism: the counts travel while the tokens are sorted
        order = torch.argsort(slots, stable=True)  # slots grouped by expert, token order within
        if self.capacity > 0:
            order = self._drop_over_capacity(order, slots, counts)
        # Each token once per slot (the k copies' gradients add in a fixed order), then sorted.
        x_sorted = flat.unsqueeze(1).expand(b * s, self.k, d).reshape(-1, d)[order]
        meanwhile = (lambda: self.shared(flat)) if self.shared is not None else None
        y_sorted, shared = self.dispatch(x_sorted, plan, self.experts, meanwhile)
        y_slots = y_sorted.new_zeros(slots.numel(), d).index_copy(0, order, y_sorted)
        out = (widened(y_slots).view(b * s, self.k, d) * routes.weights.unsqueeze(-1)).sum(1)
        if shared is not None:
            out = out + widened(shared)
        if routing is not None:
            self._account(routing, layer_key, routes, counts, kept, b)
        return self.tokens.leave(out.to(x.dtype).view(b, s, d))

    def _capacity(self, slots: Tensor) -> int:
        return math.ceil(self.capacity * slots.numel() / self.n_experts)

    def _drop_over_capacity(self, order: Tensor, slots: Tensor, counts: Tensor) -> Tensor:
        """Keep the first ceil(c·T·k/E) slots of each expert (in token order). Which are
        kept is data: selecting them waits for the device (a host sync per block)."""
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[slots[order]]
        return order[rank_in_expert < self._capacity(slots)]

    def _account(self, routing: RoutingLog, key: str, routes: Routes, counts: Tensor, kept: Tensor, rows: int) -> None:
        """Statistics of this forward, and the load-balancing loss (module docstring)."""
        probs = routes.probs.view(rows, -1, self.n_experts)
        per_row = probs.new_zeros(rows, self.n_experts)
        per_row.scatter_add_(1, routes.experts.reshape(rows, -1), probs.new_ones(rows, probs.shape[1] * self.k))
        per_row = self.tokens.row_sum(per_row)
        f = per_row / per_row.sum(-1, keepdim=True)
        balance = self.n_experts * (f.unsqueeze(1) * probs).sum()
        loss = None
        if routing.aux_coef > 0 and torch.is_grad_enabled():
            loss = self.tokens.loss_sum(routing.aux_coef * balance)
        routing.record(key, counts, balance, (counts - kept).sum(), loss)
