"""The collectives, called by name where they happen, each counted in the mesh's CommStats.

Every function takes a mesh `Group`. On a group of size one it does the local equivalent
and returns at once, so a dimension of size 1 costs nothing and needs no special case at the
call site. `async_op=True` returns a handle with `.wait()` in every case.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ndtrain.comm.group import Group


def _all_gather(*args, **kwargs):
    """torch 2.13 renamed the tensor-in/tensor-out collectives; 2.6 to 2.12 have the old
    names. Looked up at each call, like every other `dist` function here."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


class CollectiveError(RuntimeError):
    """A collective that failed or did not complete within the process group's timeout
    (`run.collective_timeout_s`), named: the operation, the mesh group, this rank."""


def _describe(op: str, group: Group, error: Exception) -> str:
    text = str(error).strip()
    reason = text.splitlines()[0] if text else type(error).__name__
    late = "timed out" in text.lower() or "timeout" in text.lower()
    what = "did not complete within the collective timeout (run.collective_timeout_s)" if late else "failed"
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"{op} over group {group.name} (ranks {group.ranks}) {what} on rank {rank}: {reason}"


def _named(op: str, group: Group, call):
    try:
        return call()
    except CollectiveError:
        raise
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        raise CollectiveError(_describe(op, group, e)) from None


class Named:
    """An asynchronous handle whose `wait` names the collective when it fails."""

    def __init__(self, work, op: str, group: Group):
        self.work, self.op, self.group = work, op, group

    def wait(self, *args):
        return _named(self.op, self.group, lambda: self.work.wait(*args))

    def __getattr__(self, name):
        return getattr(self.work, name)


class Done:
    """The handle of an operation that completed synchronously."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = Done()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _finish(work, async_op: bool, op: str = "", group: Group | None = None):
    if async_op:
        return Named(work, op, group) if work is not None else DONE
    return None


def all_reduce(t: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """Sum (or `op`) of `t` over the group, in place."""
    if not group.active:
        return _finish(None, async_op)
    group.stats.record(group.name, "all_reduce", _nbytes(t), group.size)
    work = _named("all_reduce", group, lambda: dist.all_reduce(t, op=op, group=group.pg, async_op=async_op))
    return _finish(work, async_op, "all_reduce", group)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """`out` (group.size × inp along dim 0) = every rank's `inp`, in group order."""
    if not group.active:
        out.copy_(inp.view_as(out))
        return _finish(None, async_op)
    group.stats.record(group.name, "all_gather", _nbytes(out), group.size)
    work = _named("all_gather", group, lambda: _all_gather(out, inp, group=group.pg, async_op=async_op))
    return _finish(work, async_op, "all_gather", group)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group,
                   op=dist.ReduceOp.SUM, async_op: bool = False):
    """`out` = this rank's 1/n slice (dim 0) of the sum of every rank's `inp`."""
    if not group.active:
        out.copy_(inp.view_as(out))
        return _finish(None, async_op)
    group.stats.record(group.name, "reduce_scatter", _nbytes(inp), group.size)
    work = _named("reduce_scatter", group,
                  lambda: _reduce_scatter(out, inp, op=op, group=group.pg, async_op=async_op))
    return _finish(work, async_op, "reduce_scatter", group)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Group,
               out_splits: list[int] | None = None, in_splits: list[int] | None = None,
               async_op: bool = False):
    """Rows of `inp` to every rank (in_splits[r] rows to group member r, equal parts if
    None); `out` receives out_splits[r] rows from r, in group order."""
    if not group.active:
        out.copy_(inp)
        return _finish(None, async_op)
    group.stats.record(group.name, "all_to_all", _nbytes(inp), group.size, wire=all_to_all_wire(inp, group, in_splits))
    work = _named("all_to_all", group, lambda: dist.all_to_all_single(out, inp, out_splits, in_splits,
                                                                       group=group.pg, async_op=async_op))
    return _finish(work, async_op, "all_to_all", group)


