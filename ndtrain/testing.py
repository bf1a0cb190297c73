"""Run a function on N gloo ranks: the harness behind every multi-process test.

- Processes come from a fork server that has already imported torch and ndtrain, so a
  launch costs a fraction of a second instead of seconds of imports per rank.
- Rank 0 of nothing: the parent owns a TCPStore on a free port (the OS picks it, no race),
  and every rank joins the default process group through it.
- A rank that raises sends its traceback; the parent then kills the others (which may be
  blocked in a collective) and raises `RankError` naming the rank, with its traceback.
- A run that exceeds `timeout` is killed and reported with the ranks that did not finish.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import pickle
import queue
import time
import traceback
from typing import Any, Callable

PRELOAD = ["ndtrain.forkserver", "torch", "torch.distributed", "numpy", "ndtrain.parallel.parallelize",
           "ndtrain.train.trainer", "torch.distributed.pipelining"]  # the pipeline tests' anchor: ~2 s to import, once


class RankError(AssertionError):
    def __init__(self, rank: int, tb: str):
        self.rank = rank
        super().__init__(f"rank {rank} failed:\n" + "\n".join(f"[rank {rank}] {line}" for line in tb.splitlines()))


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(fn, rank: int, world: int, port: int, args: tuple, results, threads: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        # Plain pickle copies tensors by value; the queue's own pickler would pass
        # shared-memory handles that die with this process.
        out = pickle.dumps(fn(*args))
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 180.0, threads: int = 1) -> list:
    """`fn(*args)` on ranks 0..world-1 of a fresh gloo group; returns the results by rank.

    `fn` must be importable (a module-level function) and its result picklable.
    """
    import torch.distributed as dist

    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, world, store.port, args, results, threads), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world)) - set(out))
                raise TimeoutError(f"ranks {missing} of {world} did not finish within {timeout:.0f} s")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in out]
                if dead:
                    raise RankError(dead[0], f"process exited with code {procs[dead[0]].exitcode} "
                                             "without reporting (crashed or killed)")
                continue
            if not ok:
                raise RankError(rank, payload)
            out[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if p.is_alive() and len(out) < world:
                p.kill()
        for p in procs:
            p.join(timeout=10)
    return [out[r] for r in range(world)]
