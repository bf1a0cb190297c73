"""Static checks of an action list before it runs: every message has a partner, both ends of
a link agree on the order of its messages, and no rank can wait forever.

Deadlock is checked under the strictest semantics a backend may have: a group of messages
(consecutive message actions, posted together) completes only when every partner has posted
the matching message (rendezvous, as NCCL does for large messages). Gloo, which buffers
sends, can only do better. Compute actions never block: their inputs were received before.
"""

from __future__ import annotations

from collections import defaultdict

from ndtrain.parallel.pipeline.partition import owner
from ndtrain.parallel.pipeline.schedules import (B, COMPUTE, F, MESSAGES, RECV_B, RECV_F, SEND_B, SEND_F, W,
                                                 Action, parts, peer)
from ndtrain.parallel.pipeline.schedules import message_id as _message_id


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


def _links(schedule: list[list[Action]], pp: int, v_shape: bool) -> dict:
    """For each directed link (src, dst): the sends on src and the receives on dst, in order."""
    links: dict[tuple[int, int], dict[str, list]] = defaultdict(lambda: {"send": [], "recv": []})
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.kind in (SEND_F, SEND_B):
                links[(r, peer(a, pp, v_shape))]["send"].append(a)
            elif a.kind in (RECV_F, RECV_B):
                links[(peer(a, pp, v_shape), r)]["recv"].append(a)
    return links


def check_work(schedule: list[list[Action]], pp: int, v: int, m: int, *, train: bool = True,
               v_shape: bool = False) -> None:
    """Every (chunk, micro) is computed exactly once per kind, on the rank that owns it, and
    after what it needs from its own rank (a neighbouring chunk there: no message)."""
    n = pp * v
    kinds = (F, B) if train else (F,)
    seen = defaultdict(int)
    for r, actions in enumerate(schedule):
        for a in (p for a in actions if a.kind in COMPUTE for p in parts(a)):
            if owner(a.chunk, pp, v_shape) != r:
                raise ScheduleError(f"rank {r} runs {a}, which belongs to rank {owner(a.chunk, pp, v_shape)}")
            seen[(a.kind, a.chunk, a.micro)] += 1
    for kind in kinds:
        for c in range(n):
            for i in range(m):
                if seen[(kind, c, i)] != 1:
                    raise ScheduleError(f"{kind}{i}.c{c} runs {seen[(kind, c, i)]} times")
    if any(seen[(W, c, i)] > 1 for c in range(n) for i in range(m)):
        raise ScheduleError("a split backward runs its W once")
    for r, actions in enumerate(schedule):
        position = {}
        for k, a in enumerate(actions):  # an F&B's forward runs before its backward
            for j, p in enumerate(parts(a)):
                position[(p.kind, p.chunk, p.micro)] = k + j / 2
        for (kind, c, i), k in position.items():
            if kind == B and not position[(F, c, i)] < k:
                raise ScheduleError(f"rank {r}: B{i}.c{c} before its forward")
            if kind == W and not position[(B, c, i)] < k:
                raise ScheduleError(f"rank {r}: W{i}.c{c} before its B")
            local = {F: (F, c - 1), B: (B, c + 1)}.get(kind)
            if local and 0 <= local[1] < n and owner(local[1], pp, v_shape) == r:
                if not position.get((local[0], local[1], i), k) < k:
                    raise ScheduleError(f"rank {r}: {kind}{i}.c{c} before {local[0]}{i}.c{local[1]}, its input")


def check_links(schedule: list[list[Action]], pp: int, v_shape: bool = False) -> dict:
    """Both ends of each link list the same messages in the same order; returns the pairing
    {(rank, index in its list): (peer rank, index in the peer's list)}."""
    index = {}
    for r, actions in enumerate(schedule):
        for k, a in enumerate(actions):
            index[(r, a)] = k
    partner = {}
    for (src, dst), link in _links(schedule, pp, v_shape).items():
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


def check_deadlock_free(schedule: list[list[Action]], pp: int, v_shape: bool = False) -> None:
    """Run the lists under rendezvous semantics; raise if the ranks can get stuck."""
    check_links(schedule, pp, v_shape)
    _rendezvous(schedule, pp, v_shape, repair=False)


def receive_in_time(schedule: list[list[Action]], pp: int, v_shape: bool = False) -> list[list[Action]]:
    """The lists with receives posted early enough for rendezvous: where the lists would get
    stuck with a rank sending to a neighbour that has not yet posted the receive, that
    receive moves into the neighbour's group it waits at (its buffer then waits for its
    consumer). Only receives move, each to where its link's order still holds, so a
    compute order that runs with buffered sends runs with rendezvous too."""
    check_links(schedule, pp, v_shape)
    return _rendezvous(schedule, pp, v_shape, repair=True)


def _rendezvous(schedule: list[list[Action]], pp: int, v_shape: bool, repair: bool) -> list[list[Action]]:
    """The lists run group by group: a rank passes a message group once each of its
    messages met its partner, which happens when both ranks are at the groups holding them."""
    per_rank = [groups(actions) for actions in schedule]
    at = [0] * len(schedule)
    matched: set[tuple] = set()  # message ids
    while True:
        progress = False
        for r, gs in enumerate(per_rank):
            while at[r] < len(gs):
                g = gs[at[r]]
                if g[0].kind in COMPUTE:
                    at[r] += 1
                    progress = True
                    continue
                waiting = False
                for a in g:
                    key = _message_id(a)
                    if key in matched:
                        continue
                    q = peer(a, pp, v_shape)
                    if at[q] < len(per_rank[q]) and any(_message_id(x) == key for x in per_rank[q][at[q]]
                                                          if x.kind in MESSAGES):
                        matched.add(key)
                        progress = True
                    else:
                        waiting = True
                if waiting:
                    break
                at[r] += 1
                progress = True
        if all(at[r] == len(gs) for r, gs in enumerate(per_rank)):
            return [[a for g in gs for a in g] for gs in per_rank]
        if not progress and not (repair and _hoist_receives(per_rank, at, matched, pp, v_shape)):
            stuck = {r: [str(a) for a in per_rank[r][at[r]]] for r in range(len(per_rank)) if at[r] < len(per_rank[r])}
            raise ScheduleError(f"the schedule can deadlock: ranks wait at {stuck}")


def _hoist_receives(per_rank: list[list[list[Action]]], at: list[int], matched: set, pp: int, v_shape: bool) -> bool:
    """For each send a stuck rank waits on: move its receive into the group the receiver
    waits at. Returns whether anything moved."""
    moved = False
    for r, gs in enumerate(per_rank):
        if at[r] == len(gs):
            continue
        for a in gs[at[r]]:
            if a.kind not in (SEND_F, SEND_B) or _message_id(a) in matched:
                continue
            q = peer(a, pp, v_shape)
            if at[q] == len(per_rank[q]) or per_rank[q][at[q]][0].kind not in MESSAGES:
                continue
            for j in range(at[q] + 1, len(per_rank[q])):
                hit = [x for x in per_rank[q][j] if x.kind in (RECV_F, RECV_B) and _message_id(x) == _message_id(a)]
                if hit:
                    per_rank[q][j].remove(hit[0])
                    per_rank[q][at[q]].append(hit[0])
                    if not per_rank[q][j]:
                        del per_rank[q][j]
                    moved = True
                    break
    return moved


def verify(schedule: list[list[Action]], pp: int, v: int, m: int, *, train: bool = True,
           v_shape: bool = False) -> None:
    check_work(schedule, pp, v, m, train=train, v_shape=v_shape)
    check_deadlock_free(schedule, pp, v_shape)
