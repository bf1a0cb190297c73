"""The schedule simulator: what a step of any schedule's action lists takes, given what each
action costs.

`simulate(lists, f, b, w, p2p)` runs every rank's list (lists.build_schedule: compute
actions and messages) on a clock of its own, the way the executor runs it:
- F costs `f`, B `b`, W `w` of its chunk (a number for every chunk, or one per chunk); a B
  whose micro-batch has no W on that rank is the whole backward and costs `b + w`; an
  overlapped F&B costs its forward plus its backward (`overlap` to model it otherwise,
  e.g. as the longer of the two when communication hides behind the other's compute);
- a message leaves when the action that produced it ends and arrives `p2p` later (seconds
  per message, or a function of the message); the action that reads it waits for the
  arrival, a send never waits (buffered, as gloo and the executor's deferred waits give);
- a rank starts at 0 and runs its list in order.

It returns the step time (the last action's end) and the bubble: idle over busy time per
rank, averaged over the ranks, within the step (Megatron's t_bubble / t_ideal; `bubble`).
`timeline` gives every compute action's (action, start, end) on every rank, the material of
the trace's replay (observe/trace.py) and of the planner's pipeline step time.

Messages are paired by what they carry (the activation entering chunk c of micro-batch i,
or the gradient of chunk c's output), so the lists alone suffice: no placement needed.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

from ndtrain.parallel.pipeline.schedules import (B, F, FB, MESSAGES, RECV_B, RECV_F, SEND_B, SEND_F, W, Action,
                                                 message_id, parts)

Cost = float | Sequence[float]


class Deadlock(RuntimeError):
    pass


def _per_chunk(x: Cost) -> Callable[[int], float]:
    if isinstance(x, (int, float)):
        return lambda c: float(x)
    return lambda c: float(x[c])


def action_costs(f: Cost, b: Cost, w: Cost, overlap: Callable[[float, float], float] | None = None,
                 defer: bool = False):
    """`cost(rank_actions)` → a function (action) → seconds for one rank's list: the rule of
    the module docstring. `defer`: as the executor runs them, a split backward whose input
    gradient nobody reads before its W (`lists.deferred`) costs nothing at B and B + W at W."""
    from ndtrain.parallel.pipeline.lists import deferred
    fc, bc, wc = _per_chunk(f), _per_chunk(b), _per_chunk(w)
    together = overlap or (lambda fwd, bwd: fwd + bwd)

    def for_rank(actions: list[Action]) -> Callable[[Action], float]:
        split = {(a.chunk, a.micro) for a in actions if a.kind == W}
        late = deferred(actions) if defer else set()

        def backward(a: Action) -> float:
            if (a.chunk, a.micro) in late:
                return 0.0
            return bc(a.chunk) + (0.0 if (a.chunk, a.micro) in split else wc(a.chunk))

        def cost(a: Action) -> float:
            if a.kind == F:
                return fc(a.chunk)
            if a.kind == B:
                return backward(a)
            if a.kind == W:
                return wc(a.chunk) + (bc(a.chunk) if (a.chunk, a.micro) in late else 0.0)
            fwd, bwd = parts(a)
            return together(fc(fwd.chunk), backward(bwd))
        return cost
    return for_rank


def _consumes(a: Action) -> list[tuple]:
    """The messages a compute action may read: its forward's input activation, its
    backward's output gradient."""
    ids = []
    for p in parts(a):
        if p.kind == F:
            ids.append(("act", p.chunk, p.micro))
        elif p.kind == B:
            ids.append(("grad", p.chunk, p.micro))
    return ids


def timeline(lists: list[list[Action]], cost, p2p: float | Callable[[Action], float] = 0.0, post: float = 0.0
             ) -> list[list[tuple[Action, float, float]]]:
    """[(compute action, start, end)] per rank; `cost(rank, action)` → seconds. A receive
    is posted where the list has it; the action that reads the message waits for it.
    `post`: the seconds a rank spends posting one group of messages."""
    hop = p2p if callable(p2p) else (lambda a: float(p2p))
    received = [{message_id(a) for a in actions if a.kind in (RECV_F, RECV_B)} for actions in lists]
    arrives: dict[tuple, float] = {}
    at, clock = [0] * len(lists), [0.0] * len(lists)
    out: list[list[tuple[Action, float, float]]] = [[] for _ in lists]
    while any(at[r] < len(a) for r, a in enumerate(lists)):
        progress = False
        for r, actions in enumerate(lists):
            while at[r] < len(actions):
                a = actions[at[r]]
                if post and a.kind in MESSAGES and (at[r] == 0 or actions[at[r] - 1].kind not in MESSAGES):
                    clock[r] += post  # the first message of a group
                if a.kind in (SEND_F, SEND_B):  # posted when the action before it ended
                    arrives[message_id(a)] = clock[r] + hop(a)
                elif a.kind not in (RECV_F, RECV_B):
                    needs = [k for k in _consumes(a) if k in received[r]]
                    if any(k not in arrives for k in needs):
                        break
                    start = max([clock[r]] + [arrives[k] for k in needs])
                    clock[r] = start + cost(r, a)
                    out[r].append((a, start, clock[r]))
                at[r] += 1
                progress = True
        if not progress:
            stuck = {r: str(lists[r][at[r]]) for r in range(len(lists)) if at[r] < len(lists[r])}
            raise Deadlock(f"the lists wait forever even with buffered sends: ranks wait at {stuck}")
    return out


