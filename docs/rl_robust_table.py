"""The table of docs/rl.md's "The default job on any CPU" from `bash docs/rl-robust.sh OUT`:
python docs/rl_robust_table.py OUT. Its last line says how many default-job rows started
inside the band and gained at least 15 points."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BAND = (0.20, 0.55)  # the starting held-out pass@1 the warm-up's check aims at (docs/rl.md)
GAIN = 0.15


def main(out: str) -> None:
    rows = [json.loads(line) for line in (Path(out) / "results.jsonl").read_text().splitlines() if line.strip()]
    print("| arm | threads | seed | warm-up steps (check) | start pass@1 (pass@4) | final pass@1 (pass@4) | "
          "change | training s | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    good = 0
    grpo = [r for r in rows if r["arm"] == "grpo"]
    for r in sorted(rows, key=lambda r: (r["arm"] != "grpo", r["threads"], r["seed"])):
        change = r["end"] - r["start"]
        print(f"| {r['arm']} | {r['threads']} | {r['seed']} | {r['warmup_steps']} ({r['warmup_check']:.3f}) | "
              f"{r['start']:.3f} ({r['start_pass_k']:.3f}) | {r['end']:.3f} ({r['end_pass_k']:.3f}) | "
              f"{100 * change:+.1f} | {r['train_s']:.0f} | {' '.join(r['load'])} |")
        if r["arm"] == "grpo" and BAND[0] <= r["start"] <= BAND[1] and change >= GAIN:
            good += 1
    print(f"default-job rows starting in [{BAND[0]:.2f}, {BAND[1]:.2f}] and gaining >= {100 * GAIN:.0f} points: "
          f"{good} of {len(grpo)}")


if __name__ == "__main__":
    main(sys.argv[1])
