"""The picture of context parallelism in docs/architecture.md: the zigzag layout of one
sequence over the CP ranks, and which rank computes each block of the causal score matrix
at which ring step.

    python -m ndtrain.observe.cp_picture docs/cp-zigzag.png [cp]
"""

from __future__ import annotations

import sys
from pathlib import Path

from ndtrain.parallel.context.layout import chunks_of

RANK_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def owner(chunk: int, cp: int) -> int:
    return next(r for r in range(cp) if chunk in chunks_of(r, cp))


def draw_zigzag(cp: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Polygon, Rectangle

    n = 2 * cp
    fig, (top, grid) = plt.subplots(2, 1, figsize=(7.5, 9.2), dpi=120, gridspec_kw={"height_ratios": [1, 7.5]})
    for c in range(n):
        r = owner(c, cp)
        top.add_patch(Rectangle((c, 0), 1, 1, facecolor=RANK_COLOURS[r], edgecolor="white", linewidth=2))
        top.text(c + 0.5, 0.5, f"chunk {c}\nrank {r}", ha="center", va="center", fontsize=8, color="white")
    top.set_xlim(0, n)
    top.set_ylim(0, 1)
    top.axis("off")
    top.set_title(f"one sequence in 2·cp = {n} chunks: rank r holds chunks r and {n - 1}−r (cp = {cp})", fontsize=10)

    # score matrix: query chunk q (row), key chunk k (column), in global order
    for q in range(n):
        for k in range(q + 1):
            rq, rk = owner(q, cp), owner(k, cp)
            step = (rq - rk) % cp  # at step i rank r holds the keys of rank r − i
            y = n - 1 - q
            colour = RANK_COLOURS[rq]
            if k == q:  # causal inside the chunk: the lower triangle
                grid.add_patch(Polygon([(k, y + 1), (k, y), (k + 1, y)], facecolor=colour, edgecolor="white"))
            else:
                grid.add_patch(Rectangle((k, y), 1, 1, facecolor=colour, edgecolor="white", linewidth=1.5,
                                         alpha=1.0 - 0.55 * step / max(cp - 1, 1)))
            grid.text(k + (0.3 if k == q else 0.5), y + (0.3 if k == q else 0.5), f"step {step}",
                      ha="center", va="center", fontsize=7, color="white" if k != q else "black")
    grid.set_xlim(0, n)
    grid.set_ylim(0, n)
    grid.set_aspect("equal")
    grid.set_xticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)])
    grid.set_yticks([n - 1 - q + 0.5 for q in range(n)], [f"{q} (r{owner(q, cp)})" for q in range(n)])
    grid.set_xlabel("key chunk (its keys travel around the ring)")
    grid.set_ylabel("query chunk (owner)")
    grid.set_title("causal scores: the rank owning the queries computes each block at the ring step\n"
                   "its keys arrive (step 0 = its own keys). Steps 1.. cost 2c² pairs on every rank", fontsize=9)
    grid.legend(handles=[Patch(color=RANK_COLOURS[r], label=f"rank {r}") for r in range(cp)],
                loc="upper right", fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


if __name__ == "__main__":
    draw_zigzag(int(sys.argv[2]) if len(sys.argv) > 2 else 4, Path(sys.argv[1]))
