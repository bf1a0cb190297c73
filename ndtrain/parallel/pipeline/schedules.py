"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs.

An action is a forward (F), an input-gradient backward (B), a weight-gradient backward (W),
or a message: send/receive of an activation (forward direction) or of a gradient (backward
direction). One executor (executor.py) runs any such list, so a schedule is only the order.
Without W actions, B is the whole backward; with them (zero bubble), B computes only what
the previous stage is waiting for and W the weight gradients, later, where there was a bubble.

Compute orders come first, in ticks (one function per schedule). `lists.with_messages` then puts
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
- zbv: ZB-V (Qi et al. 2024), two chunks per rank placed in a V (partition.py): rank r holds
  chunks r and 2p−1−r, so the first and last chunk (and the loss) are on rank 0 and the turn
  between the legs costs no message. Warm-up forwards fill the time the first micro-batch
  takes to come back, then each forward is followed by its chunk's B and W.
- dualpipev: DeepSeek's DualPipe cut in half (DualPipeV): the same V, and in the steady phase
  overlapped pairs, a forward of one chunk with a backward of the other (an F&B action, whose
  hook can hide one's communication behind the other's compute); most backwards whole, the
  last ones split so their W's fill the cool-down. Bubble (p−1)(F&B + B − 3W) in time, with B
  a whole backward (DualPipe's table, its PP = 2p stages); needs m ≥ 2p.

An overlapped F&B is a tick of two actions, a forward then a backward (interleaved 1F1B's
steady phase has them too): `lists.with_messages` turns it into one FB action, which the executor
runs through its overlap hook. Whether a B is whole or only the input gradient is read from
the list: it is split where a W of the same micro-batch and chunk follows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.parallel.pipeline.partition import local_chunks, owner

F, B, W, FB = "F", "B", "W", "FB"  # FB: a forward and a backward overlapped
SEND_F, RECV_F, SEND_B, RECV_B = "send_F", "recv_F", "send_B", "recv_B"
COMPUTE = (F, B, W, FB)
MESSAGES = (SEND_F, RECV_F, SEND_B, RECV_B)
SCHEDULES = ("afab", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
VSHAPE = ("zbv", "dualpipev")  # two chunks per rank, placed in a V


def vshape(name: str) -> bool:
    return name in VSHAPE


@dataclass(frozen=True)
class Action:
    kind: str
    chunk: int
    micro: int
    pair: "Action | None" = None  # FB: the backward that runs with this forward

    def __str__(self) -> str:
        if self.kind == FB:
            return f"F{self.micro}.c{self.chunk}&{self.pair}"
        return f"{self.kind}{self.micro}.c{self.chunk}"


def parts(a: Action) -> tuple[Action, ...]:
    """The compute actions an action runs: an F&B's forward and backward, or itself."""
    return (Action(F, a.chunk, a.micro), a.pair) if a.kind == FB else (a,)


Ticks = list[list[Action]]  # one rank's compute actions, in ticks (see `lists.with_messages`)


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


class _VRank:
    """One rank's two chunks of a V and what it has emitted of each: the building blocks of
    zbv and dualpipev. `down` is chunk r (activations going down the ranks), `up` chunk
    2p−1−r. Each emitter is a no-op once its chunk has run all m micro-batches."""

    def __init__(self, r: int, pp: int, m: int):
        self.down, self.up, self.m = r, 2 * pp - 1 - r, m
        self.f = {self.down: 0, self.up: 0}
        self.b = {self.down: 0, self.up: 0}
        self.split: list[Action] = []  # backwards split into B and W, whose W is still due
        self.ticks: Ticks = []

    def forward(self, c: int) -> Action | None:
        if self.f[c] == self.m:
            return None
        self.f[c] += 1
        return Action(F, c, self.f[c] - 1)

    def backward(self, c: int, split: bool) -> Action | None:
        if self.b[c] == self.m or self.b[c] == self.f[c]:
            return None
        self.b[c] += 1
        a = Action(B, c, self.b[c] - 1)
        if split:
            self.split.append(a)
        return a

    def weight(self) -> Action | None:
        return Action(W, self.split[0].chunk, self.split.pop(0).micro) if self.split else None

    def emit(self, *actions: Action | None) -> None:
        """Each action a tick of its own."""
        self.ticks += [[a] for a in actions if a is not None]

    def overlapped(self, fwd: Action | None, bwd: Action | None) -> None:
        """A forward and a backward as one F&B tick (one alone if the other is done)."""
        both = [a for a in (fwd, bwd) if a is not None]
        if both:
            self.ticks.append(both)


def zbv(pp: int, m: int) -> list[Ticks]:
    """ZB-V. Rank r first runs the 2(p−r)−1 forwards of its down chunk that fit before the
    first micro-batch comes back up to it, then r forwards on each chunk in turn, then
    p−r rounds of (up forward, its B and W) while the first backwards start; in the steady
    phase each forward is followed by a B and a W of the same chunk. In the cool-down the
    B's go first (the previous rank waits for them) and the W's fill the gaps; memory peaks
    at about 2p chunk-micro-batches, the activations of p whole ones: 1F1B's."""
    orders = []
    for r in range(pp):
        k = _VRank(r, pp, m)
        k.emit(*(k.forward(k.down) for _ in range(2 * (pp - r) - 1)))
        for _ in range(r):
            k.emit(k.forward(k.up), k.forward(k.down))
        for _ in range(pp - r):
            k.emit(k.forward(k.up), k.backward(k.up, True), k.weight())
        while k.f[k.up] < m or k.f[k.down] < m:
            k.emit(k.forward(k.down), k.backward(k.down, True), k.weight(),
                   k.forward(k.up), k.backward(k.up, True), k.weight())
        for _ in range(r):
            k.emit(k.backward(k.up, True), k.backward(k.down, True), k.weight())
        while k.b[k.down] < m:
            k.emit(k.backward(k.down, True), k.weight())
        while k.split:
            k.emit(k.weight())
        orders.append(k.ticks)
    return orders


def dualpipev(pp: int, m: int) -> list[Ticks]:
    """DualPipeV on rank r of p (m ≥ 2p). Warm-up: 2(p−r−1) down forwards, r+1 pairs of a
    down and an up forward, p−r−1 rounds of (up B, its W, up forward). Steady: m−2p+r+1
    rounds of two overlapped F&B: (down F & up B), (up F & down B). Cool-down: p−r−1 rounds
    of (up B, then up F & down B), r+1 of (up B, down B), p−r−1 of (W, down B), r+1 W's.
    The backwards of the warm-up's rounds and the last p of the rank are split (B now, W
    later: they fill the cool-down), every other one is whole."""
    if m < 2 * pp:
        raise ValueError(f"dualpipev needs at least 2 × pp = {2 * pp} micro-batches (got {m})")
    orders = []
    for r in range(pp):
        k = _VRank(r, pp, m)
        k.emit(*(k.forward(k.down) for _ in range(2 * (pp - r - 1))))
        for _ in range(r + 1):
            k.emit(k.forward(k.down), k.forward(k.up))
        for _ in range(pp - r - 1):
            k.emit(k.backward(k.up, True), k.weight(), k.forward(k.up))
        for _ in range(m - 2 * pp + r + 1):
            k.overlapped(k.forward(k.down), k.backward(k.up, False))
            k.overlapped(k.forward(k.up), k.backward(k.down, False))
        for _ in range(pp - r - 1):
            k.emit(k.backward(k.up, False))
            k.overlapped(k.forward(k.up), k.backward(k.down, False))
        # the last p backwards of the rank are split: r+1 pairs (up, down), p−r−1 downs
        tail = 2 * (r + 1) + (pp - r - 1)
        for i in range(r + 1):
            k.emit(k.backward(k.up, 2 * i >= tail - pp), k.backward(k.down, 2 * i + 1 >= tail - pp))
        for _ in range(pp - r - 1):
            k.emit(k.weight(), k.backward(k.down, True))
        while k.split:
            k.emit(k.weight())
        orders.append(k.ticks)
    return orders


ORDERS = {"afab": lambda pp, v, m: afab(pp, m), "1f1b": lambda pp, v, m: one_f_one_b(pp, m),
          "interleaved": interleaved, "zb": lambda pp, v, m: zero_bubble_h1(pp, m),
          "zbv": lambda pp, v, m: zbv(pp, m), "dualpipev": lambda pp, v, m: dualpipev(pp, m)}


def compute_orders(name: str, pp: int, v: int, m: int) -> list[Ticks]:
    if name not in ORDERS:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return ORDERS[name](pp, v, m)


def forward_only(orders: list[Ticks]) -> list[Ticks]:
    """Evaluation: the schedule's forwards in the same order, nothing else."""
    return [[[a] for tick in ticks for a in tick if a.kind == F] for ticks in orders]


def peer(action: Action, pp: int, v_shape: bool = False) -> int:
    """The pipeline rank at the other end of a message."""
    if action.kind in (SEND_F, RECV_B):
        return owner(action.chunk + 1, pp, v_shape)
    return owner(action.chunk - 1, pp, v_shape)


def message_id(a: Action) -> tuple:
    """What travels: the activation entering chunk c+1 is what chunk c sent; the gradient of
    chunk c−1's output is what chunk c's backward sent."""
    if a.kind == SEND_F:
        return ("act", a.chunk + 1, a.micro)
    if a.kind == RECV_F:
        return ("act", a.chunk, a.micro)
    if a.kind == SEND_B:
        return ("grad", a.chunk - 1, a.micro)
    return ("grad", a.chunk, a.micro)  # RECV_B: the gradient of chunk c's output
