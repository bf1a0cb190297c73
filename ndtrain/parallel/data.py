"""Data parallelism: bucketed gradient all-reduce, overlapped with the backward pass.

Each replica runs the whole model on its own rows of the global batch. Gradients must then
be summed over the replicas (the loss was already divided by the *global* token count, so a
sum, not a mean, gives the single-device gradient).

How:
1. Parameters are packed, in reverse registration order (roughly the order backward
   produces their gradients), into flat buckets of at most `bucket_bytes`.
2. Each parameter's `.grad` is a view into its bucket, so autograd accumulates straight into
   the buffer that will be sent: no copy before the all-reduce.
3. A post-accumulate-grad hook counts the gradients that are ready. When a bucket is full it
   is all-reduced asynchronously while backward continues on earlier layers.
4. Buckets are launched strictly in index order on every rank, because collectives on one
   group must be issued in the same order everywhere. A bucket whose parameter got no
   gradient this step (unused, or used on another rank only) is launched by `finish()`,
   so an unused parameter delays overlap but never hangs the step.
5. On accumulation micro-steps (`set_sync(False)`) the hooks do nothing: gradients keep
   accumulating locally and only the last micro-step communicates.
6. Reduction runs in `reduce_dtype` (fp32 by default, parallel/precision.py): a bucket of
   lower-precision gradients is widened into a staging buffer that exists only while its
   all-reduce is in flight, and the sum is rounded back into the bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ndtrain.comm import ops
from ndtrain.mesh import Group


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # flat gradients, the storage behind every param.grad in the bucket
    staging: torch.Tensor | None = None  # the buffer widened to reduce_dtype, while in flight
    ready: int = 0
    work: object = None
    launched: bool = False

    @property
    def full(self) -> bool:
        return self.ready == len(self.params)


@dataclass
class DataParallel:
    """Gradient synchronisation for replicated parameters over one group (usually `dp_cp`)."""

    params: list[nn.Parameter]
    group: Group
    bucket_bytes: int = 25 * 2**20
    reduce_dtype: torch.dtype = torch.float32
    buckets: list[Bucket] = field(init=False, default_factory=list)

    def __post_init__(self):
        params = [p for p in self.params if p.requires_grad]
        # Tied weights appear once; order them as backward will finish them.
        unique = list({id(p): p for p in reversed(params)}.values())
        self._bucket_of: dict[int, Bucket] = {}
        current: list[nn.Parameter] = []
        size = 0
        for p in unique:
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > self.bucket_bytes or p.dtype != current[0].dtype
                            or p.device != current[0].device):
                self._make_bucket(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self._make_bucket(current)
        self.sync = True
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in unique]

    def _make_bucket(self, params: list[nn.Parameter]) -> None:
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        bucket = Bucket(len(self.buckets), params, buffer)
        offset = 0
        for p in params:
            p.grad = buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            self._bucket_of[id(p)] = bucket
        self.buckets.append(bucket)

    # -- the GradSync protocol used by every schedule ---------------------------
    def set_sync(self, enabled: bool) -> None:
        """Call before each micro-batch: True on the last one, whose backward communicates."""
        self.sync = enabled

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.full:
            self._launch_ready_prefix()

    def _launch_ready_prefix(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].full:
            self._launch(self.buckets[self._next_launch])

    def _launch(self, bucket: Bucket) -> None:
        send = bucket.buffer
        if self.group.active and send.dtype != self.reduce_dtype:
            bucket.staging = send = bucket.buffer.to(self.reduce_dtype)
        bucket.work = ops.all_reduce(send, self.group, async_op=True)
        bucket.launched = True
        self._next_launch += 1

    def finish(self) -> None:
        """Launch what is left (in order), wait for everything; grads are then summed."""
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        for bucket in self.buckets:
            bucket.work.wait()
            if bucket.staging is not None:
                bucket.buffer.copy_(bucket.staging)
            bucket.work, bucket.launched, bucket.ready, bucket.staging = None, False, 0, None
        self._next_launch = 0
        self.sync = True

    def zero_grad(self) -> None:
        """Zero the buckets. Never set grads to None: they are views into the buckets."""
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


class GradSyncs:
    """Several synchronisers run as one (dense gradients over `dp_cp`, expert gradients over
    `edp`, parallel/expert.py): each is told and finishes in turn."""

    def __init__(self, syncs: list[DataParallel]):
        self.syncs = syncs

    @property
    def buckets(self) -> list[Bucket]:
        return [b for s in self.syncs for b in s.buckets]

    def set_sync(self, enabled: bool) -> None:
        for s in self.syncs:
            s.set_sync(enabled)

    def finish(self) -> None:
        for s in self.syncs:
            s.finish()

    def zero_grad(self) -> None:
        for s in self.syncs:
            s.zero_grad()
