"""What each pipeline rank did and when: the raw material of `ndtrain trace`
(observe/trace.py) and of the measured bubble.

Each rank records the start and end of every action of the last step (compute, message
posts, waits for a received message). Times come from `time.perf_counter`; `gather` aligns
the ranks' clocks on a barrier. On CUDA the recorder synchronises the device after each
action when asked (`sync=True`), otherwise it would time kernel launches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

COMPUTE_KINDS = ("F", "B", "W")


@dataclass
class Event:
    kind: str  # F, B, W; post (a message group); send_F, send_B (a message leaving, no duration);
    # wait_F, wait_B (for a received activation or gradient)
    chunk: int
    micro: int
    start: float
    end: float


class Timeline:
    def __init__(self, device: torch.device, sync: bool = False):
        self.device, self.sync = device, sync and device.type == "cuda"
        self.events: list[Event] = []

    def begin(self) -> None:
        self.events = []

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def add(self, kind: str, chunk: int, micro: int, start: float) -> None:
        self.events.append(Event(kind, chunk, micro, start, self.now()))


def gather(events: list[Event], group=None) -> list[list[Event]] | None:
    """Every rank's events on rank 0 of `group` (all ranks by default), shifted to one clock:
    the instant all ranks leave a barrier is time 0. Collective; None on other ranks."""
    dist.barrier(group=group)
    zero = time.perf_counter()
    local = [Event(e.kind, e.chunk, e.micro, e.start - zero, e.end - zero) for e in events]
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(local, out, dst=dst, group=group)
    return out


def measured_bubble(ranks: list[list[Event]]) -> tuple[float, dict[str, float]]:
    """(idle over busy compute time, averaged over ranks, within the step's span; the mean
    duration of each compute kind). Waiting for a message counts as idle."""
    compute = [[e for e in rank if e.kind in COMPUTE_KINDS] for rank in ranks]
    start = min(e.start for rank in compute for e in rank)
    end = max(e.end for rank in compute for e in rank)
    ratios = []
    for rank in compute:
        busy = sum(e.end - e.start for e in rank)
        ratios.append((end - start - busy) / busy)
    means = {}
    for kind in COMPUTE_KINDS:
        spans = [e.end - e.start for rank in compute for e in rank if e.kind == kind]
        if spans:
            means[kind] = sum(spans) / len(spans)
    return sum(ratios) / len(ratios), means
