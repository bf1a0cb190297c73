"""Progress display for rank 0: a rich bar on a terminal, plain lines elsewhere (CI, logs)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _fmt(record: dict) -> str:
    mfu = record.get("mfu")
    parts = [f"loss {record['loss']:.4f}", f"{record['tokens_per_s']:,.0f} tok/s",
             f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU n/a"]
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.4f}")
    moe = record.get("moe")
    if moe:  # the worst block: max load / mean − 1, dead experts, balance loss (1 = balanced)
        parts.append(f"MoE maxvio {max(moe['max_violation']):.2f} · dead {max(moe['dead_fraction']):.0%} · "
                     f"aux {max(moe['aux_loss']):.3f}")
    return " · ".join(parts)


class TrainProgress:
    def __init__(self, total: int, start: int, enabled: bool = True, log_every: int = 10):
        self.console = Console(stderr=False)
        self.live = enabled and self.console.is_terminal
        self.enabled, self.log_every, self.total = enabled, log_every, total
        self.progress = None
        if self.live:
            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                     TextColumn("eta"), TimeRemainingColumn(), console=self.console)
            self.task = self.progress.add_task("train", total=total, completed=start, info="")
            self.progress.start()

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        step = record["step"] + 1
        if self.live:
            self.progress.update(self.task, completed=step, info=_fmt(record))
            if record.get("val_loss") is not None:  # evaluations stay on screen above the bar
                self.progress.console.print(f"step {step}/{self.total} · {_fmt(record)}")
        elif step % self.log_every == 0 or step == self.total or record.get("val_loss") is not None:
            print(f"step {step}/{self.total} · {_fmt(record)}", flush=True)

    def print(self, text: str) -> None:
        if self.enabled:
            (self.progress.console if self.live else self.console).print(text)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        sys.stdout.flush()
