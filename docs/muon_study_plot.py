"""The picture and the tables of docs/muon.md's token-efficiency study:
python docs/muon_study_plot.py OUT docs/muon-study.png (OUT: the folder docs/muon-study.sh wrote).
Markdown to stdout: the learning-rate grid (first seed), then per seed the validation loss
AdamW reaches at its last step and the step at which Muon first reaches it (linear between
evaluations); its last line is the mean ratio of Muon's steps to AdamW's (the target: 0.8)."""

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def steps_to_reach(curve: list, target: float) -> float | None:
    """The first step at which the validation curve [[step, loss], ...] reaches `target`,
    interpolated linearly between evaluations; None if it never does."""
    prev = None
    for step, loss in curve:
        if loss <= target:
            if prev is None:
                return float(step)
            (s0, l0) = prev
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        prev = (step, loss)
    return None


def tuned(results: list[dict], optimizer: str, seed: int) -> float:
    rows = [r for r in results if r["optimizer"] == optimizer and r["seed"] == seed]
    return min(rows, key=lambda r: r["val"][-1][1])["lr"]


def tables(results: list[dict]) -> str:
    first = min(r["seed"] for r in results)
    lines = [f"learning-rate grid, seed {first}: final validation loss", "", "| optimizer | lr | final val loss |",
             "|---|---|---|"]
    for r in sorted((r for r in results if r["seed"] == first), key=lambda r: (r["optimizer"], r["lr"])):
        lines.append(f"| {r['optimizer']} | {r['lr']:g} | {r['val'][-1][1]:.4f} |")
    best = {o: tuned(results, o, first) for o in ("adamw", "muon")}
    lines += ["", f"tuned: adamw lr {best['adamw']:g}, muon lr {best['muon']:g}", "",
              "| seed | AdamW final val loss (step) | Muon steps to reach it | ratio | Muon final val loss |",
              "|---|---|---|---|---|"]
    ratios = []
    for seed in sorted({r["seed"] for r in results}):
        by = {r["optimizer"]: r for r in results if r["seed"] == seed and r["lr"] == best[r["optimizer"]]}
        if set(by) != {"adamw", "muon"}:
            lines.append(f"| {seed} | – | – | – | – |")
            continue
        last, target = by["adamw"]["val"][-1]
        reach = steps_to_reach(by["muon"]["val"], target)
        ratio = reach / last if reach is not None else None
        if ratio is not None:
            ratios.append(ratio)
        lines.append(f"| {seed} | {target:.4f} ({last}) | {'never' if reach is None else f'{reach:.0f}'} | "
                     f"{'–' if ratio is None else f'{ratio:.2f}'} | {by['muon']['val'][-1][1]:.4f} |")
    if ratios:
        lines.append(f"\nmean Muon/AdamW steps to AdamW's final validation loss over {len(ratios)} seeds: "
                     f"{statistics.mean(ratios):.2f} (target ≤ 0.80)")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    first = min(r["seed"] for r in results)
    best = {o: tuned(results, o, first) for o in ("adamw", "muon")}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        if r["lr"] != best[r["optimizer"]]:
            continue
        steps, losses = zip(*r["val"])
        ax.plot(steps, losses, color="C0" if r["optimizer"] == "adamw" else "C3", alpha=0.8,
                label=f"{r['optimizer']} lr {r['lr']:g}" if r["seed"] == first else None)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("default job: AdamW vs Muon at their tuned learning rates, each seed")
    ax.legend()
    ax.set_ylim(top=min(ax.get_ylim()[1], 6.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    plot(results, sys.argv[2])
    print(tables(results))
