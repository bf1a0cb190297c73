"""Muon's whole matrices on any layout: each matrix meets on one owning rank, which runs the
Newton–Schulz iteration once and hands every holder its part of the result.

What the optimizer updates is split many ways: a ZeRO flat slice holds a range of several
parameters, a tensor-parallel shard holds rows or columns of one, a routed-expert stack holds
some experts, each its own matrix; replicas (dp, an HSDP replica, cp without ZeRO) hold equal
copies. This module only reads what `states.optim_slices()` says each holder holds
(placement.OptimSlice) and where that local parameter sits in the global one
(`placement.region_of`, `expert_slice`): no dimension is known by name, so every layout,
pipeline stages included, goes through the same two all-to-alls.

Set-up (once, collective over the stage group, `mesh.stage_group()`): every rank shares the
description of its pieces; each rank then computes the same plan:
- the matrices: (parameter name, expert) with their global shape (A, B);
- an owner for each, balanced by the iteration's cost (cubic in the smaller dimension:
  `ns_flops`), largest first to the least loaded rank, a rank that holds more of the
  matrix winning a tie (fewer bytes to move);
- for every element of a matrix, who sends it to the owner: nobody when the owner holds it,
  else the lowest rank that holds it (a replicated element crosses the wire once).

Each step (`orthogonalize`): the holders' inputs (momentum, Nesterov-mixed) go to the owners
in one all-to-all (none where nothing moves in: plain DP); each owner assembles its matrices
whole, runs `ns` on each, and sends every holder its elements of the result in a second
all-to-all, asynchronous: the caller's other work (AdamW, the weight decay) and the owner's
own parts run while it travels. Bytes per rank: at most its
share of the matrices in, its holdings out — an all-gather's worth, where Megatron's
layer-wise owners broadcast whole matrices and DeepSpeed gathers every matrix on every
holder. docs/architecture.md, "Muon", compares them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ndtrain.comm import ops
from ndtrain.comm.group import Group
from ndtrain.model.args import ModelArgs
from ndtrain.parallel.placement import OptimSlice, region_of


@dataclass(frozen=True)
class PieceInfo:
    """One OptimSlice as every rank sees it: elements [start, stop) of a local tensor of
    `local` shape that sits at `offsets` in the global tensor `name` of `shape`; `holder`
    and `at`: which of the rank's optimizer tensors holds them, from which element."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local: tuple[int, ...]
    start: int
    stop: int
    holder: int
    at: int


def describe(slices: list[OptimSlice], holders: list[torch.Tensor]) -> list[PieceInfo]:
    index = {id(h): i for i, h in enumerate(holders)}
    out = []
    for s in slices:
        r = region_of(s.param)
        out.append(PieceInfo(s.name, r.shape, r.offsets, tuple(s.param.shape), s.start, s.stop, index[id(s.holder)], s.at))
    return out


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix Muon sees: a parameter's last two dimensions (an expert stack's leading
    one counts experts)."""
    return shape[-2], shape[-1]


def ns_flops(a: int, b: int, steps: int) -> float:
    """Multiply-adds ×2 of `steps` Newton–Schulz iterations on an a×b matrix (m = min, n =
    max): X·Xᵀ (2m²n), the quintic's G·G (2m³) and its product with X (2m²n) per step."""
    m, n = min(a, b), max(a, b)
    return float(steps * (4 * m * m * n + 2 * m ** 3))


def piece_elements(p: PieceInfo) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions within the holder, matrix index (the expert; 0 for a plain matrix),
    element index within that matrix) of the piece's elements that lie inside the global
    tensor (a tensor-parallel shard may reach past it: padding)."""
    i = torch.arange(p.start, p.stop)
    keep = torch.ones_like(i, dtype=torch.bool)
    flat = torch.zeros_like(i)
    rest = i
    coords = []
    for n in reversed(p.local):
        coords.append(rest % n)
        rest = rest // n
    for c, off, size in zip(reversed(coords), p.offsets, p.shape):
        g = c + off
        keep &= g < size
        flat = flat * size + g
    a, b = matrix_shape(p.shape)
    positions = (i - p.start + p.at)[keep]
    flat = flat[keep]
    return positions, flat // (a * b), flat % (a * b)


def as_run(index: torch.Tensor) -> torch.Tensor | slice:
    """`index` as a slice when it is one run of consecutive elements, else as it is."""
    n = index.numel()
    if n and int(index[-1]) - int(index[0]) == n - 1 and (n == 1 or bool((index.diff() == 1).all())):
        return slice(int(index[0]), int(index[0]) + n)
    return index


def count(index: torch.Tensor | slice) -> int:
    return index.stop - index.start if isinstance(index, slice) else index.numel()


@dataclass
class Part:
    """A run of one holder's elements and where they go in one matrix."""

    holder: int
    positions: torch.Tensor
    index: torch.Tensor


