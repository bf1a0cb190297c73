"""metrics.jsonl: one JSON object per step, written by rank 0 only.

On resume, records at or after the resumed step are dropped first, so a resumed run's file
reads exactly like an uninterrupted one. A line that does not parse (the last one, torn by
a crash in the middle of writing it) is dropped too, rather than failing the resume.
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
    """metrics.jsonl, and the dashboards (observe/dashboards.py) that get the same records."""

    def __init__(self, path: Path, resume_step: int = 0, dashboards=None):
        self.path = Path(path)
        self.dashboards = dashboards
        if resume_step and self.path.exists():
            kept = [json.dumps(r) for r in read_metrics(self.path) if r.get("step", 0) < resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif not resume_step:
            self.path.write_text("")
        self._file = open(self.path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        if self.dashboards is not None:
            self.dashboards.write(record)

    def close(self) -> None:
        self._file.close()
        if self.dashboards is not None:
            self.dashboards.close()


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics file, skipping lines that do not parse (a torn last line)."""
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
