"""Moving the training weights to processes outside the training world (asynchronous RL's
generators, train/rl/asynchronous.py), by collectives on a bridge of process groups.

The generators are not ranks of the torch.distributed world (a training rank must never wait
on one inside the world's collectives). The bridge is a set of two-member gloo process groups
made from a store of their own (training rank 0 serves a `TCPStore` on 127.0.0.1; each group
under its own prefix), one per (pipeline stage, generator): member 0 the stage's *sender* (its
rank with every other coordinate 0: training rank 0 for stage 0), member 1 the generator. Its
timeout is `rl.exchange_timeout_s`, so no operation on it waits longer, and a dead peer fails it
at once (the connection resets).

- The send half (`send`, every training rank): parameter by parameter in the full model's
  order, the value `weight_sync.stage_values` computes on the stage that holds it (the
  training-tp slice made whole over ZeRO-3's shards, expert parallelism and the training tp:
  collectives of the training world, as `sync_weights` makes them), broadcast by the stage's
  sender over its group with each generator that needs that version (asynchronous gloo work,
  at most WINDOW_BYTES in flight per generator, so a rank holds at most that beyond its
  model), and waited for (`Sending.finish`) after the caller's other waits and before the
  optimizer step. The other ranks of the stage drop the value. Nothing is pickled and no
  rank holds the whole model; the value is cast to the generator's dtype (the compute dtype:
  what loading the whole state into the generator's model did) and moved to the host
  (gloo's wire).
- The receive half (`receive`, a generator's inbox thread): every parameter's receive posted
  at once into a fresh state (the shadow copy), waited for within the limit; the caller
  makes the state visible only when it is whole, so sampling never sees half a version.

A failure (a generator killed, stopped, or too slow) is caught per generator and returned,
never raised: the caller names the generator and the update in one line on every training
rank. After a failure the run ends, so a group is never reused after one.

Why gloo on CUDA too: a generator shares a GPU with a training rank when there are more
processes than GPUs (cuda:(world + g) mod count), which one NCCL communicator refuses; and an
NCCL operation with a dead or stopped peer blocks its stream until the watchdog aborts the
communicator and the process, where a gloo operation fails within its timeout with an error
this module can name. The cost: the values pass through host memory.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ndtrain.config import Config
from ndtrain.mesh import MeshShape
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.parallel.parallelize import Parallelized
from ndtrain.parallel.precision import compute_dtype
from ndtrain.parallel.states import persistent_buffers
from ndtrain.parallel.weight_sync import owners, stage_of, stage_values

WINDOW_BYTES = 64 << 20  # broadcasts in flight per generator on a sender: a rank holds at most this beyond its model
HOST = "127.0.0.1"  # one node (the generators are started by training rank 0)


@dataclass(frozen=True)
class Entry:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    stage: int  # the pipeline stage whose sender sends it
    param: bool  # a parameter (made whole over the training tp), else a persistent buffer


def plan(args: ModelArgs, cfg: Config) -> list[Entry]:
    """What moves, in the full model's order: every parameter, then the persistent buffers
    (the routers' biases), each with its whole shape, the generator's dtype and the stage
    that holds it. The same on both sides (a function of the model and the layout)."""
    with torch.device("meta"):
        model = Transformer(args).to(compute_dtype(cfg.train.precision, cfg.train.fp8_base))
    table = owners(args, cfg)
    out = []
    params = dict(model.named_parameters())
    for name, t in list(params.items()) + list(persistent_buffers(model).items()):
        out.append(Entry(name, t.shape, t.dtype, stage_of(name, table) if table else 0, name in params))
    return out


def senders(shape: MeshShape) -> list[int]:
    """The training rank that sends each stage's parameters: its rank with every other
    coordinate 0 (training rank 0 for stage 0)."""
    return shape.group_of(0, ("pp",))


def open_store(limit: float) -> tuple[dist.TCPStore, tuple[str, int]]:
    """The bridge's store, served by the calling process (training rank 0), and its address."""
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=limit))
    return store, (HOST, store.port)


