"""Starting processes, or joining the ones a launcher started.

- Locally, `launch_local(n, fn, *args)` starts n processes through PyTorch's elastic
  launcher (the engine behind torchrun) with a c10d rendezvous on a free local port.
- Under `torchrun` (RANK/WORLD_SIZE/MASTER_ADDR set) or SLURM (SLURM_PROCID, ...), ndtrain
  starts nothing: it reads the environment it was given, so multi-node runs work the standard
  way. We invent no launcher protocol of our own.
- The backend is NCCL on CUDA and gloo on the CPU.
- If a rank dies, the elastic agent stops the others; we report the rank that failed first
  (not a peer that merely lost its connection to it) with its exception.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ProcessEnv:
    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device


def external_world() -> int | None:
    """The world size imposed by torchrun or SLURM, or None when ndtrain launches itself."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return int(os.environ["SLURM_NTASKS"])
    return None


def external_run_id() -> str | None:
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(key) and os.environ[key] != "none":
            return os.environ[key]
    return None


def _adopt_slurm_env() -> None:
    """Map SLURM's variables onto torch.distributed's, when srun started us directly."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    os.environ.setdefault("MASTER_ADDR", os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
    os.environ.setdefault("MASTER_PORT", "29500")


def pick_device(kind: str, local_rank: int) -> torch.device:
    if kind in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def warn(lines: list[str | None]) -> None:
    """Warnings before a start, one line each (None: nothing to say), from one process:
    rank 0 under torchrun, where every rank runs the command line."""
    if os.environ.get("RANK", "0") == "0":
        for line in filter(None, lines):
            print(f"ndtrain: warning: {line}", file=sys.stderr, flush=True)


def oversubscribed(processes: int, device: str) -> str | None:
    """A warning line when more CPU processes than cores would run on this machine: they
    take turns on the cores, so a step gets slower, not faster, and every process holds its
    own copy of what it needs in memory."""
    cores = os.cpu_count() or 1
    if processes <= cores or pick_device(device, 0).type == "cuda":
        return None
    return (f"{processes} processes on {cores} CPU cores: they take turns on the cores, so each step is slower "
            f"than with {cores}, and each process takes its own memory")


def init_process(device_kind: str = "auto", threads: int = 0, timeout_s: float = 600.0) -> ProcessEnv:
    """Join the process group this process was started for (none when alone)."""
    _adopt_slurm_env()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = pick_device(device_kind, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return ProcessEnv(rank, world, local_rank, local_world, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class RankFailure(RuntimeError):
    """A rank of a local launch failed. `rank`, `summary` (one line), `traceback`."""

    def __init__(self, rank: int, summary: str, traceback: str = ""):
        self.rank, self.summary, self.traceback = rank, summary, traceback
        super().__init__(f"rank {rank} failed: {summary}")


# Messages of ranks that only noticed a peer's death; never the root cause.
_PEER_LOSS = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|SIGTERM|Signal 15|"
                        r"ProcessGroupGloo|NCCL communicator was aborted|recvBytes|socket", re.I)


def _root_cause(failures: dict) -> tuple[int, str, str]:
    def info(rank, failure):
        msg = failure.message
        if isinstance(msg, dict):
            tb = msg.get("extraInfo", {}).get("py_callstack", "")
            msg = msg.get("message", "")
        else:
            tb = ""
        return rank, str(msg).strip().splitlines()[-1] if msg else f"exit code {failure.exitcode}", tb

    ordered = sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    candidates = [info(r, f) for r, f in ordered]
    for cand in candidates:
        if not _PEER_LOSS.search(cand[1]):
            return cand
    return candidates[0]


def launch_local(nproc: int, fn, *args):
    """Run `fn(*args)` in `nproc` local processes; returns {rank: result}.
    Raises RankFailure naming the rank that failed first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    os.environ.setdefault("TORCHELASTIC_ERROR_FILE_PRINTING", "0")
    try:
        return elastic_launch(config, fn)(*args)
    except ChildFailedError as e:
        rank, summary, tb = _root_cause(e.failures)
        raise RankFailure(rank, summary, tb) from None
