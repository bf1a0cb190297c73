"""Data parallelism: bucketed gradient all-reduce, overlapped with the backward pass.

Each replica runs the whole model on its own rows of the global batch. Gradients must then
be summed over the replicas (the loss was already divided by the *global* token count, so a
sum, not a mean, gives the single-device gradient).

How:
1. Parameters are packed into flat buckets of at most `bucket_bytes`, in the order their
   gradients become ready in backward: first in reverse registration order (roughly
   right), then, after the first step, in the order the first step's backward actually
   produced them (rank 0's, broadcast, so every rank builds the same buckets). A pipeline
   stage registers its embedding after its blocks, but its gradient is the last to arrive:
   as bucket 0 it would have held back every other bucket.
2. The buckets are the gradient *accumulators*, in `accum_dtype`: the parameters' dtype, or
   fp32 under bf16/fp16 (Megatron's `main_grad`). In the parameters' dtype each `.grad` is
   a view into its bucket, so autograd accumulates straight into the buffer that is sent. In
   fp32 under bf16/fp16, autograd leaves each micro-batch's low-precision gradient in
   `.grad`, and the post-accumulate-grad hook adds it into the fp32 bucket and drops it:
   many micro-batches never add up in bf16.
3. The same hook counts the gradients that are ready. When a bucket is full it is
   all-reduced asynchronously while backward continues on earlier layers.
4. Buckets are launched strictly in index order on every rank, because collectives on one
   group must be issued in the same order everywhere. A bucket whose parameter got no
   gradient this step (unused, or used on another rank only) is launched by `finish()`,
   so an unused parameter delays overlap but never hangs the step.
5. On accumulation micro-steps (`set_sync(False)`) nothing is sent: gradients keep
   accumulating locally and only the last micro-step communicates.
6. Reduction runs in `reduce_dtype` (fp32 by default, parallel/precision.py): a bucket in
   another dtype is converted into a staging buffer that exists only while its all-reduce
   is in flight, and the sum is written back into the bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ndtrain.comm import ops
from ndtrain.mesh import Group
from ndtrain.parallel.placement import aligned


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # the accumulated gradients of its parameters, flat, in accum_dtype
    staging: torch.Tensor | None = None  # the buffer in reduce_dtype, while in flight
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
    accum_dtype: torch.dtype | None = None  # None: the parameters' own dtype
    buckets: list[Bucket] = field(init=False, default_factory=list)

    def __post_init__(self):
        params = [p for p in self.params if p.requires_grad]
        # Tied weights appear once; reverse registration order until backward shows the real one.
        self._order = list({id(p): p for p in reversed(params)}.values())
        self._build_buckets(self._order)
        self._seen: dict[int, nn.Parameter] | None = {}  # ready order of the first step; None once applied
        self.sync = True
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._order]

    def _build_buckets(self, order: list[nn.Parameter]) -> None:
        self.buckets, self._bucket_of, self._view = [], {}, {}
        current: list[nn.Parameter] = []
        size = 0
        for p in order:
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > self.bucket_bytes or p.dtype != current[0].dtype
                            or p.device != current[0].device):
                self._make_bucket(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self._make_bucket(current)

    def _make_bucket(self, params: list[nn.Parameter]) -> None:
        starts, numel = [], 0
        for p in params:  # each parameter's gradient starts aligned (placement.ALIGN); gaps hold zeros
            starts.append(aligned(numel))
            numel = starts[-1] + p.numel()
        dtype = self.accum_dtype or params[0].dtype
        buffer = torch.zeros(numel, dtype=dtype, device=params[0].device)
        bucket = Bucket(len(self.buckets), params, buffer)
        for p, offset in zip(params, starts):
            view = buffer[offset:offset + p.numel()].view_as(p)
            self._view[id(p)] = view
            p.grad = view if view.dtype == p.dtype else None  # autograd accumulates in place
            self._bucket_of[id(p)] = bucket
        self.buckets.append(bucket)

    def grad_of(self, p: nn.Parameter) -> torch.Tensor:
        """The accumulated (after `finish`, summed) gradient of `p`, in accum_dtype."""
        return self._view[id(p)]

    # -- the GradSync protocol used by every schedule ---------------------------
    def set_sync(self, enabled: bool) -> None:
        """Call before each micro-batch: True on the last one, whose backward communicates."""
        self.sync = enabled

    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        view = self._view[id(p)]
        if view.dtype != p.dtype:  # a low-precision micro-batch gradient: into the fp32 bucket
            view.add_(p.grad)
            p.grad = None
        if self._seen is not None:
            self._seen.setdefault(id(p), p)
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
        """Zero the buckets (never drop them: in the parameters' dtype `.grad` is a view).
        After the first step, rebuild them in the order its backward produced gradients, on
        every rank: one whose backward produced none (its `_seen` empty) still joins the
        broadcast of rank 0's order, or the group's collectives fall out of step (a hang on NCCL)."""
        if self._seen is not None:
            self._reorder(list(self._seen.values()))
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def _reorder(self, seen: list[nn.Parameter]) -> None:
        """Buckets in ready order: rank 0's order of the first step (ranks must agree, since
        buckets launch in index order), then any parameter that got no gradient."""
        self._seen = None
        index = {id(p): i for i, p in enumerate(self._order)}
        ready = [index[id(p)] for p in seen]
        order = ready + sorted(set(range(len(self._order))) - set(ready))
        new = [self._order[i] for i in ops.broadcast_ints(order, self.group)]
        if [id(p) for p in new] != [id(p) for p in self._order]:
            self._order = new
            self._build_buckets(new)

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

    def grad_of(self, p: nn.Parameter) -> torch.Tensor:
        return next(s for s in self.syncs if any(q is p for q in s.params)).grad_of(p)

    def set_sync(self, enabled: bool) -> None:
        for s in self.syncs:
            s.set_sync(enabled)

    def finish(self) -> None:
        for s in self.syncs:
            s.finish()

    def zero_grad(self) -> None:
        for s in self.syncs:
            s.zero_grad()
