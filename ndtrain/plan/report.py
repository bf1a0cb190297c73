"""`ndtrain plan`'s output: a table for people, one JSON object for scripts."""

from __future__ import annotations

from ndtrain.model.args import PRESETS, param_count
from ndtrain.observe.metrics import strict_json
from ndtrain.plan.planner import Plan

GiB = 2**30


def gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if n >= GiB / 4 else f"{n / 2**20:,.1f} MiB"


def count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:,.3g}{unit}"
    return f"{n:,.0f}"


def rate(flops: float) -> str:
    return f"{flops / 1e12:,.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:,.1f} GFLOP/s"


def seconds(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.2f} s"


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<38} {value:>14}" + (f"   {note}" if note else "")


def model_name(cfg, args) -> str:
    """"8B model" when the shape is the preset's; a model key that changes it makes it "a custom
    model", so the header never names a preset whose shape it is not."""
    preset = PRESETS[cfg.model.preset]
    same = args == preset.with_(max_seq_len=args.max_seq_len)
    return f"{cfg.model.preset} model" if same else "custom model"


def render(plan: Plan) -> str:
    cfg, a, c = plan.cfg, plan.args, plan.cluster
    p, t = cfg.parallel, cfg.train
    m = t.accumulation(p.dp)
    w = plan.worst
    active = (f", {param_count(a, active=True) / 1e9:,.2f} B active: {a.moe_experts} experts of {a.expert_dim}, "
              f"top-{a.moe_top_k}" if a.is_moe else "")
    precision = plan.fp8.label if plan.fp8 else t.precision
    lines = [f"ndtrain plan: {model_name(cfg, a)} ({param_count(a) / 1e9:,.2f} B parameters{active}: {a.n_layers} "
             f"layers, dim {a.dim}, ffn {a.ffn_dim}, {a.n_heads}/{a.n_kv_heads} heads, vocab {a.vocab_size}) "
             f"on {plan.world} × {c.name}",
             f"layout pp={p.pp} dp={p.dp} (replicate {p.dp_replicate}) cp={p.cp} tp={p.tp}{' +sp' if p.sp else ''} "
             f"ep={p.ep} zero={p.zero} · {p.pp_schedule if p.pp > 1 else 'one stage'}"
             + (f" v={p.pp_virtual}" if p.pp_virtual > 1 else "")
             + f" · {m} micro-batches of {t.micro_batch}×{t.seq_len} per rank, global batch {t.global_batch} · "
               f"{precision} · recompute={t.recompute}",
             "",
             f"memory per rank (pipeline stage {w.stage} of {p.pp}, the fullest)" if p.pp > 1 else "memory per rank",
             _row("parameters", gib(w.params), f"{w.params_count:,} on this rank"),
             _row("gradients", gib(w.grads), "" if w.grads_held else "shards: none yet when the step begins"),
             _row("optimizer states", gib(w.optimizer), ("fp32 master + " if t.precision in ("bf16", "fp16") else "")
                  + ("Adam moments; Muon's matrices one momentum" if t.optimizer == "muon" else "Adam moments")),
             _row("activations at the peak", gib(w.activations),
                  f"{w.in_flight} micro-batch{'es' if w.in_flight != 1 else ''} in flight")]
    for what, n in sorted(w.at_peak.items(), key=lambda kv: -kv[1]):
        lines.append(_row(f"  {what}", gib(n)))
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(_row("total (peak)", gib(w.total), f"{verdict} in {gib(c.usable_memory)} ({c.memory / 1e9:,.0f} GB "
                                                   f"less {c.headroom:.0%} headroom)"))
    if p.pp > 1:
        lines.append("  by stage: " + " · ".join(f"{r.stage}: {gib(r.total)}" for r in plan.memory))
    lines.append("  one micro-batch's saved blocks on this stage by recompute mode: " + " · ".join(
        f"{mode} {gib(v)}" for mode, v in w.saved_by_mode.items()))
    st = plan.step
    peaks = f"{rate(c.peak_flops(t.precision))} {t.precision}" + (f", {rate(c.peak[plan.fp8.peak_key])} {plan.fp8.peak_key}" if plan.fp8 else "")
    compute = ("compute (measured kernels)", "bench plan's calibration of this machine") if c.compute is not None \
        else (f"compute at {c.efficiency:.0%} of peak", f"{peaks} peak")
    lines += ["", f"step time ({'modelled; ' if plan.rate_source.startswith('given') else ''}busiest stage)",
              _row(compute[0], seconds(st.compute), compute[1]),
              _row("recomputation", seconds(st.recompute)),
              _row("tensor/sequence parallel", seconds(st.tp)),
              _row("context parallel", seconds(st.cp)),
              _row("expert parallel (all-to-all)", seconds(st.ep),
                   f"load imbalance {plan.imbalance:g}" if a.is_moe and p.ep > 1 else ""),
              _row("pipeline messages", seconds(st.pp_messages)),
              _row(f"pipeline bubble ({p.pp_schedule if p.pp > 1 else 'none'})", seconds(st.bubble),
                   f"{st.detail.get('bubble_fraction', 0.0):.3f} of the busy time" if p.pp > 1 else ""),
              _row("data parallel / ZeRO (exposed)", seconds(st.dp)),
              _row("optimizer step", seconds(st.optimizer), ("Muon: Newton–Schulz + owners' all-to-alls"
                   + ("" if c.compute is not None else " only; AdamW not modelled on GPUs")) if t.optimizer == "muon"
                   else "" if c.compute is not None else "not modelled on GPUs"),
              _row("step", seconds(st.total))]
    if plan.rate_source.startswith("given"):
        lines.append(_row("step at the given rate", seconds(plan.step_time_s), plan.rate_source))
    lines += ["", f"throughput {plan.tokens_per_s:,.0f} tokens/s ({plan.rate_source})",
              f"  MFU {plan.mfu:.1%} · {rate(plan.tflops_per_gpu * 1e12)} per GPU of model FLOPs",
              f"  HFU {plan.hfu:.1%} · {rate(plan.hfu_tflops_per_gpu * 1e12)} per GPU of hardware FLOPs "
              f"(recompute={t.recompute})"]
    if plan.days is not None:
        lines.append(f"days to train {count(plan.tokens)} tokens on {plan.world} GPUs: {plan.days:,.1f}")
    return "\n".join(lines)


def to_json(plan: Plan) -> str:
    return strict_json(plan.as_json())
