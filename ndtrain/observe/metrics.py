"""metrics.jsonl: one JSON object per step, written by rank 0 only.

On resume, records at or after the resumed step are dropped first, so a resumed run's file
reads exactly like an uninterrupted one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    def __init__(self, path: Path, resume_step: int = 0):
        self.path = Path(path)
        if resume_step and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) < resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif not resume_step:
            self.path.write_text("")
        self._file = open(self.path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
