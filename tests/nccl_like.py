"""gloo made to behave like NCCL wherever the difference can change what ndtrain does (issue 32).

Nothing in CI has NCCL, so `nccl_like()` patches `torch.distributed` inside a test's rank
function (the engine is not told: it sees NCCL's answers where it asks the backend) and
undoes it on exit. The messages still travel over gloo, so the numbers are gloo's: a run
under it must equal the same run without it bit for bit.

Emulated, each because it changes behaviour:
- **One handle per batch.** `batch_isend_irecv` returns ONE handle for the whole batch
  (NCCL coalesces it into one group; torch returns `cm.works`), where gloo returns one per
  message. Its `wait` completes every message of the batch; code that indexes the list per
  message fails (IndexError) or loses its receives, as it does on NCCL.
- **Batches in order on the group's stream, each a rendezvous.** NCCL runs a communicator's
  batches one after another on one stream, and a batch completes only when every partner
  has posted its side. Here a batch is posted only once the group's previous batch has
  completed (the host waits where NCCL's stream would; gloo's sends already complete only
  when the receive is posted: rendezvous). A schedule that relies on gloo's independent
  messages (a later batch overtaking an earlier one) hangs here as on NCCL. The engine's
  executor, asking `ops.independent_messages`, runs its NCCL action lists
  (`async_p2p=False`).
- **Strict in-order matching, checked.** NCCL has no tags: messages between two ranks match
  in posting order, whatever their shapes, and a receive posted for another message gets
  that message's bytes (or hangs). Every tag is forced to 0 here, and every message is
  preceded by a header (its number on the link, dtype, shape), which the receiver checks
  against what it expected: a mismatch raises `P2PMismatch` naming both, where NCCL would
  corrupt or hang.
- **Non-contiguous messages.** NCCL sends a non-contiguous tensor's memory as laid out (with
  a warning) into the receiver's contiguous buffer: scrambled values. gloo refuses them
  ("input tensor has to be contiguous"); so does this group, naming the shape and strides.
- **Collectives:** NCCL has no bitwise reductions (BAND, BOR, BXOR raise on NCCL, gloo
  computes them) and refuses non-contiguous tensors ("Tensors must be contiguous"; gloo
  reduces them). Both raise here, for all_reduce, all_gather, reduce_scatter, all_to_all and
  broadcast.
- **The backend's name:** `get_backend` answers "nccl" for every group.

Not emulated, and why:
- `work.wait()` not blocking the host (on NCCL it makes the current CUDA stream wait for
  the communication stream). On the CPU the compute runs on the host, so a wait that did
  not block would let it read buffers still being written; a host that reads a result
  needs a device sync on CUDA anyway, which tests/test_syncs.py counts.
- Eager completion of small sends (NCCL may finish a send that fits its buffers before the
  receive is posted): rendezvous is the stricter case, and what the schedules are verified
  under (pipeline/verify.py).
- Collectives ordered behind the p2p batches of the same group on one stream: the engine
  waits for every batch of a group before a collective on it (the pipeline's messages are
  complete before its all-reduces), so the order cannot differ.
- Unbatched `isend`/`irecv` (NCCL gives each pair its own communicator and stream): the
  engine posts every message through `batch_isend_irecv` (`ops.send_recv`).
- The first operation on a group involving all of its ranks (NCCL creates the communicator
  then): gloo has no such rule, and checking it would take a collective of every group's
  ranks before their first operation, which could only hang, not name the rank that
  skipped it. The executor opens the pp group with an all-reduce for NCCL's sake.
- Equal sizes in all_gather and reduce_scatter: the tensor forms ndtrain uses (`ops`) need
  them on gloo too.
- Host tensors handed to NCCL (it takes CUDA tensors only): on the CPU the device is the
  host. Every collective's tensor is made on the mesh's device; `bench gpu` runs them.
- Reductions NCCL has and gloo lacks (AVG, PREMUL_SUM): the engine uses none, and gloo
  underneath could not compute them.
- NCCL's watchdog (an error or timeout aborts the communicator asynchronously instead of
  raising in `wait`): a fault test's business, not a layout's.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool)
_DIMS = 6
_HEADER = 3 + _DIMS  # number on the link, dtype code, ndim, dims
_UNSUPPORTED = (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR)


class P2PMismatch(RuntimeError):
    """A receive that does not match the message its peer sent in that place."""


def _header(t: torch.Tensor, number: int) -> torch.Tensor:
    if t.dim() > _DIMS or t.dtype not in _DTYPES:
        raise ValueError(f"nccl_like carries up to {_DIMS} dims of {_DTYPES}; got {t.dtype} {tuple(t.shape)}")
    return torch.tensor([number, _DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (_DIMS - t.dim())],
                        dtype=torch.int64)


def _describe(header: list[int]) -> str:
    number, code, ndim, *dims = header
    dtype = _DTYPES[code] if 0 <= code < len(_DTYPES) else f"dtype code {code}"
    return f"message {number} ({dtype} {tuple(dims[:ndim])})"


class _Batch:
    """One coalesced batch: its works, and the receives' headers to check once complete.
    Each gloo work is waited for once (waiting for a gloo receive again waits for another
    message), so a wait that raised leaves the rest for the next."""

    def __init__(self, works: list, checks: list[tuple[torch.Tensor, torch.Tensor, int, object]]):
        self.works, self.checks = works, checks

    def wait(self, timeout=None) -> bool:
        # the headers first: a mismatch is named before gloo meets a payload of another size
        while self.checks:
            header, expected, peer, work = self.checks.pop(0)
            work.wait()
            if not torch.equal(header, expected):
                raise P2PMismatch(f"rank {dist.get_rank()} expected {_describe(expected.tolist())} from group "
                                  f"rank {peer}, which sent {_describe(header.tolist())}")
        while self.works:
            self.works.pop(0).wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works + [c[3] for c in self.checks])


class _Stream:
    """A group's p2p state: its last batch, and each link's message count."""

    def __init__(self):
        self.last: _Batch | None = None
        self.sent: dict[int, int] = defaultdict(int)
        self.received: dict[int, int] = defaultdict(int)


@contextlib.contextmanager
def nccl_like():
    """Within it, this process's torch.distributed behaves like NCCL (module docstring)."""
    original = {name: getattr(dist, name) for name in
                ("batch_isend_irecv", "get_backend", "all_reduce", "broadcast", "all_to_all_single",
                 "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single")
                if hasattr(dist, name)}
    streams: dict[object, _Stream] = defaultdict(_Stream)

    def batch_isend_irecv(p2p_op_list):
        if not p2p_op_list or not all(isinstance(op, dist.P2POp) for op in p2p_op_list):
            raise ValueError("batch_isend_irecv takes a non-empty list of P2POp")
        pg = p2p_op_list[0].group
        if any(op.group != pg for op in p2p_op_list):
            raise ValueError("All ops need to use the same group.")
        stream = streams[pg]
        if stream.last is not None:  # NCCL's stream: this batch starts when the previous one is done
            stream.last.wait()
        works, checks = [], []
        for op in p2p_op_list:
            t, peer = op.tensor, op.group_peer
            if not t.is_contiguous():
                raise ValueError(f"a non-contiguous {tuple(t.shape)} message (strides {t.stride()}): NCCL sends "
                                 "its memory as laid out into the peer's contiguous buffer")
            if op.op is dist.isend:
                header = _header(t, stream.sent[peer])
                stream.sent[peer] += 1
                works += [dist.isend(header, group=pg, group_dst=peer), dist.isend(t, group=pg, group_dst=peer)]
            else:
                expected = _header(t, stream.received[peer])
                stream.received[peer] += 1
                header = torch.empty(_HEADER, dtype=torch.int64)
                checks.append((header, expected, peer, dist.irecv(header, group=pg, group_src=peer)))
                works.append(dist.irecv(t, group=pg, group_src=peer))
        stream.last = _Batch(works, checks)
        return [stream.last]

    def checked(name: str, tensors_at: tuple[int, ...] = (0,)):
        call = original[name]

        def collective(*args, **kwargs):
            op = kwargs.get("op")
            if op in _UNSUPPORTED:
                raise ValueError(f"Cannot use {op} with NCCL")
            for i in tensors_at:
                if i < len(args) and isinstance(args[i], torch.Tensor) and not args[i].is_contiguous():
                    raise ValueError(f"{name}: Tensors must be contiguous")
            return call(*args, **kwargs)
        return collective

    patches = {"batch_isend_irecv": batch_isend_irecv, "get_backend": lambda group=None: "nccl",
               "all_reduce": checked("all_reduce"), "broadcast": checked("broadcast"),
               **{name: checked(name, (0, 1)) for name in ("all_to_all_single", "all_gather_into_tensor",
                                                           "reduce_scatter_tensor", "all_gather_single",
                                                           "reduce_scatter_single") if name in original}}
    for name, fn in patches.items():
        setattr(dist, name, fn)
    try:
        yield
        for stream in streams.values():  # nothing left in flight on a stream when the patches go
            if stream.last is not None:
                stream.last.wait()
    finally:
        for name, fn in original.items():
            setattr(dist, name, fn)
