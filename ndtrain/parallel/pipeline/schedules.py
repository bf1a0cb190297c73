"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs.

An action is a forward (F), an input-gradient backward (B), a weight-gradient backward (W),
or a message: send/receive of an activation (forward direction) or of a gradient (backward
direction). One executor (executor.py) runs any such list, so a schedule is only the order.
Without W actions, B is the whole backward; with them (zero bubble), B computes only what
the previous stage is waiting for and W the weight gradients, later, where there was a bubble.

Compute orders come first, in ticks (one function per schedule). `with_messages` then puts
between two ticks one group of messages: the sends of what the tick before produced and the
receives of what the tick after consumes. The executor posts a group at once (one NCCL group),
so two ranks that send to each other at the same moment cannot wait for each other. A tick is
one action, except in the steady phase of interleaved 1F1B, where a forward and a backward
share one, as in Megatron: around the ring of chunks, anything finer can deadlock. verify.py
proves for each list we run that it cannot deadlock even if every message waits for its
partner (rendezvous), and that both ends of every link see their messages in the same order.

Schedules (p stages, m micro-batches, v chunks per rank):
- afab: GPipe. All forwards, then all backwards; holds m micro-batches' activations.
  Bubble (p−1)/m of the compute time.
- 1f1b: PipeDream-Flush. p−1−r warm-up forwards on rank r, then one forward one backward;
  at most p micro-batches in flight. Same bubble, less memory.
- interleaved: Megatron's interleaved 1F1B over v chunks per rank, forwards in groups of p
  micro-batches per chunk; bubble (p−1)/(v·m); needs m to be a multiple of p.
- zb: zero bubble with the peak memory of 1F1B (ZB-H1, Qi et al. 2023): backward split into
  B and W; rank r runs its W's r backwards late, so they fill the cool-down where 1F1B waits.
  Bubble (p−1)(F+B−W)/(m(F+B+W)), (p−1)/(3m) when the three cost the same: a third of 1F1B's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.parallel.pipeline.partition import local_chunks, owner

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "send_F", "recv_F", "send_B", "recv_B"
COMPUTE = (F, B, W)
MESSAGES = (SEND_F, RECV_F, SEND_B, RECV_B)
SCHEDULES = ("afab", "1f1b", "interleaved", "zb")


@dataclass(frozen=True)
class Action:
    kind: str
    chunk: int
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}.c{self.chunk}"


Ticks = list[list[Action]]  # one rank's compute actions, in ticks (see `with_messages`)


def _single(order: list[Action]) -> Ticks:
    return [[a] for a in order]


def afab(pp: int, m: int) -> list[Ticks]:
    return [_single([Action(F, r, i) for i in range(m)] + [Action(B, r, i) for i in range(m)]) for r in range(pp)]


def one_f_one_b(pp: int, m: int) -> list[Ticks]:
    orders = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        order = [Action(F, r, i) for i in range(warmup)]
        for k in range(m - warmup):
            order += [Action(F, r, warmup + k), Action(B, r, k)]
        order += [Action(B, r, k) for k in range(m - warmup, m)]
        orders.append(_single(order))
    return orders


