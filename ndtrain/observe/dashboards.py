"""TensorBoard and Weights & Biases: the scalars of metrics.jsonl, written by rank 0 only.

Both are optional extras (`pip install -e ".[tensorboard]"`, `".[wandb]"`); the config check
(`check_dashboards`) refuses a run that asks for one whose package is missing, naming the
extra, before anything starts. Each metrics.jsonl record becomes one set of scalars at its
`step`, under the record's own names: a top-level number keeps its key (`loss`, `val_loss`,
`lr`, `grad_norm`, `tokens_per_s`, `mfu`, ...), a nested one joins its keys with "/"
(`comm/dp_cp.all_reduce`, `source_tokens/web`, `memory/peak/0` for rank 0). A value
metrics.jsonl holds as null (a non-finite figure) is left out, as are flags (true/false).

TensorBoard's event files go to `run.dir/tensorboard/`; a resumed run purges the events at
and after its resume step, as metrics.jsonl drops its records. W&B writes its run folder
under `run.dir/wandb/` (`run.wandb = "offline"`: nothing leaves the machine; `wandb sync`
uploads it later), and a resumed run continues the same W&B run (its id is kept in
`run.dir/wandb/run_id`).
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path

TB_DIR = "tensorboard"
WANDB_DIR = "wandb"


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers under their metrics.jsonl names, nested keys joined by "/"."""
    out: dict[str, float] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                out[prefix] = float(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)

    for key, value in record.items():
        if key != "step":
            walk(key, value)
    return out


class Dashboards:
    """The dashboards `run.tensorboard` and `run.wandb` ask for (none: every call is a no-op)."""

    def __init__(self, run, run_dir: Path, resume_step: int, config: dict):
        self._tb = self._wandb = None
        if run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / TB_DIR), purge_step=resume_step or None)
        if run.wandb:
            self._wandb = _wandb_run(run, Path(run_dir), config)

    def write(self, record: dict) -> None:
        if self._tb is None and self._wandb is None:
            return
        values, step = scalars(record), int(record["step"])
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            # finish() can return before W&B's service has flushed the run's record file;
            # its teardown waits for that, so the run folder is complete when the run ends.
            import wandb
            teardown = getattr(wandb, "teardown", None)
            if teardown is not None:
                teardown()


def _wandb_run(run, run_dir: Path, config: dict):
    import wandb
    folder = run_dir / WANDB_DIR
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / "run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    return wandb.init(project=run.wandb_project, name=run.wandb_name or run_dir.name, dir=str(run_dir),
                      mode=run.wandb, id=run_id, resume="allow", config=config)
