"""`python -m ndtrain.bench.gpu_features`: the frontier features' CUDA paths against the CPU
path their fp64 proofs stand on (a step of `ndtrain bench gpu`, usable alone).

Each row (DeepSeek-V3's latent attention, MTP and routing; gpt-oss's sinks, windows and
biased experts; Muon; MXFP8; NVFP4) trains a tiny model from the same weights on the same
batch (each row's second half repeats its first: a copying task) three ways:
- on the CPU in fp32, the path the layout proofs hold equal to one process;
- on the device in fp32 (TF32 off): its first-step gradients must equal the CPU's element by
  element within `GRAD_TOL` of each tensor's largest element (fp32 sums in another order
  differ by ~1e-6; a wrong rotary base, a dropped sink, a mis-scaled latent or block moves
  the attention weights' gradients by 1e-2 and more). The format rows skip this comparison:
  an fp32 rounding difference that crosses a quantizer's midpoint moves an element by a
  whole quantum, which is right;
- on the device in bf16 (the formats on a bf16 base), what users run, through the fused
  kernels: every step's loss within `LOSS_TOL` of the CPU's, relative. This catches a crash,
  a NaN or a gross error; bf16 against fp32 moved these losses by up to 1.0e-2 (DeepSeek-V3
  tiny) and the formats' by up to 4e-2 over the 5 steps (CPU bf16 against CPU fp32,
  2026-11-28), and each tolerance is about 3× that.

The last line is one JSON object: rows (name -> status, figures) and `ok`.
"""

from __future__ import annotations

import argparse
import math
import sys

STEPS = 5
COMMON = ["train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "train.lr=1e-2", "train.warmup=1",
          "train.eval_every=0", "run.progress=false", "run.plot=false"]
# name -> (overrides, kind): "plain" rows run bf16 on the device; format rows keep their
# precision and take the base dtype from train.fp8_base.
ROWS = {
    "DeepSeek-V3 tiny: MLA, MTP, group-limited routing": (["model.preset=deepseek-v3-tiny"], "plain"),
    "gpt-oss tiny: sinks, windows, YaRN, biased experts": (["model.preset=gpt-oss-tiny"], "plain"),
    "Muon (tiny)": (["model.preset=tiny", "train.optimizer=muon"], "plain"),
    "MXFP8 (tiny)": (["model.preset=tiny", "train.precision=fp8", "train.fp8_recipe=mxfp8"], "format"),
    "NVFP4 (tiny)": (["model.preset=tiny", "train.precision=nvfp4"], "format"),
}
LOSS_TOL = {"plain": 3e-2, "format": 0.12}
GRAD_TOL = 1e-4


def copying_batch(vocab: int, rows: int, seq_len: int, device):
    """Rows whose second half repeats the first (random tokens, seeded), as inputs and targets."""
    import torch
    g = torch.Generator().manual_seed(7)
    half = (seq_len + 2) // 2
    first = torch.randint(0, vocab, (rows, half), generator=g)
    tokens = torch.cat([first, first], dim=1)[:, :seq_len + 1]
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def run(overrides: list[str], device_kind: str) -> dict:
    """`STEPS` steps of the one-process layout on `device_kind`: each step's loss and the first
    step's gradients (before clipping), on the CPU in fp32."""
    from ndtrain.config import load_config, validate
    from ndtrain.data.batch import MicroBatch
    from ndtrain.launch import configure_numerics, pick_device
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.step import TrainStep
    from ndtrain.train.worker import mesh_shape

    cfg = validate(load_config(None, COMMON + overrides + [f"run.device={device_kind}"]), world=1, check_paths=False)
    device = pick_device(cfg.run.device, 0)
    configure_numerics(device, cfg.train.tf32, cfg.run.deterministic)
    t, args = cfg.train, cfg.model_args()
    stepper = TrainStep(build(args, ParallelMesh.build(mesh_shape(cfg), device), cfg), cfg)
    x, y = copying_batch(args.vocab_size, t.global_batch, t.seq_len, device)
    micro = MicroBatch(x, y).split(t.micro_batch)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = stepper.forward_backward(micro, float(y.numel()))
        if step == 0:
            grads = {n: p.grad.detach().float().cpu() for n, p in stepper.par.model.named_parameters()
                     if p.grad is not None}
        stepper.clip_grad_norm(t.grad_clip)
        stepper.optimizer_step(t.lr)
        losses.append(float(loss))
    return {"losses": losses, "grads": grads}


