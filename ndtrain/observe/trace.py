"""Pictures of a pipeline schedule (`ndtrain trace` runs the steps: train/trace.py).

For the last step of a run:  a Chrome trace (`trace.json`: open it in chrome://tracing or
ui.perfetto.dev; one row per rank, every action including message posts and waits) and a
picture (`timeline.png`: ranks as rows, forward/backward/weight-gradient as coloured boxes
numbered by micro-batch, idle time in grey), and reports the measured bubble next to the
theory.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ndtrain.parallel.pipeline.lists import build_schedule, deferred
from ndtrain.parallel.pipeline.schedules import parts
from ndtrain.parallel.pipeline.simulate import bubble, simulate, theory_bubble, timeline
from ndtrain.parallel.pipeline.timeline import COMPUTE_KINDS, Event, measured_bubble

COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
THEORY = {"afab": "(p−1)/m", "1f1b": "(p−1)/m", "interleaved": "(p−1)/(v·m)", "zb": "(p−1)(F+B−W)/(m(F+B+W))",
          "zbv": "simulated; (p−1)/(6m) if F=B=W", "dualpipev": "(p−1)(F&B+B−3W)/(2m(F+B+W))"}


def chrome_trace(ranks: list[list[Event]], path: Path, labels: list[str], name=None) -> Path:
    """`name(event)`: its label (default "F3 c1": kind, micro-batch, chunk)."""
    name = name or (lambda e: f"{e.kind}{e.micro} c{e.chunk}")
    events = []
    for r, rank in enumerate(ranks):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r, "args": {"name": labels[r]}})
        for e in rank:
            events.append({"ph": "X", "name": name(e), "cat": e.kind, "pid": 0, "tid": r,
                           "ts": e.start * 1e6, "dur": max(e.end - e.start, 0.0) * 1e6,
                           "args": {"chunk": e.chunk, "micro": e.micro}})
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return Path(path)


def draw(ranks: list[list[Event]], path: Path, title: str, labels: list[str], pp: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    compute = [[e for e in rank if e.kind in COMPUTE_KINDS] for rank in ranks]
    t0 = min(e.start for rank in compute for e in rank)
    span = (max(e.end for rank in compute for e in rank) - t0) * 1e3  # ms
    top_virtual = max(1, max(e.chunk // pp for rank in compute for e in rank))
    kinds = {e.kind for rank in compute for e in rank}
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(ranks) + 1.6), dpi=120)
    for r, rank in enumerate(compute):
        ax.broken_barh([(0, span)], (r - 0.4, 0.8), facecolors="#EBEBEB")
        for e in rank:
            x, w = (e.start - t0) * 1e3, (e.end - e.start) * 1e3
            # an interleaved rank's later chunks in a lighter shade of the same colour
            ax.broken_barh([(x, w)], (r - 0.4, 0.8), facecolors=COLOURS[e.kind], edgecolor="white",
                           linewidth=0.6, alpha=1.0 - 0.45 * (e.chunk // pp) / top_virtual)
            if w > span / 150:
                ax.text(x + w / 2, r, str(e.micro), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    names = {"F": "forward", "B": "backward (input grad)" if "W" in kinds else "backward", "W": "weight grad"}
    handles = [Patch(color=COLOURS[k], label=names[k]) for k in COMPUTE_KINDS if k in kinds]
    handles.append(Patch(color="#EBEBEB", label="idle"))
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.06), ncol=len(handles),
              fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def replayed_bubble(ranks: list[list[Event]], schedule: str, pp: int, v: int, m: int,
                    pipeline: list[int] | None = None) -> float:
    """The bubble the schedule would have with exactly the measured durations of every action
    but free messages. Against `measured`, it isolates what messages and the executor cost;
    against theory, what unequal or noisy action durations cost. `pipeline`: the ranks of
    one pipeline in stage order (default: the first pp ranks, a pure pipeline layout)."""
    stages = [ranks[i] for i in (pipeline or range(pp))]
    took = {(r, e.kind, e.chunk, e.micro): e.end - e.start for r, events in enumerate(stages) for e in events}
    plan = build_schedule(schedule, pp, v, m)
    return bubble(timeline(plan, lambda r, a: sum(took[(r, p.kind, p.chunk, p.micro)] for p in parts(a))))


def chunk_costs(stages: list[list[Event]], n_chunks: int) -> tuple[list[float], list[float], list[float], float]:
    """Per chunk, the mean seconds of a forward, an input-gradient backward (a whole one less
    its W, where no backward of the chunk was split) and a weight-gradient backward, each
    with the executor's own time between two recorded actions (its mean over the step); and
    the mean seconds a rank spends posting one group of messages."""
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0
    gaps, computed = 0.0, 0
    for events in stages:
        ordered = sorted(events, key=lambda e: e.start)
        gaps += sum(max(b.start - a.end, 0.0) for a, b in zip(ordered, ordered[1:]))
        computed += sum(e.kind in COMPUTE_KINDS for e in events)
    between = gaps / max(computed, 1)
    spans = {}
    for events in stages:
        for e in events:
            spans.setdefault((e.kind, e.chunk), []).append(e.end - e.start + (between if e.kind in COMPUTE_KINDS else 0.0))
    split = {e.chunk for events in stages for e in events if e.kind == "W"}
    f = [mean(spans.get(("F", c), [])) for c in range(n_chunks)]
    w = [mean(spans.get(("W", c), [])) for c in range(n_chunks)]
    b = []
    for c in range(n_chunks):
        backward = spans.get(("B", c), [])
        if c in split:  # the split ones are the shorter: a mixed schedule (DualPipeV) also has whole ones
            backward = sorted(backward)[:sum(1 for _ in spans.get(("W", c), []))]
        b.append(mean(backward) - (0.0 if c in split else w[c]))
    posts = [e.end - e.start for events in stages for e in events if e.kind == "post"]
    return f, b, w, mean(posts)


def message_time(stages: list[list[Event]]) -> float:
    """Seconds from a message leaving to its consumer having it: the median over the
    messages whose consumer was already waiting when they left (what delivery takes on
    these links and cores); 0 with fewer than 3 such messages. The ranks' clocks are aligned by a
    barrier (timeline.gather), so a sample is good to a scheduling delay."""
    sent = {}
    for events in stages:
        for e in events:
            if e.kind == "send_F":
                sent[("act", e.chunk + 1, e.micro)] = e.start
            elif e.kind == "send_B":
                sent[("grad", e.chunk - 1, e.micro)] = e.start
    samples = []
    for events in stages:
        for e in events:
            key = ("act" if e.kind == "wait_F" else "grad", e.chunk, e.micro)
            if e.kind in ("wait_F", "wait_B") and key in sent and e.start <= sent[key] < e.end:
                samples.append(e.end - sent[key])
    return statistics.median(samples) if len(samples) >= 3 else 0.0  # fewer: no estimate


def simulated_step(ranks: list[list[Event]], schedule: str, pp: int, v: int, m: int,
                   pipeline: list[int] | None = None) -> tuple[float, float]:
    """(step seconds, bubble) the schedule simulator predicts from the step's mean F, B and W
    per chunk, its mean message post and its median message time: what the planner does
    with modelled costs."""
    stages = [ranks[i] for i in (pipeline or range(pp))]
    f, b, w, post = chunk_costs(stages, pp * v)
    return simulate(build_schedule(schedule, pp, v, m), f, b, w, message_time(stages), post=post, defer=True)


def measured_step(ranks: list[list[Event]], pipeline: list[int] | None = None) -> float:
    """The step's span over one pipeline's ranks: first action's start to last action's end."""
    stages = [ranks[i] for i in (pipeline or range(len(ranks)))]
    return max(e.end for r in stages for e in r) - min(e.start for r in stages for e in r)


def _theory_costs(ranks: list[list[Event]], means: dict[str, float], late: set) -> tuple[float, float, float]:
    """F, B, W for a theory of equal stages: the means, except that the executor's deferred
    backwards (`late`, lists.deferred: the first chunk's, a V's turn: B nothing, W whole) are
    not split, so B and W come from the other split backwards."""
    keys = {(e.chunk, e.micro) for rank in ranks for e in rank if e.kind == "W"} - late
    if not keys:
        return means.get("F", 1.0), means.get("B", 1.0), 0.0
    done = {}
    for kind in ("B", "W"):  # DualPipeV: only the split backwards
        spans = [e.end - e.start for rank in ranks for e in rank if e.kind == kind and (e.chunk, e.micro) in keys]
        done[kind] = sum(spans) / len(spans)
    return means.get("F", 1.0), done["B"], done["W"]


def bubble_report(ranks: list[list[Event]], schedule: str, pp: int, v: int, m: int,
                  pipeline: list[int] | None = None) -> dict:
    measured, means = measured_bubble(ranks)
    late = {key for actions in build_schedule(schedule, pp, v, m) for key in deferred(actions)}
    theory = theory_bubble(schedule, pp, v, m, *_theory_costs(ranks, means, late))
    step, simulated = simulated_step(ranks, schedule, pp, v, m, pipeline)
    return {"schedule": schedule, "pp": pp, "virtual": v, "micro_batches": m, "measured_bubble": measured,
            "replayed_bubble": replayed_bubble(ranks, schedule, pp, v, m, pipeline),
            "simulated_bubble": simulated, "simulated_step_ms": 1e3 * step,
            "measured_step_ms": 1e3 * measured_step(ranks, pipeline),
            "theory_bubble": theory, "theory": THEORY[schedule],
            "mean_ms": {k: 1e3 * t for k, t in means.items()}}
