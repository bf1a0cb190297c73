"""The full action lists a pipeline runs: a schedule's compute order (schedules.py) with its
messages between the ticks, receives placed so both ends of every link agree and, for a V,
early enough for rendezvous (verify.receive_in_time). `build_schedule` is what the executor,
the simulator and the planner take.
"""

from __future__ import annotations

from ndtrain.parallel.pipeline.partition import owner
from ndtrain.parallel.pipeline.schedules import (B, F, FB, RECV_B, RECV_F, SEND_B, SEND_F, Action, Ticks,
                                                 compute_orders, forward_only, message_id, peer, vshape)
from ndtrain.parallel.pipeline.verify import receive_in_time


def _receives(a: Action, n_chunks: int, pp: int, v_shape: bool) -> list[Action]:
    """The messages the action waits for: its input from another rank (a chunk whose
    neighbour is on the same rank takes it from there, without a message)."""
    if a.kind == F and a.chunk > 0 and owner(a.chunk - 1, pp, v_shape) != owner(a.chunk, pp, v_shape):
        return [Action(RECV_F, a.chunk, a.micro)]
    if a.kind == B and a.chunk < n_chunks - 1 and owner(a.chunk + 1, pp, v_shape) != owner(a.chunk, pp, v_shape):
        return [Action(RECV_B, a.chunk, a.micro)]
    return []


def _sends(a: Action, n_chunks: int, pp: int, v_shape: bool) -> list[Action]:
    if a.kind == F and a.chunk < n_chunks - 1 and owner(a.chunk + 1, pp, v_shape) != owner(a.chunk, pp, v_shape):
        return [Action(SEND_F, a.chunk, a.micro)]
    if a.kind == B and a.chunk > 0 and owner(a.chunk - 1, pp, v_shape) != owner(a.chunk, pp, v_shape):
        return [Action(SEND_B, a.chunk, a.micro)]
    return []


def _as_action(tick: list[Action]) -> Action:
    """A tick of one action, or a forward and a backward: one F&B."""
    if len(tick) == 1:
        return tick[0]
    fwd, bwd = tick
    assert fwd.kind == F and bwd.kind == B, f"a tick of two is a forward then a backward, not {tick}"
    return Action(FB, fwd.chunk, fwd.micro, bwd)


def with_messages(orders: list[Ticks], n_chunks: int, pp: int | None = None, v_shape: bool = False
                  ) -> list[list[Action]]:
    """Between two ticks, one group of messages: what the tick before produced and what the
    tick after consumes. A tick is one action (a forward and a backward together: one F&B);
    the executor posts each group at once."""
    pp = pp or len(orders)
    out = []
    for ticks in orders:
        actions: list[Action] = []
        sends: list[Action] = []
        for tick in ticks:
            actions += sends + [r for a in tick for r in _receives(a, n_chunks, pp, v_shape)]
            actions.append(_as_action(tick))
            sends = [s for a in tick for s in _sends(a, n_chunks, pp, v_shape)]
        out.append(actions + sends)
    return out


def _align_receives(lists: list[list[Action]], pp: int, v_shape: bool) -> list[list[Action]]:
    """Both ends of a link must see its messages in the same order. A rank may need its
    messages from one neighbour in another order than that neighbour sends them (in a V, the
    activations and the gradients that cross the same link): such receives are posted
    earlier, with the first one it needs, into a buffer that waits for its consumer."""
    sent: dict[tuple[int, int], list[Action]] = {}
    for r, actions in enumerate(lists):
        for a in actions:
            if a.kind in (SEND_F, SEND_B):
                sent.setdefault((r, peer(a, pp, v_shape)), []).append(message_id(a))
    out = []
    for r, actions in enumerate(lists):
        receives = {message_id(a): a for a in actions if a.kind in (RECV_F, RECV_B)}
        posted: set = set()
        nxt: dict[int, int] = {}  # per source rank: how many of its sends are posted here
        aligned: list[Action] = []
        for a in actions:
            if a.kind not in (RECV_F, RECV_B):
                aligned.append(a)
                continue
            if message_id(a) in posted:
                continue
            src = peer(a, pp, v_shape)
            order = sent.get((src, r), [])
            while True:
                k = nxt.get(src, 0)
                if k >= len(order):  # not sent at all: verify reports it
                    aligned.append(a)
                    break
                nxt[src] = k + 1
                aligned.append(receives[order[k]])
                posted.add(order[k])
                if order[k] == message_id(a):
                    break
        out.append(aligned)
    return out


def deferred(actions: list[Action]) -> set[tuple[int, int]]:
    """(chunk, micro) of the split backwards on one rank's list whose input gradient nobody
    reads before their W: no send of it and no backward of the chunk before (a V's turn, on
    this rank) between the B and the W. The executor runs nothing at such a B and the whole
    backward at its W: the actions between them start earlier, nothing waits longer, and the
    split's own cost (B and W together take more than a whole backward) is not paid. The
    first chunk's backwards are always among them (a token id has no gradient)."""
    from ndtrain.parallel.pipeline.schedules import W, parts
    flat = [p for a in actions for p in (parts(a) if a.kind == FB else (a,))]
    at_w = {(a.chunk, a.micro): k for k, a in enumerate(flat) if a.kind == W}
    out = set()
    for k, a in enumerate(flat):
        key = (a.chunk, a.micro)
        if a.kind != B or key not in at_w:
            continue
        readers = {(SEND_B, a.chunk, a.micro), (B, a.chunk - 1, a.micro)}
        if not any((x.kind, x.chunk, x.micro) in readers for x in flat[k + 1:at_w[key]]):
            out.add(key)
    return out


def for_async_messages(actions: list[Action], ahead: int = 1) -> list[Action]:
    """One rank's list as it runs where point-to-point messages are asynchronous one by one
    (gloo: posting a message blocks nothing; a rank waits only where it consumes a buffer,
    and for its sends at the end of the step): each receive posted `ahead` compute actions
    before its group, receives keeping their order, so the message arrives while the
    compute before its consumer runs instead of being asked for just before it is needed.
    No compute action and no link's message order changes, so the simulator (which never
    makes a send wait for its receive) predicts these lists as it predicts the verified
    ones. Under the in-order rendezvous that `verify` checks (NCCL's stream) an earlier
    receive can hold back the sends after it, so the executor uses this only where messages
    are asynchronous; the list it starts from is verified as it is."""
    from ndtrain.parallel.pipeline.schedules import COMPUTE
    out: list[Action] = []
    computes: list[int] = []  # positions in `out` of the compute actions
    floor = 0  # just after the last receive placed: receives keep their order
    for a in actions:
        if a.kind in (RECV_F, RECV_B):
            at = max(computes[-ahead] if len(computes) >= ahead else 0, floor)
            out.insert(at, a)
            computes = [k + (k >= at) for k in computes]
            floor = at + 1
            continue
        if a.kind in COMPUTE:
            computes.append(len(out))
        out.append(a)
    return out


def build_schedule(name: str, pp: int, v: int, m: int, *, train: bool = True) -> list[list[Action]]:
    """The full action list of every pipeline rank (compute and messages)."""
    orders = compute_orders(name, pp, v, m)
    if not train:
        orders = forward_only(orders)
    lists = with_messages(orders, pp * v, pp, vshape(name))
    if vshape(name):
        lists = receive_in_time(_align_receives(lists, pp, True), pp, True)
    return lists
