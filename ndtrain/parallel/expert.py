"""Expert parallelism, and how mixture-of-experts blocks fit every other dimension.

The experts of each MoE block (model/moe.py) are split over the `ep` ranks of an expert
group, drawn from dp_shard × cp (mesh.py): rank r of the group holds experts
[r·E/ep, (r+1)·E/ep). Each rank routes its own tokens, then:

    this rank's tokens, sorted by expert          counts [E]
      ─► all-to-all of the counts: how many rows of each of my experts every rank sends
      ─► all-to-all of the rows (variable splits)   (the shared experts run meanwhile)
      ─► rank-major → expert-major: (e0: r0 r1 …)(e1: r0 r1 …)
      ─► the local experts (a loop of matmuls on the CPU, one grouped GEMM on CUDA)
      ─► expert-major → rank-major ─► all-to-all back ─► the caller's order

Backward runs the two token all-to-alls again in reverse (autograd). Everything else is the
model's own code: routing, capacity and the fp32 token-order combine happen on the rank the
token lives on, so the result is the single-device one, bit for bit up to the order of
matmul rows.

Bytes. Let s_ij be the slots rank i sends to rank j in one forward of one block (row of D
values, b bytes each). Rank i sends Σ_{j≠i} s_ij rows in the dispatch and Σ_{j≠i} s_ji rows
in the combine, and backward sends as many again, so per block and step

    A2A_i = 2·b·D·(Σ_{j≠i} s_ij + Σ_{j≠i} s_ji) + 8·(E − E/ep)   bytes,

the last term being the int64 count exchange (forward only). With T tokens per rank,
top-k and uniform routing s_ij = T·k/ep, which gives 4·T·k·D·(ep−1)/ep values per block: the
research note's figure (tests/test_expert.py checks both forms).

Gradients and states. Expert weights carry `mark_expert` (placement.py), plus shard dim
"ep" under expert parallelism. Their gradients are summed over `edp` (the ranks holding the
same experts: dp_replicate × edp_shard), with the same scaling as dense gradients (the loss
is already divided by the global target count); ZeRO shards their states over
`edp_shard`. The global gradient norm counts each expert once through those marks. With
ep = 1, `edp` is `dp_cp` and `edp_shard` is `dp_shard_cp`.

Tensor parallelism does not split experts: each tp rank routes 1/tp of the positions (the
ones it holds under SP; otherwise its slice, gathered back after), and the MoE weights'
gradients are partial over tp (tensor.py marks them). Per-row statistics (the balance
loss's f) are completed over tp and cp (`SplitTokens.row_sum`), and the balance loss of a
tp rank's tokens is summed over tp, since every tp rank computes the same token loss.

`LoadBalance` reduces the step's routing statistics over every rank and applies the
aux-loss-free bias update (DeepSeek-V3): bias_e += rate·sign(mean load − load_e), the load
being the slots routed to e in the whole global batch, so every layout updates alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ndtrain.comm import ops
from ndtrain.deferred import Lazy
from ndtrain.mesh import Group, ParallelMesh
from ndtrain.model.args import ModelArgs
from ndtrain.model.moe import Experts, LocalDispatch, LocalTokens, MoE, RoutingLog
from ndtrain.parallel.placement import copy_placement, expert_slice, mark_expert, mark_region, mark_sharded
from ndtrain.parallel.tensor import ReduceFromTP, gather_sequence


def moe_blocks(model: nn.Module) -> list[tuple[int, MoE]]:
    """(global layer index, MoE) of every MoE block the module holds."""
    return [(int(name.split(".")[-2]), m) for name, m in model.named_modules()
            if isinstance(m, MoE) and not name.startswith("mtp.")]  # an MTP block's: model/mtp.py


# ---------------------------------------------------------------------------------------
# Tokens split over tensor (and context) parallel ranks


class _TakePositions(torch.autograd.Function):
    """This tp rank's 1/tp of the positions of a tensor every tp rank holds whole; backward
    gathers the slices' gradients, so each rank gets the whole gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        s = x.shape[1] // group.size
        return x.narrow(1, group.rank * s, s).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return gather_sequence(grad, ctx.group), None