def interleaved(pp: int, v: int, m: int) -> list[Ticks]:
    """Megatron's order. The k-th forward of a rank is micro-batch (k // (p·v))·p + k % p on
    its local chunk (k // p) % v; backwards walk the local chunks in reverse. In the steady
    phase a forward and a backward form one tick: their four messages travel as one group."""
    if m % pp:
        raise ValueError(f"interleaved 1F1B needs the micro-batch count ({m}) to be a multiple of pp ({pp})")
    total = m * v

    def micro(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    orders = []
    for r in range(pp):
        chunks = local_chunks(r, pp, v)

        def fwd(k: int) -> Action:
            return Action(F, chunks[(k // pp) % v], micro(k))

        def bwd(k: int) -> Action:
            return Action(B, chunks[v - 1 - (k // pp) % v], micro(k))

        # With m == p the steady phase would make neighbours wait on each other: warm up fully.
        warmup = total if m == pp else min((pp - 1 - r) * 2 + (v - 1) * pp, total)
        ticks = [[fwd(k)] for k in range(warmup)]
        ticks += [[fwd(warmup + k), bwd(k)] for k in range(total - warmup)]
        ticks += [[bwd(k)] for k in range(total - warmup, total)]
        orders.append(ticks)
    return orders


def zero_bubble_h1(pp: int, m: int) -> list[Ticks]:
    """1F1B with each backward split into B and W, and rank r's W running r backwards late:
    the W's that 1F1B would have run early fill the cool-down, where 1F1B waits. Rank r then
    holds at most (p−r−1) + 1 + r = p micro-batches, the peak of 1F1B."""
    orders = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        order = [Action(F, r, i) for i in range(warmup)]
        pending: list[int] = []

        def backward(i: int) -> list[Action]:
            pending.append(i)
            return [Action(B, r, i)] + ([Action(W, r, pending.pop(0))] if len(pending) > r else [])

        for k in range(m - warmup):
            order += [Action(F, r, warmup + k)] + backward(k)
        for k in range(m - warmup, m):
            order += backward(k)
        order += [Action(W, r, i) for i in pending]
        orders.append(_single(order))
    return orders


def compute_orders(name: str, pp: int, v: int, m: int) -> list[Ticks]:
    if name == "afab":
        return afab(pp, m)
    if name == "1f1b":
        return one_f_one_b(pp, m)
    if name == "interleaved":
        return interleaved(pp, v, m)
    if name == "zb":
        return zero_bubble_h1(pp, m)
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def _receives(a: Action, n_chunks: int) -> list[Action]:
    if a.kind == F and a.chunk > 0:
        return [Action(RECV_F, a.chunk, a.micro)]
    if a.kind == B and a.chunk < n_chunks - 1:
        return [Action(RECV_B, a.chunk, a.micro)]
    return []


def _sends(a: Action, n_chunks: int) -> list[Action]:
    if a.kind == F and a.chunk < n_chunks - 1:
        return [Action(SEND_F, a.chunk, a.micro)]
    if a.kind == B and a.chunk > 0:
        return [Action(SEND_B, a.chunk, a.micro)]
    return []


def with_messages(orders: list[Ticks], n_chunks: int) -> list[list[Action]]:
    """Between two ticks, one group of messages: what the tick before produced and what the
    tick after consumes. A tick is usually one action; the executor posts each group at once."""
    out = []
    for ticks in orders:
        actions: list[Action] = []
        sends: list[Action] = []
        for tick in ticks:
            actions += sends + [r for a in tick for r in _receives(a, n_chunks)]
            actions += tick
            sends = [s for a in tick for s in _sends(a, n_chunks)]
        out.append(actions + sends)
    return out


def forward_only(orders: list[Ticks]) -> list[Ticks]:
    """Evaluation: the schedule's forwards in the same order, nothing else."""
    return [[[a] for tick in ticks for a in tick if a.kind == F] for ticks in orders]


def build_schedule(name: str, pp: int, v: int, m: int, *, train: bool = True) -> list[list[Action]]:
    """The full action list of every pipeline rank (compute and messages)."""
    orders = compute_orders(name, pp, v, m)
    if not train:
        orders = forward_only(orders)
    return with_messages(orders, pp * v)


def peer(action: Action, pp: int) -> int:
    """The pipeline rank at the other end of a message."""
    if action.kind in (SEND_F, RECV_B):
        return owner(action.chunk + 1, pp)
    return owner(action.chunk - 1, pp)


def theory_bubble(name: str, pp: int, v: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """Idle over busy time per rank for equal stages and free messages. `f, b, w`: the costs of
    a forward, an input-gradient and a weight-gradient backward (zb only)."""
    if name == "interleaved":
        return (pp - 1) / (v * m)
    if name == "zb":
        return (pp - 1) * max(f + b - w, 0.0) / (m * (f + b + w))
    return (pp - 1) / m