class MatrixOwners:
    """The plan for this rank (see the module docstring) and the step's two all-to-alls.
    `holders`: the optimizer tensors Muon updates on this rank, in a fixed order; `slices`:
    what they hold (states.optim_slices() of those holders)."""

    def __init__(self, holders: list[torch.Tensor], slices: list[OptimSlice], group: Group, ns_steps: int):
        self.holders, self.group = holders, group
        self.spans = holder_spans(holders, slices)  # each holder's runs: (at, n, matrix shape)
        mine = describe(slices, holders)
        everyone = [mine]
        if group.active:
            everyone = [None] * group.size
            dist.all_gather_object(everyone, mine, group=group.pg)
        me, n = group.rank, group.size
        # Every matrix, in one order on every rank: (name, expert) -> (A, B).
        shapes: dict[tuple[str, int], tuple[int, int]] = {}
        pieces: dict[tuple[str, int], list[tuple[int, Part]]] = {}
        for rank, infos in enumerate(everyone):
            for info in infos:
                positions, matrix, index = piece_elements(info)
                for e in matrix.unique().tolist():
                    key = (info.name, e)
                    shapes[key] = matrix_shape(info.shape)
                    sel = matrix == e
                    pieces.setdefault(key, []).append((rank, Part(info.holder, positions[sel], index[sel])))
        self.matrices = sorted(shapes)
        self.shapes = shapes
        # Owners: the largest iterations first, each to the least loaded rank.
        self.load = [0.0] * n
        self.owner: dict[tuple[str, int], int] = {}
        held = {key: [0] * n for key in self.matrices}
        for key, parts in pieces.items():
            for rank, part in parts:
                held[key][rank] += part.index.numel()
        for key in sorted(self.matrices, key=lambda k: (-ns_flops(*shapes[k], ns_steps), k)):
            o = min(range(n), key=lambda r: (self.load[r], -held[key][r], r))
            self.owner[key] = o
            self.load[o] += ns_flops(*shapes[key], ns_steps)
        # What moves: to each owner, the elements it lacks, from their lowest-ranked holder;
        # from each owner, every holder's elements of the result.
        self.send_in = [[] for _ in range(n)]   # parts of mine that I send to owner r
        self.recv_in = [[] for _ in range(n)]   # (matrix, index) arriving from rank r
        self.send_out = [[] for _ in range(n)]  # (matrix, index) I send back to holder r
        self.recv_out = [[] for _ in range(n)]  # parts of mine that arrive from owner r
        self.recv_out_keys = [[] for _ in range(n)]  # the matrix of each
        self.moves_in = self.moves_out = False  # whether anything moves, on any rank of the group
        self.own: dict[tuple[str, int], list[Part]] = {}  # the owner's own parts of its matrices
        for key in self.matrices:
            o, parts = self.owner[key], pieces.get(key, [])
            a, b = shapes[key]
            covered = torch.zeros(a * b, dtype=torch.bool)
            for rank, part in parts:
                if rank == o:
                    covered[part.index] = True
            if o == me:
                self.own[key] = [part for rank, part in parts if rank == me]
            for rank, part in sorted(parts, key=lambda rp: rp[0]):
                if rank == o:
                    continue
                new = ~covered[part.index]
                covered[part.index[new]] = True
                sent = Part(part.holder, part.positions[new], part.index[new])
                self.moves_in |= bool(sent.index.numel())
                self.moves_out = True
                if rank == me and sent.index.numel():
                    self.send_in[o].append(sent)
                if o == me and sent.index.numel():
                    self.recv_in[rank].append((key, sent.index))
                if rank == me:
                    self.recv_out[o].append(part)
                    self.recv_out_keys[o].append(key)
                if o == me:
                    self.send_out[rank].append((key, part.index))
            if o == me:
                assert bool(covered.all()), f"muon: no rank holds all of {key}"
        if holders and holders[0].device.type != "cpu":  # the step's index copies stay on the device
            self._to(holders[0].device)
        self._runs()
        self._sizes = self.sizes()
        self.moves_in &= group.active
        self.moves_out &= group.active
        self.needed = self._needed()

    def _needed(self) -> list[bool]:
        """The holders whose input the step needs here: those with parts this rank owns or sends."""
        needed = [False] * len(self.holders)
        for p in [p for parts in self.own.values() for p in parts] + [p for parts in self.send_in for p in parts]:
            needed[p.holder] = True
        return needed

    def _runs(self) -> None:
        """Each index set that is one run of consecutive elements becomes a slice: the step
        then copies views, not gathers (under plain DP every matrix is one run of its holder)."""
        run = lambda p: Part(p.holder, as_run(p.positions), as_run(p.index))  # noqa: E731
        self.send_in = [[run(p) for p in parts] for parts in self.send_in]
        self.recv_out = [[run(p) for p in parts] for parts in self.recv_out]
        self.own = {key: [run(p) for p in parts] for key, parts in self.own.items()}
        self.recv_in = [[(k, as_run(i)) for k, i in items] for items in self.recv_in]
        self.send_out = [[(k, as_run(i)) for k, i in items] for items in self.send_out]

    def _to(self, device) -> None:
        move = lambda p: Part(p.holder, p.positions.to(device), p.index.to(device))  # noqa: E731
        self.send_in = [[move(p) for p in parts] for parts in self.send_in]
        self.recv_out = [[move(p) for p in parts] for parts in self.recv_out]
        self.own = {key: [move(p) for p in parts] for key, parts in self.own.items()}
        self.recv_in = [[(k, i.to(device)) for k, i in items] for items in self.recv_in]
        self.send_out = [[(k, i.to(device)) for k, i in items] for items in self.send_out]

    def sizes(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """Elements per rank of the group: sent to owners, received as owner, sent back as
        owner, received back (fixed by the plan)."""
        def parts(xs):
            return sum(count(p.index) for p in xs)

        def pairs(xs):
            return sum(count(i) for _, i in xs)
        return ([parts(x) for x in self.send_in], [pairs(x) for x in self.recv_in],
                [pairs(x) for x in self.send_out], [parts(x) for x in self.recv_out])

    def _start(self, send: torch.Tensor, out_sizes: list[int], in_sizes: list[int], dtype, device):
        """One all-to-all, in flight on return (`.wait()` the handle)."""
        out = torch.empty(sum(out_sizes), dtype=dtype, device=device)
        work = ops.all_to_all(out, send, self.group, out_sizes, in_sizes, async_op=True)
        return work, out.split(out_sizes)

    @torch.no_grad()
    def orthogonalize(self, inputs: list[torch.Tensor | None], ns: Callable[[torch.Tensor], torch.Tensor],
                      apply: Callable, during: Callable[[], None] = lambda: None) -> None:
        """`inputs[i]`: what Muon orthogonalises, shaped as `holders[i]` (None where
        `needed[i]` is False: this rank neither owns nor sends any of it). Hands every holder
        its part of ns(whole matrix) as `apply(i, positions, values, (A, B))`: `values` go to
        elements `positions` of holder i's flat view (a slice, or an index), and are the
        matrix's A×B result itself where the holder holds it whole. `during()` runs while the
        results travel back (the caller's other work: AdamW, the weight decay); the owner's
        own parts are applied then too, before the received ones."""
        flat = [x.reshape(-1) if x is not None else None for x in inputs]
        h = self.holders[0]
        dtype, device = h.dtype, h.device
        send_in, recv_in, send_out, recv_out = self._sizes
        whole: dict[tuple[str, int], torch.Tensor] = {}
        for key, parts in self.own.items():
            a, b = self.shapes[key]
            if len(parts) == 1 and count(parts[0].index) == a * b and isinstance(parts[0].positions, slice):
                whole[key] = flat[parts[0].holder][parts[0].positions]  # held whole here: a view (ns copies)
                continue
            m = torch.empty(a * b, dtype=dtype, device=device)  # every element is written: own parts and arrivals
            for p in parts:
                m[p.index] = flat[p.holder][p.positions]
            whole[key] = m
        result: dict[tuple[str, int], torch.Tensor] = {}
        if self.moves_in:  # the owners' missing elements, from their holders
            pieces = [flat[p.holder][p.positions] for parts in self.send_in for p in parts]
            send = torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype, device=device)
            work, arrived = self._start(send, recv_in, send_in, dtype, device)
            arriving = {key for items in self.recv_in for key, _ in items}
            for key, m in whole.items():  # the matrices that wait for nothing, while the others' parts travel
                if key not in arriving:
                    result[key] = ns(m.view(self.shapes[key])).to(dtype)
            work.wait()
            for r, data in enumerate(arrived):
                at = 0
                for key, index in self.recv_in[r]:
                    whole[key][index] = data[at:at + count(index)]
                    at += count(index)
        for key, m in whole.items():
            if key not in result:
                result[key] = ns(m.view(self.shapes[key])).to(dtype)
        flat_result: dict[tuple[str, int], torch.Tensor] = {}

        def part_of(key, index):  # the result's elements `index`, 2-D when all of it
            r = result[key]
            if isinstance(index, slice) and index.start == 0 and index.stop == r.numel():
                return r
            if key not in flat_result:
                flat_result[key] = r.reshape(-1)
            return flat_result[key][index]
        if self.moves_out:  # every holder's elements of the results, from their owners
            send = torch.empty(sum(send_out), dtype=dtype, device=device)
            at = 0
            for items in self.send_out:
                for key, index in items:
                    n = count(index)
                    send[at:at + n].view(part_of(key, index).shape).copy_(part_of(key, index))
                    at += n
            work, back = self._start(send, recv_out, send_out, dtype, device)
        during()
        for key, parts in self.own.items():
            for p in parts:
                apply(p.holder, p.positions, part_of(key, p.index), self.shapes[key])
        if self.moves_out:
            work.wait()
            for r, data in enumerate(back):
                at = 0
                for p, key in zip(self.recv_out[r], self.recv_out_keys[r]):
                    apply(p.holder, p.positions, data[at:at + count(p.index)], self.shapes[key])
                    at += count(p.index)

    def bytes_per_step(self, element_size: int) -> int:
        """Bytes this rank sends per step (both all-to-alls)."""
        send_in, _, send_out, _ = self.sizes()
        mine = self.group.rank
        return element_size * (sum(send_in) - send_in[mine] + sum(send_out) - send_out[mine])


