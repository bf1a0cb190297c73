"""`ndtrain plan`: memory, step time and days of a layout on a cluster, or `--search` for the
best layouts that fit. Nothing starts, nothing is written."""

from __future__ import annotations

import math
import re

from ndtrain.config import ConfigError, load_config

_SCALE = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_tokens(text: str) -> float:
    """"15T", "300B", "2e12" → a number of tokens."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:[eE]\d+)?)\s*([KMBGT]?)\s*", text.upper())
    tokens = float(m.group(1)) * _SCALE[m.group(2)] if m else 0.0
    if not 0 < tokens < math.inf:
        raise ConfigError("--tokens", text, "expected a positive, finite number of tokens, e.g. 2e12, 300B or 15T")
    return tokens


def given_rate(args):
    """The achieved rate among --mfu, --tflops, --hfu, --hfu-tflops (at most one), or None."""
    from ndtrain.plan.planner import Rate

    given = [Rate(v, utilization, hardware) for v, utilization, hardware in
             ((args.mfu, True, False), (args.tflops, False, False), (args.hfu, True, True),
              (args.hfu_tflops, False, True)) if v is not None]
    for r in given:
        if not math.isfinite(r.value):
            raise ConfigError(r.flag, r.value, "must be a finite number")
        if r.utilization and not 0 < r.value <= 1:
            raise ConfigError(r.flag, r.value, "must be in (0, 1], a fraction of the peak")
        if not r.utilization and r.value <= 0:
            raise ConfigError(r.flag, r.value, "must be > 0 (TFLOP/s per GPU)")
    if len(given) > 1:
        raise ConfigError(given[1].flag, given[1].value, f"give one achieved rate, not both {given[0].flag} "
                          f"and {given[1].flag}")
    return given[0] if given else None


def run(args) -> int:
    from ndtrain.plan.cluster import resolve
    from ndtrain.plan.fp8 import fp8_settings, take_fp8
    from ndtrain.plan.planner import make_plan, plan_config
    from ndtrain.plan.report import render, to_json

    overrides, fp8_given = take_fp8(args.overrides)
    cfg = load_config(args.config, overrides)
    cluster = resolve(args.cluster, cfg.data.cache_dir)
    rate = given_rate(args)
    tokens = parse_tokens(args.tokens) if args.tokens else None
    fp8 = fp8_settings(cfg, fp8_given, cluster)  # validated as fp8, priced in bf16 (planner.priced_in_bf16)
    imbalance = moe_imbalance(args, cfg)
    if args.search and args.top <= 0:
        raise ConfigError("--top", args.top, "must be > 0 (how many layouts to list)")
    if args.search:
        return _search(cfg, cluster, args, tokens, fp8, imbalance)
    cfg, device = plan_config(cfg, cluster, args.gpus)
    plan = make_plan(cfg, cfg.model_args(), device, rate=rate, tokens=tokens, fp8=fp8, imbalance=imbalance)
    print(to_json(plan) if args.json else render(plan), flush=True)
    return 0


def moe_imbalance(args, cfg) -> float:
    value = getattr(args, "moe_imbalance", None)
    if value is None:
        return 1.0
    if not 1 <= value < math.inf:
        raise ConfigError("--moe-imbalance", value, "must be ≥ 1 (the busiest rank's routed slots over the average)")
    if not cfg.model_args().is_moe:
        raise ConfigError("--moe-imbalance", value, f"model.preset = {cfg.model.preset!r} has no experts")
    return value


def _search(cfg, cluster, args, tokens, fp8, imbalance) -> int:
    from ndtrain.observe.metrics import strict_json
    from ndtrain.plan.planner import plan_config
    from ndtrain.plan.search import render, search

    gpus = args.gpus or cfg.run.nproc or cluster.gpus_per_node
    probe = cfg.copy()  # the model, batch and precision must be valid on their own (one rank)
    probe.parallel.dp = probe.parallel.dp_replicate = probe.parallel.pp = probe.parallel.tp = 1
    probe.parallel.zero, probe.parallel.pp_virtual, probe.parallel.pp_split, probe.parallel.sp = 0, 1, "", None
    probe.train.micro_batch = 0
    plan_config(probe, cluster, 1)
    device = cluster.per_device(gpus)
    found, smallest, where = search(cfg, cfg.model_args(), device, gpus, args.top, tokens, fp8, imbalance)
    if not found:
        key = next((f"model.{k}" for k in ("dim", "n_layers", "ffn_dim", "vocab_size")
                    if getattr(cfg.model, k) is not None), "model.preset")
        value = getattr(cfg.model, key.split(".")[1])
        smallest_text = f"{smallest / 2**30:,.1f} GiB ({where})" if where else "none (no layout passes validation)"
        raise ConfigError(key, value, f"does not fit on any layout of {gpus} × {cluster.name}: the smallest memory "
                          f"per rank found is {smallest_text}, the device has {device.usable_memory / 2**30:,.1f} GiB "
                          f"(less {device.headroom:.0%} headroom)")
    if args.json:
        print(strict_json([{"overrides": f.overrides, **f.plan.as_json()} for f in found]))
    else:
        print(render(found, device, gpus))
    return 0
