"""Starting processes, or joining the ones a launcher started.

- Locally, `launch_local(n, fn, *args)` starts n processes and watches them
  (ndtrain/supervisor.py): a rank that dies or hangs stops the others within a second, and
  with `run.max_restarts` they all start again from the newest good checkpoint. They meet
  through a TCPStore the parent hosts and torchrun's environment variables.
- Under `torchrun` (RANK/WORLD_SIZE/MASTER_ADDR set) or SLURM (SLURM_PROCID, ...), ndtrain
  starts nothing: it reads the environment it was given, so multi-node runs work the standard
  way (torchrun's `--max-restarts` restarts them; they resume by themselves). We invent no
  launcher protocol of our own.
- The backend is NCCL on CUDA and gloo on the CPU; `run.collective_timeout_s` bounds every
  collective (`set_collective_timeout`).
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ndtrain import supervisor
from ndtrain.supervisor import RankFailure, Results  # noqa: F401 - the launcher's errors live here too


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


ALLOC_CONF = "expandable_segments:True"


def allocator_defaults() -> None:
    """The CUDA caching allocator with expandable segments (fewer fragmentation OOMs when
    sequence lengths or micro-batches vary), unless the user configured it. Read by torch at
    the allocator's first use, so set before this process allocates on a GPU."""
    if not any(k in os.environ for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF


def configure_numerics(device: torch.device, tf32: bool, deterministic: bool) -> None:
    """Process-wide numerics, before the first matmul: on CUDA, fp32 matmuls on TF32 tensor
    cores or not (train.tf32; the CPU is left alone, its proofs run in full precision); with
    run.deterministic, torch's deterministic algorithms and cuBLAS's fixed workspace, so a
    rerun on a GPU gives the same bits (torch warns, naming the op, where it has no
    deterministic kernel)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def local_rank() -> int:
    """This process's rank on its node, before any process group exists (torchrun, srun, ours)."""
    _adopt_slurm_env()
    return int(os.environ.get("LOCAL_RANK", 0))


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


def default_threads(local_world: int) -> int:
    """Torch threads per CPU rank when `run.threads` is 0: `OMP_NUM_THREADS` when it is set
    (the standard knob; torchrun sets it to 1 for several processes), else cores / local ranks."""
    try:
        omp = int(os.environ.get("OMP_NUM_THREADS", "") or 0)
    except ValueError:
        omp = 0
    return omp if omp > 0 else max(1, (os.cpu_count() or 1) // local_world)


_joined: list[int] = []  # this process's rank, once it has joined a group (release_groups)


def init_process(device_kind: str = "auto", threads: int = 0, timeout_s: float = 600.0) -> ProcessEnv:
    """Join the process group this process was started for (none when alone)."""
    _adopt_slurm_env()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = pick_device(device_kind, local_rank)
    if device.type == "cuda":
        allocator_defaults()
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads or default_threads(local_world))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=_store(rank, world, timeout), rank=rank, world_size=world,
                                timeout=timeout, **kwargs)
        _joined.append(rank)
    return ProcessEnv(rank, world, local_rank, local_world, device)


def _store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store of MASTER_ADDR:MASTER_PORT, as env:// would make it, under a
    prefix of its own for each restart. torchrun's agent keeps one store across restarts
    (TORCHELASTIC_USE_AGENT_STORE): without the prefix a restarted rank can read the
    address a dead rank of the previous attempt published and fail to connect to it."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                          world, is_master=not agent and rank == 0, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"ndtrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def release_groups() -> None:
    """Free the process groups a finished rank left behind, while the interpreter is alive.
    `destroy_process_group` forgets the groups, but each lives on until the objects that
    hold it (mesh, trainer: reference cycles) are collected, and with it its gloo worker
    threads. Left to the interpreter's exit, a worker thread still releasing the tensors of a
    finished collective asks for the GIL that finalization no longer gives, and the process
    aborts ("terminate called without an active exception", SIGABRT): a rank that trained
    to the end would count as failed, and torchrun's agents would then wait at their exit
    barrier. Collected here, each group's destructor joins its threads first. Called once
    the rank's work has returned (its frames, and their references, are gone), by the
    command line's `main`; a process that never joined a group (a test calling `main`, a
    command of one process) skips the collection. The ranks our launcher starts need none:
    multiprocessing ends them with `os._exit`, without a finalization."""
    if _joined:
        gc.collect()


def end_rank(code: int) -> None:
    """End a process that joined a process group (a rank of torchrun or srun) with `code`,
    now, without the interpreter's finalization: the collection in `release_groups` frees
    the groups it can reach, but one still referenced from elsewhere keeps its gloo worker
    threads into finalization, where one of them can still abort the process (seen once in
    a loaded test suite after the collection, 27 Nov 2026). The rank's work has returned and
    closed what it wrote (metrics, checkpoints, dashboards); the standard streams and
    logging are flushed here. A process that never joined a group returns normally."""
    if not _joined:
        return
    import logging
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def launch_local(nproc: int, fn, *args, max_restarts: int = 0, heartbeat_s: float = 0.0,
                 preload: tuple[str, ...] = ()) -> Results:
    """Run `fn(*args)` in `nproc` local processes, watched (ndtrain/supervisor.py); returns
    their results by rank. Raises RankFailure naming the rank that failed first for a reason
    of its own."""
    return supervisor.launch(nproc, fn, args, max_restarts=max_restarts, heartbeat_s=heartbeat_s,
                             preload=preload, log=lambda m: print(f"ndtrain: {m}", file=sys.stderr, flush=True))


def set_collective_timeout(seconds: float) -> None:
    """Give every process group made so far (the mesh's, the pipeline's) this timeout: a
    collective that does not complete in time then fails (comm/ops.py names it) instead of
    hanging. Groups made by `new_group` otherwise keep torch's default (30 min on gloo)."""
    import torch.distributed.distributed_c10d as c10d
    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is None or not dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=seconds)
    for pg in list(getattr(c10d, "_world").pg_map):
        try:
            setter(timeout, pg)
        except (ValueError, RuntimeError, AssertionError):  # a group this rank is not in
            continue
