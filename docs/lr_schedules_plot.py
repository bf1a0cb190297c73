"""docs/lr-schedules.png: each train.schedule's learning rate over a run, drawn from the
code that sets it (ndtrain/train/optim.py's lr_at):
python docs/lr_schedules_plot.py docs/lr-schedules.png"""

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ndtrain.config import TrainConfig  # noqa: E402
from ndtrain.train.optim import lr_at  # noqa: E402

SETTINGS = dict(steps=400, lr=3e-3, warmup=30, min_lr_ratio=0.1, decay_fraction=0.2)
TITLES = {"cosine": "cosine (the default)", "wsd": "wsd: warmup, stable, decay over the last 20%",
          "linear": "linear", "constant": "constant"}


def main(out: str) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(9, 5.5), sharex=True, sharey=True)
    for ax, (kind, title) in zip(axes.flat, TITLES.items()):
        t = TrainConfig(schedule=kind, **SETTINGS)
        ax.plot(range(t.steps), [lr_at(s, t) for s in range(t.steps)], color="tab:blue")
        ax.set_title(f"train.schedule = {title}", fontsize=9)
        ax.axvline(t.warmup, color="grey", lw=0.6, ls=":")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("learning rate")
    fig.suptitle("train.lr = 3e-3, train.warmup = 30 (dotted), train.min_lr_ratio = 0.1, train.steps = 400",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1])
