"""`ndtrain plan --search`: the fastest layouts that fit, for a model, a cluster, a global batch.

Candidates vary tp (powers of two within a node), cp, pp, the schedule (1F1B, interleaved
with two chunks per rank, zero bubble; AFAB only costs memory over 1F1B), ep for a mixture
of experts (powers of two dividing the experts), the ZeRO stage, HSDP (shards within a
node, replicas across), the micro-batch and the recompute mode; the model, the global
batch, the sequence and the precision stay as configured. Each candidate is a copy of the
configuration checked by `config.validate` for the GPU count, exactly as `train` checks it,
so a layout `train` refuses is never proposed (ep must divide dp_shard × cp, for one).
Candidates whose model states alone overflow the device are dropped before their step is
replayed. The rest are ranked by step time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from ndtrain.config import Config, ConfigError, validate
from ndtrain.model.args import ModelArgs
from ndtrain.plan.cluster import Cluster
from ndtrain.plan.params import stage_chunks, stage_states
from ndtrain.plan.planner import Plan, make_plan

RECOMPUTE = ("none", "selective", "full")


@dataclass
class Found:
    plan: Plan
    overrides: list[str]


def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def candidates(cfg: Config, args: ModelArgs, gpus: int, gpus_per_node: int):
    """Override lists, each a layout to try."""
    t = cfg.train
    for tp, cp in product(_powers(min(gpus_per_node, args.n_heads)), _powers(8)):
        for pp in [d for d in range(1, min(gpus, args.n_layers) + 1) if gpus % d == 0 and (d & (d - 1)) == 0]:
            if gpus % (tp * cp * pp):
                continue
            dp = gpus // (tp * cp * pp)
            per_rank = t.global_batch // dp if t.global_batch % dp == 0 else 0
            if not per_rank:
                continue
            schedules = ([("1f1b", 1), ("zb", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2)] if pp > 1
                         else [("1f1b", 1)])
            replicas = [1] + ([dp // max(gpus_per_node // (tp * cp), 1)]
                              if dp * tp * cp > gpus_per_node and gpus_per_node >= tp * cp else [])
            eps = [e for e in _powers(dp * cp) if args.moe_experts % e == 0] if args.is_moe else [1]
            for (schedule, v), ep, zero, rep, micro, rc in product(schedules, eps, (0, 1, 2, 3), sorted(set(replicas)),
                                                                   _powers(min(per_rank, 16)), RECOMPUTE):
                if rep > 1 and zero == 0:
                    continue
                yield [f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
                       f"parallel.dp_replicate={rep}", f"parallel.zero={zero}", f"parallel.pp_schedule={schedule}",
                       f"parallel.pp_virtual={v}", f"parallel.ep={ep}", f"train.micro_batch={micro}",
                       f"train.recompute={rc}", "parallel.sp=true" if tp > 1 else "parallel.sp=false"]


def with_layout(cfg: Config, overrides: list[str]) -> Config:
    """A copy of `cfg` with `section.key=value` overrides (integers, true/false or words);
    the sections validate() fills in are fresh copies."""
    changes: dict[str, dict] = {"parallel": {}, "train": {}}
    for item in overrides:
        key, value = item.split("=", 1)
        section, name = key.split(".")
        changes[section][name] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    return Config(model=cfg.model, parallel=replace(cfg.parallel, **changes["parallel"]),
                  train=replace(cfg.train, **changes["train"]), data=cfg.data, run=replace(cfg.run))


def _states_fit(cfg: Config, args: ModelArgs) -> float:
    """The largest model states of a stage (bytes); a quick filter before the replay."""
    return max(sum(stage_states(cfg, args, chunks).values()) for chunks in stage_chunks(cfg, args))


def search(cfg: Config, args: ModelArgs, cluster: Cluster, gpus: int, top: int = 10,
           tokens: float | None = None, fp8=None, imbalance: float = 1.0) -> tuple[list[Found], float, str]:
    """(the `top` fastest layouts that fit, the smallest memory per rank seen, its layout)."""
    found: list[Found] = []
    smallest, smallest_layout = float("inf"), ""
    base = cfg.copy()
    base.run.device, base.run.nproc = "cpu", 0
    seen = set()
    for overrides in candidates(base, args, gpus, cluster.gpus_per_node):
        trial = with_layout(base, overrides)
        try:
            validate(trial, world=gpus, check_paths=False)
        except ConfigError:
            continue
        key = (tuple(vars(trial.parallel).items()), tuple(vars(trial.train).items()))
        if key in seen:
            continue
        seen.add(key)
        states = _states_fit(trial, args)
        if states > cluster.usable_memory:
            if states < smallest:
                smallest, smallest_layout = states, " ".join(overrides)
            continue
        plan = make_plan(trial, args, cluster, tokens=tokens, fp8=fp8, imbalance=imbalance)
        if plan.worst.total < smallest:
            smallest, smallest_layout = plan.worst.total, " ".join(overrides)
        if plan.fits:
            found.append(Found(plan, overrides))
    found.sort(key=lambda f: (f.plan.step_time_s, f.plan.worst.total))
    return found[:top], smallest, smallest_layout


def render(found: list[Found], cluster: Cluster, gpus: int) -> str:
    lines = [f"the fastest layouts that fit on {gpus} × {cluster.name} (within {cluster.usable_memory / 2**30:,.1f} GiB: "
             f"{cluster.memory / 1e9:,.0f} GB less {cluster.headroom:.0%} headroom)",
             f"{'#':>2}  {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>4} {'ep':>3} {'rep':>3} {'zero':>4} {'schedule':>12} "
             f"{'micro':>5} "
             f"{'recompute':>9}  {'memory':>10}  {'step':>9}  {'tokens/s':>12}  {'MFU':>6}"]
    for i, f in enumerate(found, 1):
        p, t = f.plan.cfg.parallel, f.plan.cfg.train
        schedule = (p.pp_schedule + (f" v{p.pp_virtual}" if p.pp_virtual > 1 else "")) if p.pp > 1 else "-"
        lines.append(f"{i:>2}  {p.tp:>3} {p.cp:>3} {p.pp:>3} {p.dp:>4} {p.ep:>3} {p.dp_replicate:>3} {p.zero:>4} "
                     f"{schedule:>12} "
                     f"{t.micro_batch:>5} {t.recompute:>9}  {f.plan.worst.total / 2**30:>6,.1f} GiB  "
                     f"{f.plan.step_time_s:>7,.2f} s  {f.plan.tokens_per_s:>12,.0f}  {f.plan.mfu:>6.1%}")
    return "\n".join(lines)
