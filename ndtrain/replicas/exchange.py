"""What replica groups exchange, each exchange a phase of the lighthouse (lighthouse.py):
the step's target count, the gradients, the whole state for a joiner, and DiLoCo's deltas.

Every rank of a replica group exchanges with the ranks at its own position in the other
groups (the same shard of the same tensors: every group has the same layout), over the
quorum's gloo group, by name: `allreduce` and `broadcast` of one flat buffer each.
Gradients are summed into a copy, so a phase that fails leaves this rank's own gradients
as they were, and the retry, over the replicas still alive, starts from them: scaled by
N_before / N_live, the loss is then divided by the live target count, as one process
would divide the batch it saw.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ndtrain.replicas.lighthouse import Lighthouse, Quorum


def _flat(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One buffer on `device` (AdamW keeps its step count on the host)."""
    return torch.cat([t.detach().reshape(-1).to(device) for t in tensors]) if tensors else torch.zeros(0)


@torch.no_grad()
def _unflat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def all_reduce(flat: torch.Tensor, group) -> None:
    if group is not None:
        group.allreduce([flat]).wait()


def broadcast(flat: torch.Tensor, root: int, group) -> None:
    if group is not None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        group.broadcast([flat], opts).wait()


class Exchange:
    """One rank's side of the exchanges, with retries: every method returns the quorum that
    committed (its members are the replicas whose data the step used)."""

    def __init__(self, lighthouse: Lighthouse, device: torch.device):
        self.lh, self.device = lighthouse, device
        self.tag, self.attempt = "", 0

    def start(self, tag: str, admit: bool = True) -> Quorum:
        self.tag, self.attempt = tag, 0
        return self.lh.quorum(tag, 0, admit)

    def retry(self, failed: Quorum) -> Quorum:
        self.lh.await_change(failed)
        self.attempt += 1
        return self.lh.quorum(self.tag, self.attempt)

    def count(self, q: Quorum, local: float) -> tuple[Quorum, float]:
        """The sum of every live replica's `local` (its target count), and their quorum."""
        while True:
            box = torch.tensor([float(local)], dtype=torch.float64, device=self.device)
            if self.lh.phase(q, "n", lambda g: all_reduce(box, g)):
                return q, float(box.item())
            q = self.retry(q)

    def sum_grads(self, q: Quorum, grads: list[torch.Tensor], local_count: float, used: float) -> tuple[Quorum, float]:
        """Sum `grads` (computed with the loss divided by `used` targets) over the live
        replicas; after a failure, over the survivors, rescaled to their target count.
        Returns the quorum and the count the gradients are divided by."""
        while True:
            flat = _flat(grads, self.device)
            if flat.dtype in (torch.float16, torch.bfloat16):
                flat = flat.float()
            if self.lh.phase(q, "g", lambda g: all_reduce(flat, g)):
                _unflat(flat, grads)
                return q, used
            q = self.retry(q)
            q, live = self.count(q, local_count)
            with torch.no_grad():
                for g in grads:
                    g.mul_(used / live)
            used = live

    def average(self, q: Quorum, tensors: list[torch.Tensor]) -> Quorum:
        """Replace `tensors` by their mean over the live replicas (DiLoCo's deltas)."""
        while True:
            flat = _flat(tensors, self.device)
            if self.lh.phase(q, "d", lambda g: all_reduce(flat, g)):
                _unflat(flat.div_(len(q.members)), tensors)
                return q
            q = self.retry(q)

    def send_state(self, q: Quorum, tensors: Callable[[], list[torch.Tensor]]) -> bool:
        """The source's `tensors()` to every member of `q` (joiners receive them; the
        others hold the same values already). True when every rank of `q` has them."""
        def exchange(group):
            held = tensors()
            flat = _flat(held, self.device)
            broadcast(flat, q.replicas.index(q.source), group)
            _unflat(flat, held)
        return self.lh.phase(q, "x", exchange)
