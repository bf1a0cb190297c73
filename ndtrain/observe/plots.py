"""Pictures of a run, drawn with matplotlib's file-only backend."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ndtrain.observe.metrics import read_metrics  # noqa: E402


def plot_loss(metrics_path: Path, out: Path, baseline: float | None = None, title: str = "") -> Path:
    """Training and validation loss against step, with the unigram baseline if given."""
    records = read_metrics(metrics_path)
    steps = [r["step"] + 1 for r in records if r.get("loss") is not None]
    loss = [r["loss"] for r in records if r.get("loss") is not None]
    val = [(r["step"] + 1, r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, loss, lw=1, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", ms=4, label="validation loss")
    if baseline is not None:
        ax.axhline(baseline, color="grey", ls="--", lw=1, label=f"unigram baseline ({baseline:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "ndtrain loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
