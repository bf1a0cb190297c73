"""Static checks of an action list before it runs: every message has a partner, both ends of
a link agree on the order of its messages, and no rank can wait forever.

Deadlock is checked under the strictest semantics a backend may have: a group of messages
(consecutive message actions, posted together) completes only when every partner has posted
the matching message (rendezvous, as NCCL does for large messages). Gloo, which buffers
sends, can only do better. Compute actions never block: their inputs were received before.
"""

from __future__ import annotations

from collections import defaultdict

from ndtrain.parallel.pipeline.schedules import (B, COMPUTE, F, MESSAGES, RECV_B, RECV_F, SEND_B, SEND_F, W,
                                                 Action, peer)


class ScheduleError(AssertionError):
    pass


def groups(actions: list[Action]) -> list[list[Action]]:
    """Runs of consecutive messages; each compute action is a group of its own."""
    out: list[list[Action]] = []
    for a in actions:
        if a.kind in MESSAGES and out and out[-1][0].kind in MESSAGES:
            out[-1].append(a)
        else:
            out.append([a])
    return out


def _links(schedule: list[list[Action]], pp: int) -> dict:
    """For each directed link (src, dst): the sends on src and the receives on dst, in order."""
    links: dict[tuple[int, int], dict[str, list]] = defaultdict(lambda: {"send": [], "recv": []})
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.kind in (SEND_F, SEND_B):
                links[(r, peer(a, pp))]["send"].append(a)
            elif a.kind in (RECV_F, RECV_B):
                links[(peer(a, pp), r)]["recv"].append(a)
    return links


def _message_id(a: Action) -> tuple:
    """What travels: the activation entering chunk c+1 is what chunk c sent."""
    if a.kind == SEND_F:
        return ("act", a.chunk + 1, a.micro)
    if a.kind == RECV_F:
        return ("act", a.chunk, a.micro)
    if a.kind == SEND_B:
        return ("grad", a.chunk - 1, a.micro)
    return ("grad", a.chunk, a.micro)  # RECV_B: the gradient of chunk c's output


def check_work(schedule: list[list[Action]], pp: int, v: int, m: int, *, train: bool = True) -> None:
    """Every (chunk, micro) is computed exactly once per kind, on the rank that owns it."""
    n = pp * v
    kinds = (F, B) if train else (F,)
    seen = defaultdict(int)
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.kind in COMPUTE:
                if a.chunk % pp != r:
                    raise ScheduleError(f"rank {r} runs {a}, which belongs to rank {a.chunk % pp}")
                seen[(a.kind, a.chunk, a.micro)] += 1
    for kind in kinds:
        for c in range(n):
            for i in range(m):
                if seen[(kind, c, i)] != 1:
                    raise ScheduleError(f"{kind}{i}.c{c} runs {seen[(kind, c, i)]} times")
    has_w = any(k == W for k, _, _ in seen)
    if has_w and any(seen[(W, c, i)] != 1 for c in range(n) for i in range(m)):
        raise ScheduleError("a schedule with W actions must run W once per backward")
    for r, actions in enumerate(schedule):
        position = {(a.kind, a.chunk, a.micro): k for k, a in enumerate(actions)}
        for (kind, c, i), k in position.items():
            if kind == B and not position[(F, c, i)] < k:
                raise ScheduleError(f"rank {r}: B{i}.c{c} before its forward")
            if kind == W and not position[(B, c, i)] < k:
                raise ScheduleError(f"rank {r}: W{i}.c{c} before its B")


def check_links(schedule: list[list[Action]], pp: int) -> dict:
    """Both ends of each link list the same messages in the same order; returns the pairing
    {(rank, index in its list): (peer rank, index in the peer's list)}."""
    index = {}
    for r, actions in enumerate(schedule):
        for k, a in enumerate(actions):
            index[(r, a)] = k
    partner = {}
    for (src, dst), link in _links(schedule, pp).items():
        sends, recvs = link["send"], link["recv"]
        if [_message_id(a) for a in sends] != [_message_id(a) for a in recvs]:
            for s, q in zip(sends + [None] * len(recvs), recvs + [None] * len(sends)):
                if s is None or q is None or _message_id(s) != _message_id(q):
                    raise ScheduleError(f"link {src}→{dst}: rank {src} sends {s} where rank {dst} "
                                        f"expects {q}")
        for s, q in zip(sends, recvs):
            partner[(src, index[(src, s)])] = (dst, index[(dst, q)])
            partner[(dst, index[(dst, q)])] = (src, index[(src, s)])
    return partner


