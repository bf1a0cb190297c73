"""metrics.jsonl: one JSON object per step, written by rank 0 only; and strict JSON for
every file and `--json` output ndtrain writes.

Strict JSON (RFC 8259) has no NaN or Infinity; Python's `json` writes them by default and
strict parsers (jq, JavaScript, Go, pandas' ujson) refuse the line. Every non-finite number
is written as `null`, and a metrics line names the keys it nulled in `"nonfinite"` (dotted
paths for nested ones), e.g. `{"step": 7, "loss": null, ..., "nonfinite": ["loss"]}`: the
line of the step whose loss diverged, after which the trainer stops (train/trainer.py).

On resume, records at or after the resumed step are dropped first, so a resumed run's file
reads exactly like an uninterrupted one. A line that does not parse (the last one, torn by
a crash in the middle of writing it) is dropped too, rather than failing the resume.

A line is written whole or not at all: with one unbuffered write (and more for what a short
write left over), and a write that fails (a full disk) truncates the file back to the end
of the previous line before the error goes on; nothing stays buffered to fail again on close.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def finite(value, found: list[str] | None = None, path: str = ""):
    """`value` with every non-finite float (in dicts, lists and tuples too) replaced by None;
    the dotted path of each one replaced is appended to `found`."""
    if isinstance(value, float) and not math.isfinite(value):
        if found is not None:
            found.append(path)
        return None
    if isinstance(value, dict):
        return {k: finite(v, found, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v, found, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)]
    return value


def strict_json(value, **kwargs) -> str:
    """`json.dumps` that writes only strict JSON: non-finite numbers become null."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def metrics_line(record: dict) -> str:
    """One record as a strict JSON line, naming the keys whose values were not finite."""
    found: list[str] = []
    clean = finite(record, found)
    if found:
        clean["nonfinite"] = found
    return json.dumps(clean, allow_nan=False)


class MetricsLog:
    """metrics.jsonl, and the dashboards (observe/dashboards.py) that get the same records."""

    def __init__(self, path: Path, resume_step: int = 0, dashboards=None):
        self.path = Path(path)
        self.dashboards = dashboards
        if resume_step and self.path.exists():
            kept = [metrics_line(r) for r in read_metrics(self.path) if r.get("step", 0) < resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif not resume_step:
            self.path.write_text("")
        self._file = open(self.path, "ab", buffering=0)

    def write(self, record: dict) -> None:
        """The record's line, whole; on OSError the file is as it was and the error is raised."""
        line = (metrics_line(record) + "\n").encode()
        end = self._file.seek(0, 2)
        try:
            done = 0
            while done < len(line):
                done += self._file.write(line[done:])
        except OSError:
            self._file.truncate(end)
            raise
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
