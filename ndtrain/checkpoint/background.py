"""Checkpoints written behind training (`run.async_save = true`).

The step waits only for the copy of this rank's share of the state into host memory
(`stage`: one host slab per rank, pinned on CUDA, each tensor a view of it, copied with
`non_blocking` and waited for once; plain copies on the CPU). One slab rather than one
pinned buffer per tensor: pinning is a slow, page-locking system call per allocation, and
thousands of small pinned blocks fragment the pinned pool. The slab is kept and reused by
the next save, so a run holds one extra copy of its share in host memory. A thread then runs the same `store.save` as a
synchronous save (write and hash, fsync, meta.json, rename, read back, `latest`, prune),
so what lands on the disk is the same, byte for byte, and a crash at any moment of it
leaves what a crash of a synchronous save leaves: the previous good checkpoint.

At most one save is in flight: `start` first waits for the previous one (and raises its
error). The ranks coordinate the save (gathering the index, agreeing on each phase, the
read-back) over `group`, a gloo group of their own made for it, so the thread's collectives
never share a process group with the training step's: collectives on one group must be
issued in the same order on every rank, which two threads cannot promise.

The outcome reaches the training loop from its own thread: `wait` (before the next save, at
the end, on a stop) returns the checkpoint or raises the background's error as it was
raised, and `outcome` tells, without waiting, whether the save finished and how; the trainer
agrees on it with the other ranks (one all-reduce) before acting on it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from ndtrain.checkpoint import store

RUNNING, DONE, FAILED = 1, 0, 2  # `outcome`


class BackgroundSave:
    def __init__(self, device: torch.device, group=None):
        self.device, self.group = torch.device(device), group
        self.step: int | None = None  # the step of the save not yet waited for
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._buffers: list[torch.Tensor] = []  # views of one slab

    @property
    def pending(self) -> bool:
        """A save was started and not waited for (the same on every rank)."""
        return self._thread is not None

    def start(self, run_dir: Path, step: int, entries: list, meta: dict, keep: int = 0) -> Path:
        """Wait for the previous save (raising its error), copy `entries` (key, piece, 1-D
        data) to the host, and write them as checkpoint `step` in a thread. Returns the
        folder the checkpoint will have. Collective (over `group`, in the thread)."""
        self.wait()
        staged = self.stage(entries)
        self.step, self._result, self._error = step, None, None
        self._thread = threading.Thread(target=self._write, args=(run_dir, step, staged, meta, keep),
                                        name=f"ndtrain-save-{step}", daemon=True)
        self._thread.start()
        return store.step_dir(run_dir, step)

    def stage(self, entries: list) -> list:
        """`entries` with their data copied into views of this object's host slab (allocated
        at the first save, pinned on CUDA); returns once the copies are complete."""
        shapes = [(data.numel(), data.dtype) for _, _, data in entries]
        if [(b.numel(), b.dtype) for b in self._buffers] != shapes:
            self._buffers = slab_views(shapes, pin=self.device.type == "cuda" and torch.cuda.is_available())
        cuda = False
        for buf, (_, _, data) in zip(self._buffers, entries):
            cuda |= data.device.type == "cuda"
            buf.copy_(data.detach().reshape(-1), non_blocking=data.device.type == "cuda")
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the step waits for this copy only
        return [(key, piece, buf) for buf, (key, piece, _) in zip(self._buffers, entries)]

    def _write(self, run_dir, step, staged, meta, keep) -> None:
        try:
            self._result = store.save(run_dir, step, staged, meta, keep, group=self.group)
        except BaseException as e:  # kept for the training loop's thread, which raises it
            self._error = e

    def outcome(self) -> int:
        """RUNNING, DONE or FAILED: where the pending save is now, without waiting."""
        if self._thread is None or self._thread.is_alive():
            return RUNNING if self._thread is not None else DONE
        return FAILED if self._error is not None else DONE

    def wait(self) -> Path | None:
        """Wait for the pending save: its checkpoint, or its error raised here (None if
        none was pending)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._result


ALIGN = 64  # bytes: every view starts on a cache line (and on its dtype's size)


def slab_views(shapes: list[tuple[int, torch.dtype]], pin: bool) -> list[torch.Tensor]:
    """One host allocation holding a 1-D tensor of each (numel, dtype), as views of it."""
    offsets, total = [], 0
    for n, dtype in shapes:
        offsets.append(total)
        total += -(-n * dtype.itemsize // ALIGN) * ALIGN
    slab = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    return [slab[o:o + n * dtype.itemsize].view(dtype) for o, (n, dtype) in zip(offsets, shapes)]


def save_group(timeout_s: float):
    """A gloo group of every rank for the background saves' coordination, or None alone.
    Collective: every rank makes it, at the same point."""
    import datetime

    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
