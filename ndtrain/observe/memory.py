"""Memory accounting per rank: model states (parameters, gradients, optimizer state) and the
peak of what a step's forward and backward allocate on top of them.

- Model states are counted byte for byte from the tensors that hold them: the sum of the
  sizes of their *storages*, each storage once (a parameter that is a view into a flat
  ZeRO buffer costs nothing extra; a freed ZeRO-3 buffer costs 0). The same count works on
  every device.
- The step's peak ("activations": the saved activations, plus whatever else forward and
  backward hold at that moment: gradients in flight, ZeRO-3's gathered blocks, fp32
  reduction buffers) comes from the CUDA caching allocator's statistics on a GPU. On the
  CPU there are no allocator statistics, so `CpuPeak` watches every tensor operation while
  the step runs: each storage an operation creates counts from its creation until Python
  frees it (a weak reference's finalizer), and the highest sum is the peak. Storages resized
  outside any operation (ZeRO-3 frees and regathers a unit's buffer with `storage.resize_`,
  and so does FSDP2) count too: the meter wraps `UntypedStorage.resize_` while it runs.
  A DTensor (FSDP2's parameters, gradients and optimizer state) counts as its local shard.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from ndtrain.data.batch import to_device
from ndtrain.parallel.placement import is_expert


@dataclass
class MemoryReport:
    """Bytes on one rank.

    params, grads, optimizer: the model states, counted right after the optimizer step
    (when they are all allocated). activations: the most that forward and backward held
    at once on top of what existed when forward began. peak: that plus what existed then,
    the rank's high-water mark of the pass. (ZeRO-2/3 allocate their gradient slices
    during backward, so for them `grads` is also inside `activations`' window.)"""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    peak: int = 0
    # Of the model states, those of routed experts (MoE models only; None otherwise).
    expert_params: int | None = None
    expert_grads: int | None = None
    expert_optimizer: int | None = None
    # fp8 training: bytes of the fp8 copies that the step's forwards kept for backward (part
    # of `activations` while they live; parallel/fp8.py). None without fp8.
    fp8_saved: int | None = None

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _plain(tensors: Iterable[torch.Tensor]):
    """The tensors that own memory: a wrapper subclass (a DTensor) is replaced by the
    tensors it wraps (its local shard), whose storages are the real ones; the wrapper's own
    storage has the global size and no memory."""
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            yield from _plain(getattr(t, name) for name in t.__tensor_flatten__()[0])
        elif isinstance(t, torch.Tensor):
            yield t


def _storages(tensors: Iterable[torch.Tensor]):
    for t in _plain(tensors):
        yield t.untyped_storage()


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors`, skipping those already in `seen`
    (which is updated, so several categories can share one set and never double count)."""
    seen = set() if seen is None else seen
    total = 0
    for st in _storages(tensors):
        key = (st.device, st.data_ptr())
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer, experts: bool = False) -> list[torch.Tensor]:
    return [v for p, state in optimizer.state.items() if is_expert(p) or not experts
            for v in state.values() if isinstance(v, torch.Tensor)]


def model_state_bytes(states, optimizer: torch.optim.Optimizer, experts: bool = False) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes held now by a layout's `states`
    (parallel/states.py or parallel/zero.py): the masters count as optimizer state.
    `experts=True`: only the routed experts' part."""
    seen: set = set()
    params = storage_bytes(states.param_tensors(experts), seen)
    grads = storage_bytes(states.grad_tensors(experts), seen)
    optim = storage_bytes(states.master_tensors(experts) + optimizer_tensors(optimizer, experts), seen)
    return params, grads, optim


class CpuPeak(TorchDispatchMode):
    """Peak bytes of the storages created while active, and of storages resized outside
    any operation (ZeRO-3 frees a unit's buffer and regathers it with
    `UntypedStorage.resize_`; so does FSDP2): while the meter runs, `resize_` is wrapped so
    every size change counts, including a storage made before the meter started."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._resize = None

    def __enter__(self):
        self._resize = original = torch.UntypedStorage.resize_
        meter = self

        def resize_(storage, size):
            before = storage.nbytes()
            out = original(storage, size)
            meter.live += storage.nbytes() - before
            if id(storage) in meter._sizes:
                meter._sizes[id(storage)] = storage.nbytes()  # what its finalizer will take back
            meter.peak = max(meter.peak, meter.live)
            return out
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(st) for st in _storages(tree_flatten((args, kwargs))[0])}
        for st in _storages(tree_flatten(out)[0]):
            key = id(st)
            if key in inputs or key in self._sizes or st.device.type == "meta":
                continue  # a view or an in-place result, or a meta tensor: no new memory
            self._sizes[key] = st.nbytes()
            self.live += st.nbytes()
            weakref.finalize(st, self._free, key)
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key)


@contextmanager
def measure_peak(device: torch.device):
    """`with measure_peak(dev) as result:` ... then `result["bytes"]` is the peak allocated
    inside the block above what was allocated when it started."""
    result = {"bytes": 0}
    if device.type == "cuda":
        # The caching allocator counts on the host, when the host asks for memory: the peak
        # of what the block enqueued, without waiting for the device.
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        result["bytes"] = torch.cuda.max_memory_allocated(device) - base
        return
    tracker = CpuPeak()
    with tracker:
        yield result
    result["bytes"] = tracker.peak


def per_rank(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values` (bookkeeping: not counted in the communication accounting)."""
    return per_rank_table(values, device).tolist()


def per_rank_table(values: list[float], device: torch.device) -> torch.Tensor:
    """Every rank's `values`, a [world, len(values)] fp64 table on the device; no host sync."""
    mine = to_device(torch.tensor(values, dtype=torch.float64), device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine.unsqueeze(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    table = torch.zeros(world, len(values), dtype=torch.float64, device=device)
    table[rank] = mine
    dist.all_reduce(table)
    return table


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