def holder_spans(holders: list[torch.Tensor], slices: list[OptimSlice]) -> list[list[tuple[int, int, tuple[int, int]]]]:
    """For each holder, its runs of elements (at, n, matrix shape), one per OptimSlice: the
    learning-rate adjustment depends on the matrix's shape."""
    index = {id(h): i for i, h in enumerate(holders)}
    out = [[] for _ in holders]
    for s in slices:
        out[index[id(s.holder)]].append((s.at, s.stop - s.start, matrix_shape(region_of(s.param).shape)))
    return out


# -- what it costs, by formula (the planner, train --dry-run) ----------------------------------
# The owners' traffic per rank, for a pipeline stage of N ranks whose Muon matrices hold Ψ
# elements and a rank that holds h of them (its TP shards, its ZeRO slices, its experts): the
# owner of a matrix receives what it does not hold, (Ψ/N)(1 − h/Ψ) on average, and returns
# every holder its elements, h(1 − 1/N): h + Ψ/N − 2h/N elements sent per rank. Plain DP
# (h = Ψ): Ψ(1 − 1/N), an all-gather's worth; ZeRO-3 over N (h = Ψ/N): at most 2Ψ/N(1 − 1/N),
# less where the owner holds a matrix whole (the owner choice prefers that).

def muon_matrices(args: ModelArgs, layers=None) -> list[tuple[int, int]]:
    """(A, B) of every matrix Muon orthogonalises in `layers` (default: every block): q, k, v,
    o; the MLP's gate, up, down, or each routed expert's three and the shared experts'."""
    h, q, kv = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    out = []
    for layer in range(args.n_layers) if layers is None else layers:
        out += [(q, h), (kv, h), (kv, h), (h, q)]
        if args.is_moe_layer(layer):
            d = args.expert_dim
            out += [(d, h), (d, h), (h, d)] * args.moe_experts
            s = args.moe_shared_experts * d
            out += [(s, h), (s, h), (h, s)] if s else []
        else:
            out += [(args.ffn_dim, h), (args.ffn_dim, h), (h, args.ffn_dim)]
    return out


def muon_costs(args: ModelArgs, world: int, pp: int, held: float, ns_steps: int, element_bytes: int) -> dict:
    """Per rank and step, on average over a balanced stage: Newton–Schulz FLOPs, bytes sent by
    the owners' two all-to-alls (`held`: Muon elements this rank holds), Muon's elements."""
    mats = muon_matrices(args)
    psi = sum(a * b for a, b in mats) / pp
    n = world // pp
    return {"matrices": len(mats), "ns_flops": sum(ns_flops(a, b, ns_steps) for a, b in mats) / world,
            "bytes": element_bytes * (held + psi / n - 2 * held / n) if n > 1 else 0.0, "psi_stage": psi}
