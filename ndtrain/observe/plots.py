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
    return _save(fig, out)


def _save(fig, out: Path, layout: bool = True) -> Path:
    """Write the figure to `out` (laid out first, unless it places itself) and free it."""
    if layout:
        fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"] + 1, r[key]) for r in records if r.get(key) is not None]
    return ([s for s, _ in pairs], [v for _, v in pairs]) if pairs else ([], [])


def plot_rl(metrics_path: Path, out: Path, start: dict | None = None, title: str = "") -> Path:
    """An RL run in six panels against updates: the training reward, held-out pass@1 and
    pass@k (from `start`, the starting policy's, at 0), response length, entropy and KL,
    clipping and the groups that teach something, and where each step's time went."""
    records = read_metrics(metrics_path)
    start = start or {}
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), dpi=110)
    ax = axes[0, 0]
    steps, reward = _series(records, "reward_mean")
    if reward:
        ax.plot(steps, reward, lw=0.8, alpha=0.35, color="C0")
        ax.plot(steps, _smooth(reward), lw=1.6, color="C0", label="reward (mean of the rollouts, smoothed)")
    ax.set_title("training reward")
    ax = axes[0, 1]
    for i, key in enumerate(sorted({k for r in records for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:]))):
        s, v = _series(records, key)
        if key in start:
            s, v = [0] + s, [start[key]] + v
        ax.plot(s, v, "o-", ms=3, color=f"C{i + 1}", label=f"held-out {key}")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("held-out evaluation")
    panels = [(axes[0, 2], "completion", [("response_length", "length (tokens)"), ("truncated", "cut at max length")]),
              (axes[1, 0], "policy", [("entropy", "entropy (nats/token)"), ("kl", "KL to the start (k3)")]),
              (axes[1, 1], "update", [("clip_fraction", "clipped tokens"),
                                      ("groups_with_variance", "groups with reward variance")])]
    for ax, name, keys in panels:
        for i, (key, label) in enumerate(keys):
            s, v = _series(records, key)
            if v:
                ax.plot(s, v, lw=1.2, color=f"C{i + 3}", label=label)
        ax.set_title(name)
    ax = axes[1, 2]
    s, rollout = _series(records, "rollout_time_s")
    _, total = _series(records, "step_time_s")
    if rollout and len(rollout) == len(total):
        ax.stackplot(s, rollout, [t - r for t, r in zip(total, rollout)], labels=["rollout", "update"],
                     colors=["C1", "C0"], alpha=0.7)
    ax.set_title("time per step (s)")
    for ax in axes.flat:
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title or "ndtrain rl")
    return _save(fig, out)


def plot_dpo(metrics_path: Path, out: Path, title: str = "") -> Path:
    """A DPO run in three panels against steps, each held-out figure from 0 (the reference:
    accuracy 0.5, margins 0, loss log 2): preference accuracy (held-out, and the training
    batches' smoothed) against chance, the held-out reward margin and the chosen and rejected
    answers' rewards, and the loss (training and held-out)."""
    import math
    records = read_metrics(metrics_path)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=110)
    start = {"val_pref_accuracy": 0.5, "val_reward_margin": 0.0, "val_reward_chosen": 0.0,
             "val_reward_rejected": 0.0, "val_loss": math.log(2.0)}
    panels = [(axes[0], "preference accuracy", "pref_accuracy", [("val_pref_accuracy", "held-out")]),
              (axes[1], "implicit reward β·(log π − log π_ref)", "reward_margin",
               [("val_reward_margin", "held-out margin"), ("val_reward_chosen", "held-out chosen"),
                ("val_reward_rejected", "held-out rejected")]),
              (axes[2], "loss −log σ(margin)", "loss", [("val_loss", "held-out")])]
    for ax, name, train_key, keys in panels:
        steps, values = _series(records, train_key)
        if values:
            ax.plot(steps, _smooth(values), lw=1.2, alpha=0.6, color="C0", label="training batches (smoothed)")
        for i, (key, label) in enumerate(keys):
            s, v = _series(records, key)
            if v:
                ax.plot([0] + s, [start[key]] + v, "o-", ms=3, color=f"C{i + 1}", label=label)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].axhline(0.5, color="gray", ls="--", lw=1, label="chance")
    axes[0].set_ylim(0.3, 1.02)
    axes[2].axhline(math.log(2.0), color="gray", ls="--", lw=1, label="log 2 (the reference)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(title or "ndtrain dpo")
    return _save(fig, out)


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
    return _save(fig, out, layout=False)
