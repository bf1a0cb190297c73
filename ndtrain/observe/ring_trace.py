"""The picture of one training step of context-parallel attention (`ndtrain trace` with
parallel.cp > 1): per rank, a lane of attention compute (each ring step of each layer,
forward and backward) and under it a lane of messages, from post to arrival, with the time
spent waiting for them drawn on top. A message whose bar lies under compute was hidden."""

from __future__ import annotations

from pathlib import Path

from ndtrain.parallel.context.recorder import COMPUTE
from ndtrain.parallel.pipeline.timeline import Event

COLOURS = {"attn F": "#4C72B0", "attn B": "#DD8452", "kv": "#55A868", "dkv": "#8172B3",
           "qkv": "#55A868", "out": "#937860", "wait": "#C44E52"}


def draw_ring(ranks: list[list[Event]], path: Path, title: str, labels: list[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(e.start for rank in ranks for e in rank)
    span = (max(e.end for rank in ranks for e in rank) - t0) * 1e3
    fig, ax = plt.subplots(figsize=(13, 1.3 * len(ranks) + 1.6), dpi=120)
    kinds = set()
    for r, rank in enumerate(ranks):
        y = 2 * r
        for e in rank:
            x, w = (e.start - t0) * 1e3, max((e.end - e.start) * 1e3, span / 2000)
            if e.kind in COMPUTE:
                ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=COLOURS[e.kind], edgecolor="white", linewidth=0.3)
                if w > span / 120:
                    ax.text(x + w / 2, y, str(e.micro), ha="center", va="center", fontsize=5, color="white")
            elif e.kind.startswith("wait "):
                ax.broken_barh([(x, w)], (y + 0.55, 0.3), facecolors=COLOURS["wait"])
            else:
                ax.broken_barh([(x, w)], (y + 0.5, 0.4), facecolors=COLOURS.get(e.kind, "#8C8C8C"), alpha=0.45)
            kinds.add("wait" if e.kind.startswith("wait ") else e.kind)
    ax.set_yticks([2 * r for r in range(len(ranks))] + [2 * r + 0.7 for r in range(len(ranks))],
                  labels + ["messages"] * len(ranks), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    names = {"attn F": "attention forward (ring step)", "attn B": "attention backward (ring step)",
             "kv": "K/V in flight", "dkv": "dK/dV in flight", "qkv": "q/k/v all-to-all", "out": "output all-to-all",
             "wait": "waiting for a message"}
    handles = [Patch(color=COLOURS[k], label=names[k]) for k in names if k in kinds]
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.05), ncol=len(handles), fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
