"""The picture and the table of docs/rl.md's study:
python docs/rl_study_plot.py OUT docs/rl-study.png (OUT: the folder docs/rl-study.sh wrote);
the markdown table goes to stdout."""

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def series(run: Path, key: str, start: float | None = None):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    pts = [(r["step"] + 1, r[key]) for r in rows if r.get(key) is not None]
    if start is not None:
        pts = [(0, start)] + pts
    return [p[0] for p in pts], [p[1] for p in pts]


ARMS = [("grpo", "GRPO (the default job)"), ("shuffled", "GRPO, shuffled rewards"),
        ("sft", "more SFT, constant lr 3e-4, for the GRPO run's training seconds")]


def table(results: list[dict]) -> str:
    """The study as a markdown table: each seed's start → end pass@1, the mean change,
    the training seconds (and updates or steps) per run."""
    lines = ["| arm | seed 0 | seed 1 | seed 2 | mean change | training s (steps) per run |", "|---|---|---|---|---|---|"]
    for key, name in ARMS:
        rs = sorted((r for r in results if r["arm"] == key), key=lambda r: r["seed"])
        if rs:
            change = statistics.mean(r["end"] - r["start"] for r in rs) * 100
            lines.append(f"| {name} | " + " | ".join(f"{r['start']:.3f} → {r['end']:.3f}" for r in rs)
                         + f" | {change:+.1f} points | "
                         + " / ".join(f"{r['train_s']:.0f} ({r['steps']})" for r in rs) + " |")
    return "\n".join(lines)


def main(out: Path, picture: Path) -> None:
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    colors = {"grpo": "C0", "shuffled": "C3"}
    labelled = set()
    for r in results:
        arm, seed = r["arm"], r["seed"]
        if arm not in colors:
            continue
        run = out / f"{arm}-{seed}"
        label = None if arm in labelled else {"grpo": "GRPO", "shuffled": "GRPO, shuffled rewards"}[arm]
        labelled.add(arm)
        s, v = series(run, "reward_mean")
        smooth = [sum(v[max(0, i - 4):i + 1]) / len(v[max(0, i - 4):i + 1]) for i in range(len(v))]
        a.plot(s, smooth, color=colors[arm], lw=1.2, alpha=0.8, label=label)
        s, v = series(run, "pass@1", r["start"])
        b.plot(s, v, "o-", ms=3, color=colors[arm], lw=1.2, alpha=0.8, label=label)
    last = max((series(out / f"{r['arm']}-{r['seed']}", "pass@1")[0][-1] for r in results if r["arm"] in colors),
               default=1)
    ends = [r["end"] for r in results if r["arm"] == "sft"]
    if ends:
        b.scatter([last + 4] * len(ends), ends, marker="s", color="C2",
                  label="more SFT for the same training seconds: end")
    a.set_title("training reward (rollout mean, 5-update average), 3 seeds")
    b.set_title("held-out greedy pass@1 (200 prompts), 3 seeds")
    for ax in (a, b):
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    b.set_ylim(-0.02, 1.02)
    fig.tight_layout()
    fig.savefig(picture)
    print(table(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
