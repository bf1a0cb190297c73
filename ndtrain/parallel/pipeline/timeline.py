"""What each pipeline rank did and when: the raw material of `ndtrain trace` and of the
measured bubble.

Each rank records the start and end of every action of the last step (compute, message
posts, waits for a received message). Times come from `time.perf_counter`; `gather` aligns
the ranks' clocks on a barrier. On CUDA the recorder synchronises the device after each
action when asked (`sync=True`), otherwise it would time kernel launches.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

COMPUTE_KINDS = ("F", "B", "W")
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


@dataclass
class Event:
    kind: str  # F, B, W, post (a message group), wait (for a received message)
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


def chrome_trace(ranks: list[list[Event]], path: Path, labels: list[str] | None = None) -> Path:
    """A Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev): one row per rank."""
    events = []
    for r, rank in enumerate(ranks):
        name = labels[r] if labels else f"rank {r}"
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r, "args": {"name": name}})
        for e in rank:
            label = f"{e.kind}{e.micro}" + (f" c{e.chunk}" if e.chunk >= 0 else "")
            events.append({"ph": "X", "name": label, "cat": e.kind, "pid": 0, "tid": r,
                           "ts": e.start * 1e6, "dur": max(e.end - e.start, 0.0) * 1e6,
                           "args": {"chunk": e.chunk, "micro": e.micro}})
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return Path(path)


def draw(ranks: list[list[Event]], path: Path, title: str, labels: list[str] | None = None) -> Path:
    """The schedule as a picture: ranks as rows, compute actions as coloured boxes labelled
    with their micro-batch, white where the rank was idle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    compute = [[e for e in rank if e.kind in COMPUTE_KINDS] for rank in ranks]
    t0 = min(e.start for rank in compute for e in rank)
    t1 = max(e.end for rank in compute for e in rank)
    scale = 1e3  # ms
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.4), dpi=120)
    for r, rank in enumerate(compute):
        ax.broken_barh([(0, (t1 - t0) * scale)], (r - 0.4, 0.8), facecolors="#F2F2F2")
        for e in rank:
            x, w = (e.start - t0) * scale, (e.end - e.start) * scale
            shade = 0.55 + 0.45 * (1 - e.chunk / max(1, max(ev.chunk for rk in compute for ev in rk)))
            ax.broken_barh([(x, w)], (r - 0.4, 0.8), facecolors=COLOURS[e.kind], edgecolor="white",
                           linewidth=0.5, alpha=shade)
            if w > (t1 - t0) * scale / 120:
                ax.text(x + w / 2, r, str(e.micro), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)), labels or [f"rank {r}" for r in range(len(ranks))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, (t1 - t0) * scale)
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=COLOURS[k], label=n) for k, n in
               (("F", "forward"), ("B", "backward (input grad)" if any(e.kind == "W" for rk in compute for e in rk) else "backward"),
                ("W", "weight grad")) if any(e.kind == k for rk in compute for e in rk)]
    handles.append(Patch(color="#F2F2F2", label="idle"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.02 * len(ranks)),
              ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