def all_to_all_wire(inp: torch.Tensor, group: Group, in_splits: list[int] | None) -> float:
    """Bytes this rank sends to the others: everything but the rows it keeps."""
    if in_splits is None:
        return _nbytes(inp) * (group.size - 1) / group.size
    row = _nbytes(inp) // max(inp.shape[0], 1)
    return float(row * (sum(in_splits) - in_splits[group.rank]))


def broadcast(t: torch.Tensor, group: Group, src: int = 0, async_op: bool = False):
    """Copy group member `src`'s `t` (a group index, not a global rank) to every member."""
    if not group.active:
        return _finish(None, async_op)
    group.stats.record(group.name, "broadcast", _nbytes(t), group.size)
    work = _named("broadcast", group, lambda: dist.broadcast(t, src=group.ranks[src], group=group.pg,
                                                             async_op=async_op))
    return _finish(work, async_op, "broadcast", group)


def send(t: torch.Tensor, group: Group, dst: int):
    """Point-to-point send to group member `dst`; returns a handle."""
    group.stats.record(group.name, "send", _nbytes(t), group.size)
    return Named(_named("send", group, lambda: dist.isend(t, dst=group.ranks[dst], group=group.pg)), "send", group)


def recv(t: torch.Tensor, group: Group, src: int):
    """Point-to-point receive from group member `src` into `t`; returns a handle."""
    group.stats.record(group.name, "recv", _nbytes(t), group.size)
    return Named(_named("recv", group, lambda: dist.irecv(t, src=group.ranks[src], group=group.pg)), "recv", group)


def send_recv(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: Group) -> list:
    """Post point-to-point sends and receives (to and from group members) as one group, one
    NCCL group on CUDA, so two ranks that send to each other at once cannot wait on each
    other. Returns one handle per message, sends first, then receives.

    gloo gives a handle per message; a backend that coalesces the batch (NCCL) gives one
    handle that completes all of it (torch's `batch_isend_irecv` returns `cm.works`). Then
    every message's handle is that one: waiting for any message waits for the whole batch,
    which is when NCCL completes any of it."""
    p2p = []
    for t, dst in sends:
        group.stats.record(group.name, "send", _nbytes(t), group.size)
        p2p.append(dist.P2POp(dist.isend, t, group.ranks[dst], group.pg))
    for t, src in recvs:
        group.stats.record(group.name, "recv", _nbytes(t), group.size)
        p2p.append(dist.P2POp(dist.irecv, t, group.ranks[src], group.pg))
    works = _named("send_recv", group, lambda: dist.batch_isend_irecv(p2p)) if p2p else []
    if len(works) != len(p2p):
        if len(works) != 1:
            raise CollectiveError(f"send_recv over group {group.name}: {len(works)} handles for {len(p2p)} messages")
        works = works * len(p2p)
    return [Named(w, "send_recv", group) for w in works]


def independent_messages(group: Group) -> bool:
    """Whether each point-to-point message on the group completes by itself, posting one
    holding back none other (gloo), rather than a batch running as one group, in order
    behind every batch posted before it on the group's stream (NCCL; any backend but gloo
    is assumed to)."""
    return not group.active or dist.get_backend(group.pg) == "gloo"


def all_reduce_scalars(values: list[float], group: Group, dtype=torch.float64) -> list[float]:
    """Sum a few Python numbers over the group in one message (metrics, token counts).
    Bookkeeping, not training traffic: not counted in the byte accounting."""
    if not group.active:
        return list(values)
    t = torch.tensor(values, dtype=dtype, device=group.device)
    _named("all_reduce", group, lambda: dist.all_reduce(t, group=group.pg))
    return t.tolist()


def all_reduce_bookkeeping(t: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum of `t` over the group, staying on the device (no host sync): a step's loss,
    its target count. Bookkeeping, not counted in the byte accounting."""
    if not group.active:
        return t
    t = t.clone()
    _named("all_reduce", group, lambda: dist.all_reduce(t, group=group.pg))
    return t


def broadcast_ints(values: list[int], group: Group, src: int = 0) -> list[int]:
    """Group member `src`'s list of integers on every member (bookkeeping, not counted)."""
    if not group.active:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=group.device)
    dist.broadcast(t, src=group.ranks[src], group=group.pg)
    return t.tolist()
