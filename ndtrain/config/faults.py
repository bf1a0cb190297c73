"""The fault-tolerance keys across sections: run.fault_tolerance = "replicas" and DiLoCo
(train.diloco_*), checked once the layout is resolved (docs/faults.md)."""

from __future__ import annotations

from ndtrain.config.schema import Config, ConfigError
from ndtrain.config.sections import positive


def check_fault_tolerance(cfg: Config) -> None:
    r, t, p = cfg.run, cfg.train, cfg.parallel
    positive("train.diloco_inner_steps", t.diloco_inner_steps, zero_ok=True)
    positive("train.diloco_outer_lr", t.diloco_outer_lr)
    if not 0.0 <= t.diloco_outer_momentum < 1.0:
        raise ConfigError("train.diloco_outer_momentum", t.diloco_outer_momentum, "must be in [0, 1)")
    if t.diloco_inner_steps and r.fault_tolerance != "replicas":
        raise ConfigError("train.diloco_inner_steps", t.diloco_inner_steps,
                          'DiLoCo runs over replica groups: set run.fault_tolerance = "replicas"')
    if r.lost_rows == "requeue":
        _check_requeue(cfg)
    if r.fault_tolerance != "replicas":
        return
    if p.dp_replicate < 2:
        raise ConfigError("run.fault_tolerance", r.fault_tolerance,
                          f"replicas needs parallel.dp_replicate ≥ 2 replica groups (it is {p.dp_replicate})")
    if not r.heartbeat_s:
        raise ConfigError("run.heartbeat_s", r.heartbeat_s,
                          'must be positive under run.fault_tolerance = "replicas": it is how a hung replica is found')
    if t.precision == "fp16":
        raise ConfigError("run.fault_tolerance", r.fault_tolerance,
                          "replicas does not carry fp16's loss scale between replica groups yet; use bf16, fp32 or fp64")


def _check_requeue(cfg: Config) -> None:
    r, t = cfg.run, cfg.train
    if r.fault_tolerance != "replicas":
        raise ConfigError("run.lost_rows", r.lost_rows, 'rows are re-queued between replica groups: set '
                          'run.fault_tolerance = "replicas"')
    if t.diloco_inner_steps:  # issue 37: "with replicas a lost group simply misses an outer round"
        raise ConfigError("run.lost_rows", r.lost_rows, "DiLoCo's rounds do not re-queue rows: a lost group "
                          "misses its outer round (use skip)")
    if cfg.parallel.pp > 1 and cfg.parallel.pp_schedule == "afab":
        # a step that takes a queued part runs twice the micro-batches, and AFAB keeps every one's activations
        raise ConfigError("run.lost_rows", r.lost_rows, "with parallel.pp_schedule = afab a step that trains a "
                          "re-queued part holds twice the activations the planner counts: use 1f1b or another "
                          "schedule, or skip")


def check_pretraining_only(cfg: Config, command: str) -> None:
    """`ndtrain sft`, `rl` and `dpo` do not run replica groups yet: refused before anything runs."""
    if cfg.run.fault_tolerance == "replicas":
        raise ConfigError("run.fault_tolerance", "replicas", f"is for pretraining (ndtrain train) only so far, "
                          f"not ndtrain {command}")
