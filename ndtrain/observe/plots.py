"""Pictures of a run, drawn with matplotlib's file-only backend."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

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


def plot_moe_load(metrics_path: Path, out: Path) -> Path:
    """MoE load per expert over steps, one panel per MoE block: each expert's share of the
    block's routed slots (1/E is perfect balance), as a heat map of step × expert."""
    records = [r for r in read_metrics(metrics_path) if r.get("moe")]
    layers = records[0]["moe"]["layers"] if records else []
    n = max(len(layers), 1)
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1.2, 2.6 * rows + 0.4), dpi=120, squeeze=False,
                             layout="constrained")
    image = None
    for i, layer in enumerate(layers):
        ax = axes[i // cols][i % cols]
        load = [[c / max(sum(row), 1) for c in row] for row in (r["moe"]["tokens_per_expert"][i] for r in records)]
        experts = len(load[0])
        image = ax.imshow([list(col) for col in zip(*load)], aspect="auto", origin="lower", cmap="viridis",
                          interpolation="nearest",
                          vmin=0.0, vmax=min(1.0, 3.0 / experts),
                          extent=(records[0]["step"] + 0.5, records[-1]["step"] + 1.5, -0.5, experts - 0.5))
        ax.set_title(f"block {layer}", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("expert", fontsize=8)
        ax.tick_params(labelsize=7)
    for j in range(len(layers), rows * cols):
        axes[j // cols][j % cols].axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="share of slots (1/E = balanced)")
    fig.suptitle("MoE load per expert", fontsize=10)
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