def check_deadlock_free(schedule: list[list[Action]], pp: int) -> None:
    """Run the lists under rendezvous semantics; raise if the ranks can get stuck."""
    partner = check_links(schedule, pp)
    per_rank = [groups(actions) for actions in schedule]
    # position of each action index inside the rank's groups
    group_of = []
    for gs in per_rank:
        where, k = {}, 0
        for g_index, g in enumerate(gs):
            for _ in g:
                where[k] = g_index
                k += 1
        group_of.append(where)
    starts = [[sum(len(g) for g in gs[:j]) for j in range(len(gs))] for gs in per_rank]
    at = [0] * len(schedule)
    matched: set[tuple[int, int]] = set()
    while True:
        progress = False
        for r, gs in enumerate(per_rank):
            while at[r] < len(gs):
                g = gs[at[r]]
                if g[0].kind in COMPUTE:
                    at[r] += 1
                    progress = True
                    continue
                first = starts[r][at[r]]
                waiting = False
                for k in range(first, first + len(g)):
                    if (r, k) in matched:
                        continue
                    q, qk = partner[(r, k)]
                    if at[q] < len(per_rank[q]) and group_of[q][qk] == at[q]:
                        matched.update({(r, k), (q, qk)})
                        progress = True
                    else:
                        waiting = True
                if waiting:
                    break
                at[r] += 1
                progress = True
        if all(at[r] == len(gs) for r, gs in enumerate(per_rank)):
            return
        if not progress:
            stuck = {r: [str(a) for a in per_rank[r][at[r]]] for r in range(len(per_rank)) if at[r] < len(per_rank[r])}
            raise ScheduleError(f"the schedule can deadlock: ranks wait at {stuck}")


def verify(schedule: list[list[Action]], pp: int, v: int, m: int, *, train: bool = True) -> None:
    check_work(schedule, pp, v, m, train=train)
    check_deadlock_free(schedule, pp)


def simulate(schedule: list[list[Action]], pp: int, cost) -> list[list[tuple[Action, float, float]]]:
    """The timeline the lists would give with compute costs `cost` and free, buffered
    messages: [(action, start, end)] per rank, compute actions only. `cost` is a dict
    kind -> cost, or a function (rank, action) -> cost (e.g. measured durations)."""
    cost_of = cost if callable(cost) else (lambda rank, a: cost[a.kind])
    partner = check_links(schedule, pp)
    sent_at: dict[tuple[int, int], float] = {}  # (rank, index of send) -> when it was posted
    at, clock = [0] * len(schedule), [0.0] * len(schedule)
    out: list[list[tuple[Action, float, float]]] = [[] for _ in schedule]
    while any(at[r] < len(a) for r, a in enumerate(schedule)):
        progress = False
        for r, actions in enumerate(schedule):
            while at[r] < len(actions):
                a = actions[at[r]]
                if a.kind in (SEND_F, SEND_B):
                    sent_at[(r, at[r])] = clock[r]
                elif a.kind in (RECV_F, RECV_B):
                    src = partner[(r, at[r])]
                    if src not in sent_at:
                        break
                    clock[r] = max(clock[r], sent_at[src])
                else:
                    start, clock[r] = clock[r], clock[r] + cost_of(r, a)
                    out[r].append((a, start, clock[r]))
                at[r] += 1
                progress = True
        if not progress:
            raise ScheduleError("the schedule can deadlock even with buffered sends")
    return out


def bubble(timeline: list[list[tuple[object, float, float]]]) -> float:
    """Idle over busy time, averaged over ranks, in the span of the whole step."""
    start = min(t[1] for rank in timeline for t in rank)
    end = max(t[2] for rank in timeline for t in rank)
    ratios = []
    for rank in timeline:
        busy = sum(t[2] - t[1] for t in rank)
        ratios.append((end - start - busy) / busy)
    return sum(ratios) / len(ratios)