class _GatherPositions(torch.autograd.Function):
    """Every tp rank's positions, gathered; backward keeps this rank's slice (the gradient
    of the gathered tensor is the same on every rank)."""

    @staticmethod
    def forward(ctx, y: Tensor, group: Group) -> Tensor:
        ctx.group, ctx.s = group, y.shape[1]
        return gather_sequence(y, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.narrow(1, ctx.group.rank * ctx.s, ctx.s).contiguous(), None


class SplitTokens(LocalTokens):
    """Tokens of a micro-batch split over tp (and cp): see the module docstring."""

    def __init__(self, tp: Group, sp: bool, row_groups: list[Group]):
        super().__init__()
        self.tp, self.sp, self.row_groups = tp, sp, row_groups

    def _slices(self) -> bool:
        return self.tp.active and not self.sp

    def enter(self, x: Tensor) -> Tensor:
        return _TakePositions.apply(x, self.tp) if self._slices() else x

    def leave(self, y: Tensor) -> Tensor:
        return _GatherPositions.apply(y, self.tp) if self._slices() else y

    def row_sum(self, t: Tensor) -> Tensor:
        for g in self.row_groups:
            ops.all_reduce(t, g)
        return t

    def loss_sum(self, loss: Tensor) -> Tensor:
        return ReduceFromTP.apply(loss, self.tp) if self.tp.active else loss


# ---------------------------------------------------------------------------------------
# The all-to-all dispatch


@dataclass
class A2AMeter:
    """What one block's all-to-alls cost this rank since the last reset."""

    wire: float = 0.0  # bytes sent to other ranks
    seconds: float = 0.0  # time spent launching and waiting

    def reset(self) -> None:
        self.wire, self.seconds = 0.0, 0.0


@dataclass
class _InFlight:
    """An all-to-all of rows started outside autograd; `_Exchange` adopts its result."""

    group: Group
    meter: A2AMeter
    recv_splits: list[int]
    send_splits: list[int]
    out: Tensor = field(init=False)
    inp: Tensor | None = field(init=False, default=None)
    work: object = field(init=False)

    def start(self, x: Tensor) -> "_InFlight":
        t0 = time.perf_counter()
        self.out = x.new_empty((sum(self.recv_splits), *x.shape[1:]))
        # The input stays referenced until `wait`: the caching allocator must not hand its
        # memory to another tensor while the collective still reads it on its own stream.
        self.inp = x.detach().contiguous()
        self.work = ops.all_to_all(self.out, self.inp, self.group, self.recv_splits, self.send_splits, async_op=True)
        self.meter.wire += ops.all_to_all_wire(x, self.group, self.send_splits)
        self.meter.seconds += time.perf_counter() - t0
        return self

    def wait(self) -> Tensor:
        t0 = time.perf_counter()
        self.work.wait()
        self.inp = None
        self.meter.seconds += time.perf_counter() - t0
        return self.out

    def reversed(self) -> "_InFlight":
        return _InFlight(self.group, self.meter, self.send_splits, self.recv_splits)


class _Exchange(torch.autograd.Function):
    """Forward: the rows an in-flight all-to-all of x brought. Backward: the gradients sent
    back the way they came."""

    @staticmethod
    def forward(ctx, x: Tensor, flight: _InFlight) -> Tensor:
        ctx.flight = flight
        return flight.wait()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.flight.reversed().start(grad).wait(), None


def exchange(x: Tensor, group: Group, meter: A2AMeter, recv_splits: list[int], send_splits: list[int]) -> Tensor:
    """Differentiable all-to-all of rows: send_splits[r] rows of x to rank r."""
    return _Exchange.apply(x, _InFlight(group, meter, recv_splits, send_splits).start(x))


def expert_major(from_ranks: Tensor, total: int) -> Tensor:
    """The permutation that takes rows received rank-major (rank r's rows for each of my
    experts in turn: from_ranks[r, e] of them, `total` in all) to expert-major order. The
    sizes of the outputs are given, so nothing here waits for the device."""
    ep, local = from_ranks.shape
    sizes = from_ranks.flatten()
    starts = torch.cumsum(sizes, 0) - sizes  # of block (r, e) in the received buffer
    sizes_em, starts_em = sizes.view(ep, local).t().flatten(), starts.view(ep, local).t().flatten()
    block_start = torch.repeat_interleave(starts_em, sizes_em, output_size=total)
    ends_em = torch.cumsum(sizes_em, 0)
    within = torch.arange(total, device=sizes.device) - torch.repeat_interleave(ends_em - sizes_em, sizes_em,
                                                                                 output_size=total)
    return block_start + within


@dataclass
class _Counts:
    """The expert counts of one forward on their way to the other ranks (`plan`)."""

    mine: Tensor  # [E] slots this rank sends to each expert
    theirs: Tensor  # [ep · E/ep] slots each rank sends to each of my experts, once `work` is done
    work: object


class AllToAllDispatch(LocalDispatch):
    """Expert-sorted tokens to the ranks that hold their experts and back (module docstring)."""

    def __init__(self, group: Group, n_experts: int):
        super().__init__()
        self.group, self.local = group, n_experts // group.size
        self.meter = A2AMeter()

    def plan(self, counts: Tensor) -> _Counts:
        """Start exchanging the counts (asynchronous: it overlaps the sorting of the tokens)."""
        t0 = time.perf_counter()
        theirs = torch.empty_like(counts)
        work = ops.all_to_all(theirs, counts, self.group, async_op=True)
        self.meter.wire += ops.all_to_all_wire(counts, self.group, None)
        self.meter.seconds += time.perf_counter() - t0
        return _Counts(counts, theirs, work)

    def forward(self, x: Tensor, plan: _Counts, experts: Experts, meanwhile=None):
        g, ep, local = self.group, self.group.size, self.local
        t0 = time.perf_counter()
        plan.work.wait()
        self.meter.seconds += time.perf_counter() - t0
        from_ranks = plan.theirs.view(ep, local)
        # The one host sync of an expert-parallel block: the all-to-all's split sizes.
        host = torch.cat([plan.mine.view(ep, local).sum(1), plan.theirs]).tolist()
        send, table = host[:ep], [host[ep + r * local: ep + (r + 1) * local] for r in range(ep)]
        recv = [sum(row) for row in table]
        flight = _InFlight(g, self.meter, recv, send).start(x)
        side = meanwhile() if meanwhile is not None else None  # overlaps the all-to-all
        received = _Exchange.apply(x, flight)
        order = expert_major(from_ranks, sum(recv))
        by_source = torch.tensor(table, dtype=from_ranks.dtype).t()  # the same counts, on the host
        y = experts(received[order], from_ranks.t(), by_source)  # rows of each expert, by source rank
        y = y.new_zeros(y.shape).index_copy(0, order, y)  # back to rank-major
        return exchange(y, g, self.meter, send, recv), side


# ---------------------------------------------------------------------------------------
# Building a layout's MoE blocks


def parallelize(model: nn.Module, mesh: ParallelMesh, sp: bool) -> None:
    """In place, for every MoE block of `model` (a decoder or a pipeline chunk, after tensor
    parallelism's swaps, usually on the meta device): the token split over tp and cp, the
    experts this rank holds, the all-to-all dispatch, and the placement marks of the expert
    weights."""
    tp, cp, ep = mesh.group("tp"), mesh.group("cp"), mesh.group("ep")
    mtp = [m for name, m in model.named_modules() if isinstance(m, MoE) and name.startswith("mtp.")]  # model/mtp.py
    for moe in [m for _, m in moe_blocks(model)] + mtp:
        if tp.active or cp.active:
            moe.tokens = SplitTokens(tp, sp, [g for g in (tp, cp) if g.active])
        n = moe.n_experts
        first = ep.rank * (n // ep.size)
        if ep.active:
            _keep_local_experts(moe, ep)
            moe.dispatch = AllToAllDispatch(ep, n)
        for p in moe.experts.parameters():
            mark_expert(p, first, n)
            if ep.active:  # a slice of the stack of all experts, for the gradient norm and checkpoints
                mark_sharded(p, ("ep",))
                mark_region(p, (n, *p.shape[1:]), (first,) + (0,) * (p.ndim - 1))


@torch.no_grad()
def _keep_local_experts(moe: MoE, ep: Group) -> None:
    """Replace the stacked expert weights by this rank's E/ep experts: on the meta device
    (parallel/construct.py then gives them their slice of the full initial value), or the
    slice of the weights the block holds."""
    per = moe.n_experts // ep.size
    lo = ep.rank * per
    for name, old in list(moe.experts.named_parameters()):
        data = old.new_empty((per, *old.shape[1:])) if old.is_meta else old.detach()[lo:lo + per].clone()
        setattr(moe.experts, name, copy_placement(old, nn.Parameter(data)))


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """The routers' biases of a model built on the meta device: zeros on `device`."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):  # an MTP block's too
        bias = moe.router.expert_bias
        if bias.is_meta:
            moe.router.expert_bias = torch.zeros(bias.shape, dtype=bias.dtype, device=device)


def expert_params(params) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) parameters, each once."""
    unique = list({id(p): p for p in params}.values())
    return [p for p in unique if expert_slice(p) is None], [p for p in unique if expert_slice(p) is not None]


@torch.no_grad()
def gather_experts(model: nn.Module, state: dict[str, Tensor] | None, mesh: ParallelMesh) -> dict | None:
    """`state` (whole over the edp_shard group on its rank 0) with every expert weight
    gathered over ep. Collective over the ep groups of the edp_shard-rank-0 ranks, which are
    the ranks that hold such a state."""
    ep = mesh.group("ep")
    if not ep.active or mesh.coord("edp_shard") != 0:
        return state
    for name, p in model.named_parameters():
        if expert_slice(p) is None or name not in state:  # not an expert's, or frozen (no gradient)
            continue
        local = state[name].contiguous()
        full = local.new_empty((ep.size * local.shape[0], *local.shape[1:]))
        ops.all_gather(full, local, ep)
        state[name] = full
    return state


# ---------------------------------------------------------------------------------------
# Step statistics and the bias update


class LoadBalance:
    """The routing statistics of a step, reduced over every rank, and the aux-loss-free
    bias update. One table row per MoE block of the model (all stages), columns: slots per
    expert, the balance term's token sum, slots dropped, all-to-all bytes and seconds."""

    def __init__(self, model: nn.Module, args: ModelArgs, mesh: ParallelMesh, aux_coef: float, bias_rate: float):
        self.mesh, self.args, self.aux_coef, self.rate = mesh, args, aux_coef, bias_rate
        self.rows = {layer: i for i, layer in enumerate(args.moe_layers)}
        if args.mtp_depth and args.is_moe_layer(args.n_layers - 1):  # the MTP blocks' statistics (model/mtp.py)
            self.rows.update({f"mtp.{d}": len(self.rows) + d - 1 for d in range(1, args.mtp_depth + 1)})
        self.blocks = dict(moe_blocks(model))
        self.counts: Tensor | None = None
        self.stats: dict | None = None

    def log(self) -> RoutingLog:
        return RoutingLog(self.aux_coef)

    def reduce(self, routing: RoutingLog, n_targets: float | Tensor) -> Lazy:
        """Sum this step's statistics over every rank (collective) and keep them: the loads on
        the device for the bias update, the summary as a `Lazy` read with the step's record
        (no host sync here)."""
        e = self.args.moe_experts
        table = torch.zeros(len(self.rows), e + 4, dtype=torch.float64, device=self.mesh.device)
        for key, counts in routing.counts.items():
            row = self.rows[int(key) if key.isdigit() else key]
            table[row, :e] = counts
            table[row, e] = routing.balance[key]
            table[row, e + 1] = routing.dropped[key]
        for layer, moe in self.blocks.items():
            meter = getattr(moe.dispatch, "meter", None)
            if meter is not None:  # host numbers: filled in, not copied
                table[self.rows[layer], e + 2] = meter.wire
                table[self.rows[layer], e + 3] = meter.seconds
                meter.reset()
        for name in ("dp_cp", "tp", "pp"):  # counts are partial over dp, cp and tp; stages disjoint
            ops.all_reduce(table, self.mesh.group(name))
        self.counts = table[:, :e]
        if not isinstance(n_targets, Tensor):
            n_targets = torch.full((), float(n_targets), dtype=torch.float64, device=table.device)
        self.stats = Lazy(self._summary, (table, n_targets))
        return self.stats

    def _summary(self, table: Tensor, n_targets: Tensor) -> dict:
        e = self.args.moe_experts
        counts = table[:, :e]
        mean = counts.mean(1)
        out = {"layers": list(self.rows),
               "tokens_per_expert": counts.round().long().tolist(),
               "max_violation": (counts.max(1).values / mean.clamp_min(1e-12) - 1).tolist(),
               "dead_fraction": (counts == 0).double().mean(1).tolist(),
               "aux_loss": (table[:, e] / n_targets).tolist()}
        if self.args.moe_capacity > 0:
            out["dropped_fraction"] = (table[:, e + 1] / counts.sum(1).clamp_min(1)).tolist()
        if self.mesh.shape.ep > 1:  # per rank: the mean over the ranks holding each block
            ranks = self.mesh.world // self.mesh.shape.pp
            out["a2a_bytes"] = (table[:, e + 2] / ranks).tolist()
            out["a2a_seconds"] = (table[:, e + 3] / ranks).tolist()
        return out

    @torch.no_grad()
    def update_bias(self) -> None:
        """bias_e += rate·sign(mean load − load_e) with this step's global loads."""
        if self.rate <= 0 or self.counts is None:
            return
        for layer, moe in self.blocks.items():
            load = self.counts[self.rows[layer]]
            moe.router.expert_bias += self.rate * torch.sign(load.mean() - load).to(moe.router.expert_bias)
