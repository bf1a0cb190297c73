"""One run per run directory: an exclusive lock on `run_dir/.lock`.

Two runs on one `run.dir` would interleave `metrics.jsonl` and write one's weights under the
other's summary. The launching process (rank 0's under torchrun) holds an `flock` on the
file for the whole run, restarts included, and writes its pid into it; a second run finds
the lock taken and is refused with a message naming that pid. The kernel drops the lock
when its holder exits, however it exits, so a crash never leaves a stale lock; the file
itself stays (removing it would race with a process about to lock it).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ndtrain.config import ConfigError


class RunLock:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ".lock"
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError("run.dir", str(self.run_dir), f"is in use by another ndtrain run (pid {holder}); "
                              "wait for it to finish or choose another run.dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
