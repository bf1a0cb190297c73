"""`ndtrain plan`: memory, step time and days of a layout on a cluster (ndtrain/plan/)."""

from __future__ import annotations


def cmd_plan(args) -> int:
    from ndtrain.plan.command import run
    return run(args)
