"""Gather the MXFP8/NVFP4 study's runs (docs/fp8-study.sh, one folder per chain) into one folder
for docs/fp8_study_plot.py, with runs still going or cut short as "partial" rows: their last
validation loss, and bf16's at the same step of the same seed (so too a finished run shorter
than bf16's: the ablations' run.stop_after). Prints NVFP4's ablations against the full recipe.
python docs/mx_study_merge.py MERGED FOLDER...
"""

import json
import sys
from pathlib import Path


def val_curve(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"] + 1: r["val_loss"] for r in rows if r.get("val_loss") is not None}


def main(merged: Path, folders: list[Path]) -> None:
    merged.mkdir(parents=True, exist_ok=True)
    done = {}
    for folder in folders:
        for line in (folder / "results.jsonl").read_text().splitlines() if (folder / "results.jsonl").exists() else []:
            r = json.loads(line)
            done[(r["arm"], r["seed"])] = r
    runs = {}
    for folder in folders:
        for run in folder.iterdir():
            if run.is_dir() and (run / "metrics.jsonl").exists():
                arm, seed = run.name.rsplit("-", 1)
                runs[(arm, int(seed))] = run
    rows = []
    for (arm, seed), run in sorted(runs.items()):
        link = merged / run.name
        if not link.exists():
            link.symlink_to(run.resolve())
        curve = val_curve(run)
        base = runs.get(("bf16", seed))
        if (arm, seed) in done:
            r = done[(arm, seed)]
            if base is not None and arm != "bf16" and r["steps"] < max(val_curve(base)):  # a shorter run (run.stop_after)
                r = {**r, "partial": True, "bf16_val_at_step": val_curve(base)[r["steps"]]}
            rows.append(r)
            continue
        if not curve or base is None:
            continue
        step = max(curve)
        rows.append({"arm": arm, "seed": seed, "val_loss": curve[step], "steps": step, "partial": True,
                     "bf16_val_at_step": val_curve(base)[step], "train_s": 0.0})
    (merged / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ablations(rows, runs)


def ablations(rows: list[dict], runs: dict) -> None:
    """NVFP4's recipe pieces one at a time (arms nvfp4-*), each against the full recipe and
    bf16 of its seed at the step it reached: validation losses and the gaps."""
    for r in rows:
        if not r["arm"].startswith("nvfp4-") or ("nvfp4", r["seed"]) not in runs or ("bf16", r["seed"]) not in runs:
            continue
        step = r["steps"]
        nv, bf = (val_curve(runs[(a, r["seed"])]).get(step) for a in ("nvfp4", "bf16"))
        if nv is None or bf is None:
            continue
        print(f"{r['arm']} seed {r['seed']} at step {step}: {r['val_loss']:.4f}; nvfp4 {nv:.4f} "
              f"({100 * (r['val_loss'] - nv) / nv:+.2f}% from it); bf16 {bf:.4f} "
              f"(nvfp4 {100 * (nv - bf) / bf:+.2f}%, {r['arm']} {100 * (r['val_loss'] - bf) / bf:+.2f}% from it)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