def _gap(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12) if math.isfinite(a) else math.inf


def grad_gap(a: dict, b: dict) -> tuple[float, str]:
    """The largest element-wise difference of two gradient sets, relative to each tensor's
    largest element in `b`, and where."""
    if a.keys() != b.keys():
        return math.inf, f"parameters differ: {sorted(set(a) ^ set(b))[:3]}"
    worst, where = 0.0, ""
    for name, ref in b.items():
        gap = float((a[name] - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
        if not gap <= worst:  # a NaN wins
            worst, where = (gap if math.isfinite(gap) else math.inf), name
    return worst, where


def compare(name: str, device_kind: str, device_precision: str = "bf16", device_extra: tuple[str, ...] = ()) -> dict:
    """One row: the CPU fp32 run against the device's fp32 run (gradients, plain rows) and its
    `device_precision` run (losses); status ok or FAILED (with why), or ERROR with the
    exception of a run that raised. `device_extra`: overrides of the device runs only (the
    tests' controls: a fault the comparison must find)."""
    overrides, kind = ROWS[name]
    dev_o = overrides + list(device_extra)
    key = "train.precision" if kind == "plain" else "train.fp8_base"
    try:
        ref = run(overrides + [f"{key}=fp32"], "cpu")
        exact = run(dev_o + [f"{key}=fp32", "train.tf32=false"], device_kind) if kind == "plain" else None
        dev = run(dev_o + [f"{key}={device_precision}"], device_kind)
    except Exception as e:  # noqa: BLE001 - a row's failure is its status, the next row still runs
        return {"status": f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    loss_gap = max(_gap(a, b) for a, b in zip(dev["losses"], ref["losses"]))
    bad = [] if loss_gap <= LOSS_TOL[kind] else [f"{device_precision} losses {loss_gap:.1e} > {LOSS_TOL[kind]:.0e}"]
    out = {"loss_gap": loss_gap, "device_losses": dev["losses"], "cpu_losses": ref["losses"]}
    if exact is not None:
        gap, where = grad_gap(exact["grads"], ref["grads"])
        out["grad_gap"] = gap
        if not gap <= GRAD_TOL:
            bad.append(f"fp32 first-step gradients {gap:.1e} > {GRAD_TOL:.0e} ({where})")
    return {"status": "ok" if not bad else "FAILED " + ", ".join(bad), **out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ndtrain.bench.gpu_features", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="the device side (cpu: checks this script on a machine without one)")
    ap.add_argument("--precision", default="bf16", help="the device side's precision (base dtype of the format rows)")
    a = ap.parse_args(argv)
    from ndtrain.config import ConfigError, load_config, validate
    from ndtrain.observe.metrics import strict_json
    try:  # bad input ends here, in one line, before any row runs
        if a.precision not in ("bf16", "fp32", "fp64"):
            raise ConfigError("--precision", a.precision, "choose one of bf16, fp32, fp64")
        for overrides, kind in ROWS.values():
            key = "train.precision" if kind == "plain" else "train.fp8_base"
            validate(load_config(None, COMMON + overrides + [f"{key}={a.precision}", f"run.device={a.device}"]),
                     world=1, check_paths=False)
    except ConfigError as e:
        print(f"ndtrain: {e}", file=sys.stderr)
        return 2
    rows = {}
    for name in ROWS:
        rows[name] = compare(name, a.device, a.precision)
        r = rows[name]
        figures = (f" ({a.precision} losses {r['loss_gap']:.1e}" + (f", fp32 gradients {r['grad_gap']:.1e}"
                   if "grad_gap" in r else "") + ")") if "loss_gap" in r else ""
        print(f"{name}: {r['status']}{figures}", flush=True)
    ok = all(r["status"] == "ok" for r in rows.values())
    print(strict_json({"rows": rows, "ok": ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
