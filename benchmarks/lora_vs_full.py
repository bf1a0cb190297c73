"""LoRA against full fine-tuning on the default SFT job (docs/lora.md).

    python benchmarks/lora_vs_full.py [--nproc 2] [--rank 16] [--lora-lr 1e-3,1e-2] [KEY=VALUE ...]

Runs `ndtrain sft` (the default job: the default pretraining run under runs/, trained first
if there is none, fine-tuned on the embedded instruction set) once with every weight
training and once per LoRA learning rate with `lora.rank`, the rest of the command line the
same, one after the other. Prints per run: trainable and total parameters, the model-state
and peak bytes per rank (metrics.jsonl's first memory record, rank 0), the median tokens/s
(summary.json) and the answer-token validation loss at the end; the last line, the ratios
of the best LoRA run to full fine-tuning. Runs one after another on a shared machine are
disturbed by whatever else runs: say so with the figures (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ndtrain.cli import main


def first_memory(run: Path) -> dict:
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "memory" in record:
            return {k: v[0] for k, v in record["memory"].items()}
    return {}


def measure(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    memory = first_memory(run)
    states = memory.get("params", 0) + memory.get("grads", 0) + memory.get("optimizer", 0)
    return {"trainable": summary["trainable_params"], "total": summary["total_params"], "states_mb": states / 2**20,
            "optimizer_mb": memory.get("optimizer", 0) / 2**20, "grads_mb": memory.get("grads", 0) / 2**20,
            "peak_mb": memory.get("peak", 0) / 2**20, "tokens_per_s": summary["tokens_per_s"],
            "val_loss": summary["val_loss"]}


def sft(run: Path, nproc: int, overrides: list[str]) -> dict:
    if not (run / "summary.json").is_file():
        code = main(["sft", "--nproc", str(nproc), f"run.dir={run}", "run.progress=false", "run.resume=false",
                     *overrides])
        if code != 0:
            sys.exit(code)
    return measure(run)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-lr", default="1e-3,1e-2", help="LoRA learning rates, comma-separated (full: the default)")
    p.add_argument("--out", default="runs/lora-vs-full", help="where the runs go (kept: a rerun reads them)")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE for every run")
    return p.parse_args()


def row(name: str, m: dict) -> str:
    return (f"{name:<18} {m['trainable']:>11,} / {m['total']:>9,}  states {m['states_mb']:7.2f} MiB "
            f"(grads {m['grads_mb']:6.2f}, optimizer {m['optimizer_mb']:6.2f})  peak {m['peak_mb']:7.1f} MiB  "
            f"{m['tokens_per_s']:8.0f} tok/s  val_loss {m['val_loss']:.4f}")


def run() -> None:
    args = parse()
    out = Path(args.out)
    start = time.time()
    results = {"full": sft(out / "full", args.nproc, args.overrides)}
    for lr in args.lora_lr.split(","):
        results[f"lora r{args.rank} lr {lr}"] = sft(out / f"lora-r{args.rank}-lr{lr}", args.nproc,
                                                    [f"lora.rank={args.rank}", f"train.lr={lr}", *args.overrides])
    print(f"default SFT job, {args.nproc} ranks, {time.time() - start:.0f} s; trainable / total params, "
          "bytes per rank (rank 0), median tokens/s, answer-token validation loss")
    for name, m in results.items():
        print(row(name, m))
    full = results["full"]
    name, best = min(((n, m) for n, m in results.items() if n != "full"), key=lambda item: item[1]["val_loss"])
    print(f"{name} / full: trainable params {best['trainable'] / full['trainable']:.4f}×, model states "
          f"{best['states_mb'] / full['states_mb']:.3f}×, peak {best['peak_mb'] / full['peak_mb']:.3f}×, tokens/s "
          f"{best['tokens_per_s'] / full['tokens_per_s']:.2f}×, val_loss {best['val_loss']:.4f} vs {full['val_loss']:.4f}")


if __name__ == "__main__":
    run()
