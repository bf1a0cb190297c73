"""Pictures of a run, drawn with matplotlib's file-only backend."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ndtrain.observe.metrics import read_metrics  # noqa: E402


def _smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average, bias-corrected so the start is not pulled to zero."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** (i + 1)))
    return out


def plot_loss(metrics_path: Path, out: Path, baseline: float | None = None, title: str = "",
              baseline_label: str = "unigram baseline") -> Path:
    """Training and validation loss against step, with a baseline (the unigram loss, a base
    model's) if given."""
    records = read_metrics(metrics_path)
    steps = [r["step"] + 1 for r in records if r.get("loss") is not None]
    loss = [r["loss"] for r in records if r.get("loss") is not None]
    val = [(r["step"] + 1, r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, loss, lw=0.8, alpha=0.35, color="C0")
    ax.plot(steps, _smooth(loss), lw=1.5, color="C0", label="train loss (smoothed)")
    if val:
        ax.plot(*zip(*val), "o-", ms=4, label="validation loss")
    if baseline is not None:
        ax.axhline(baseline, color="grey", ls="--", lw=1, label=f"{baseline_label} ({baseline:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "ndtrain loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