def bubble(ranks: list[list[tuple[object, float, float]]]) -> float:
    """Idle over busy time, averaged over ranks, in the span of the whole step."""
    start = min(t[1] for rank in ranks for t in rank)
    end = max(t[2] for rank in ranks for t in rank)
    ratios = []
    for rank in ranks:
        busy = sum(t[2] - t[1] for t in rank)
        ratios.append((end - start - busy) / busy)
    return sum(ratios) / len(ratios)


def simulate(lists: list[list[Action]], f: Cost, b: Cost, w: Cost = 0.0,
             p2p: float | Callable[[Action], float] = 0.0,
             overlap: Callable[[float, float], float] | None = None, post: float = 0.0,
             defer: bool = False) -> tuple[float, float]:
    """(step time, bubble) of the schedule `lists` (one list per pipeline rank, as
    `build_schedule` gives them) with per-chunk costs f, b, w (seconds; a number, or a
    sequence indexed by chunk), `p2p` seconds per message and `post` seconds of a rank's
    time per group of messages it posts; `defer`: the executor's deferred backwards (see
    `action_costs`), for predicting what it runs rather than the schedule's theory."""
    rule = action_costs(f, b, w, overlap, defer)
    per_rank = [rule(actions) for actions in lists]
    ranks = timeline(lists, lambda r, a: per_rank[r](a), p2p, post)
    end = max(t[2] for rank in ranks for t in rank)
    return end, bubble(ranks)


def compute_parts(ranks: list[list[tuple[Action, float, float]]],
                  forward: Callable[[int, Action], float] | None = None) -> list[list[tuple[Action, float, float]]]:
    """An overlapped F&B as its two parts, the forward first, for pictures and counts.
    `forward(rank, action)`: the forward half's seconds (default: half the pair)."""
    out = []
    for r, rank in enumerate(ranks):
        events = []
        for a, s, e in rank:
            if a.kind == FB:
                fwd, bwd = parts(a)
                mid = s + (forward(r, fwd) if forward else (e - s) / 2)
                events += [(fwd, s, mid), (bwd, mid, e)]
            else:
                events.append((a, s, e))
        out.append(events)
    return out


@functools.lru_cache(maxsize=256)
def _lists(name: str, pp: int, v: int, m: int) -> tuple:
    from ndtrain.parallel.pipeline.lists import build_schedule
    return tuple(tuple(rank) for rank in build_schedule(name, pp, v, m))


def schedule_time(name: str, pp: int, v: int, m: int, f: Cost, b: Cost, w: Cost = 0.0,
                  p2p: float | Callable[[Action], float] = 0.0,
                  overlap: Callable[[float, float], float] | None = None, post: float = 0.0,
                  defer: bool = False) -> tuple[float, float]:
    """`simulate` of the named schedule's lists (built once per shape): what the planner
    calls for a layout's pipeline, with its modelled per-chunk costs."""
    return simulate([list(rank) for rank in _lists(name, pp, v, m)], f, b, w, p2p, overlap, post, defer)


def theory_bubble(name: str, pp: int, v: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """Idle over busy time per rank for equal stages and free messages. `f, b, w`: the costs of
    a forward, an input-gradient and a weight-gradient backward of one chunk (zb, zbv and
    dualpipev; for the others the backward is whole and only its ratio to f matters).
    - zb: (p−1)(F+B−W) / (m(F+B+W)), Qi et al.'s ZB-H1;
    - dualpipev: DualPipe's (p/2−1)(F&B + B − 3W) over 2p stages, here p ranks: (p−1)(F&B +
      B − 3W) with F&B = F + B + W (no overlap credited) and B whole, over 2m(F+B+W);
    - zbv: no closed form for unequal costs: the lists simulated with these costs;
      (p−1)/(6m) when F = B = W."""
    if name == "interleaved":
        return (pp - 1) / (v * m)
    if name == "zb":
        return (pp - 1) * max(f + b - w, 0.0) / (m * (f + b + w))
    if name == "dualpipev":
        return (pp - 1) * max(f + 2 * b - w, 0.0) / (2 * m * (f + b + w))
    if name == "zbv":
        return schedule_time(name, pp, v, m, f, b, w)[1]
    return (pp - 1) / m