def join(address: tuple[str, int], stage_generators: list[tuple[int, int]], member: int, timeout: float,
         limit: float) -> dict[tuple[int, int], dist.ProcessGroup | str]:
    """The bridge groups (stage, generator) this process is `member` of (0: the stage's
    sender, 1: the generator), in the order given (every process lists them ordered by
    stage, then generator, so no two wait on each other), each made within `limit` seconds;
    a group that could not be made is the first line of why, instead of the group."""
    store = dist.TCPStore(address[0], address[1], is_master=False, timeout=datetime.timedelta(seconds=limit))
    out: dict = {}
    for s, g in stage_generators:
        try:
            out[(s, g)] = dist.ProcessGroupGloo(dist.PrefixStore(f"bridge/{s}/{g}", store), member, 2,
                                                datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            out[(s, g)] = _first_line(e)
    return out


@dataclass
class Sent:
    seconds: float = 0.0  # this rank's time on the move: computing the values and posting, then the final wait
    bytes: int = 0
    names: set = field(default_factory=set)  # what this rank sent (its stage's parameters, on its sender)
    failed: dict = field(default_factory=dict)  # generator -> (timed out, the first line of why)


class Sending:
    """One version's broadcasts on a sender, posted; at most WINDOW_BYTES of them in flight
    per generator (waited for, oldest first, beyond it). `finish` waits for the rest within
    the limit, and must come before the optimizer changes the weights (the values may be the
    live parameters)."""

    def __init__(self, timeout: float):
        self.deadline = time.monotonic() + timeout
        self.out = Sent()
        self.flight: dict[int, deque] = {}  # generator -> (work, tensor, bytes) posted, oldest first
        self.held: dict[int, int] = {}  # generator -> bytes in flight

    def post(self, g: int, group: dist.ProcessGroup, wire: Tensor) -> None:
        if g in self.out.failed:
            return
        works, size = self.flight.setdefault(g, deque()), wire.numel() * wire.element_size()
        works.append((group.broadcast([wire], _root()), wire, size))
        self.out.bytes += size
        self.held[g] = self.held.get(g, 0) + size
        while self.held[g] > WINDOW_BYTES and g not in self.out.failed:
            work, _, done = works.popleft()
            _finish(work, g, self.deadline, self.out.failed)
            self.held[g] -= done

    def finish(self) -> Sent:
        t0 = time.perf_counter()
        for g, works in self.flight.items():
            while works and g not in self.out.failed:
                _finish(works.popleft()[0], g, self.deadline, self.out.failed)
        self.flight = {}
        self.out.seconds += time.perf_counter() - t0
        return self.out


@torch.no_grad()
def send(par: Parallelized, cfg: Config, args: ModelArgs, entries: list[Entry], groups: dict[int, dist.ProcessGroup],
         timeout: float) -> Sending:
    """The current weights (`entries`: the plan) to the generators in `groups` (generator ->
    its group with this rank's stage; empty on a rank that is no sender, which still takes
    part in the training world's collectives), posted. Every training rank calls it, at the
    same update; `finish` the result before the optimizer step."""
    t0 = time.perf_counter()
    sending = Sending(timeout)
    dtypes = {e.name: e.dtype for e in entries}
    whole = {e.name for e in entries if e.param}
    for name, value, _ in stage_values(par, cfg, args, [e.name for e in entries], whole):
        if value is None or not groups:  # another stage's, or this rank is not its stage's sender
            continue
        wire = value.to(device="cpu", dtype=dtypes[name]).contiguous()
        sending.out.names.add(name)
        for g, group in groups.items():
            sending.post(g, group, wire)
    sending.out.seconds = time.perf_counter() - t0
    return sending


def receive(groups: dict[int, dist.ProcessGroup], entries: list[Entry], timeout: float) -> dict[str, Tensor]:
    """One version of the weights into a fresh state (name -> tensor on the host), every
    receive posted at once; within `timeout` seconds. Raises BridgeError."""
    deadline = time.monotonic() + timeout
    state, works = {}, []
    for e in entries:
        state[e.name] = torch.empty(e.shape, dtype=e.dtype)
        works.append(groups[e.stage].broadcast([state[e.name]], _root()))
    failed: dict = {}
    for work in works:
        _finish(work, 0, deadline, failed)
        if failed:
            late, why = failed[0]
            raise BridgeError(f"not within {timeout:g} s (rl.exchange_timeout_s)" if late else why)
    return state


class BridgeError(RuntimeError):
    pass


def _root() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return opts


def _finish(work, g: int, deadline: float, failed: dict) -> None:
    """Wait for one operation until the deadline; a failure is kept as (timed out, why)."""
    left = deadline - time.monotonic()
    try:
        if work.is_completed():
            work.wait()  # done: returns at once, or raises its error
        elif left <= 0:  # (a wait of 0 would wait without a limit)
            failed[g] = (True, "timed out")
        else:
            work.wait(datetime.timedelta(seconds=left))
    except RuntimeError as e:
        why = _first_line(e)
        failed[g] = (time.monotonic() >= deadline - 0.05 or "timed out" in why.lower() or "timeout" in why.lower(),
                     why)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
