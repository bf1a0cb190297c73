"""`ndtrain checkpoint inspect DIR`: what a run's checkpoints hold, in words."""

from __future__ import annotations

import datetime
from pathlib import Path

from ndtrain.checkpoint import store
from ndtrain.checkpoint.store import CheckpointError


def describe(path: Path, verify: bool = False) -> str:
    """A run directory (every checkpoint, the newest in detail) or one checkpoint folder."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return _one(path, verify)
    folders = store.steps_of(path)
    if not folders:
        raise CheckpointError(f"{path} holds no checkpoint")
    lines = [f"run {path}: {len(folders)} checkpoint{'s' if len(folders) > 1 else ''}"]
    for folder in folders:
        reason = store.problem(folder) if verify else _cheap_problem(folder)
        lines.append(f"  {folder.name}  {'ok' if reason is None else 'REFUSED: ' + reason}")
    good = next((f for f in folders if (_cheap_problem(f) is None)), None)
    if good is not None:
        lines += ["", _one(good, verify=False)]
    return "\n".join(lines)


def _cheap_problem(folder: Path) -> str | None:
    try:
        return store.size_problem(folder, store.read_meta(folder))
    except CheckpointError as e:
        return str(e)


def _one(folder: Path, verify: bool) -> str:
    meta = store.read_meta(folder)
    try:
        return _describe(folder, meta, verify)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise CheckpointError(f"checkpoint {folder}: meta.json is damaged ({type(e).__name__}: {e})") from None


def _describe(folder: Path, meta: dict, verify: bool) -> str:
    a = meta["model_args"]
    layout = " × ".join(f"{d}={n}" for d, n in meta.get("mesh", {}).items() if n > 1) or "single process"
    saved = datetime.datetime.fromtimestamp(meta["saved_at"]).isoformat(" ", "seconds")
    model = (f"dim {a['dim']}, {a['n_layers']} layers, {a['n_heads']} heads ({a['n_kv_heads']} KV) of {a['head_dim']}, "
             f"ffn {a['ffn_dim']}, vocab {a['vocab_size']}" + (", tied" if a["tie_embeddings"] else "")
             + (", q/k/v bias" if a.get("qkv_bias") else "") + (", q/k norm" if a.get("qk_norm") else ""))
    lines = [f"{folder}",
             f"  step      {meta['step']} ({meta.get('tokens', 0):,} tokens), saved {saved}",
             f"  layout    {layout}, zero={meta.get('zero', 0)}, {meta.get('precision', 'fp32')}",
             f"  model     {model}",
             f"  optimizer {_optimizer(meta)}"
             + (f", fp16 loss scale {meta['scaler']['scale']:g}" if meta.get("scaler") else "")]
    if verify:
        reason = store.problem(folder)
        lines.append(f"  checksums {'every file matches' if reason is None else 'REFUSED: ' + reason}")
    lines.append(f"  tensors   {len(meta['tensors'])} (global name, shape, dtype, pieces)")
    for key, t in meta["tensors"].items():
        lines.append(f"    {key:<48} {str(t['shape']):<14} {t['dtype']:<4} {len(t['pieces'])}")
    total = sum(f["bytes"] for f in meta["files"].values())
    lines.append(f"  files     {len(meta['files'])}, {total:,} bytes (bytes per rank)")
    for name, f in sorted(meta["files"].items()):
        lines.append(f"    {name:<28} {f['bytes']:>14,}  sha256 {f['sha256'][:16]}…")
    return "\n".join(lines)


def _optimizer(meta: dict) -> str:
    """What optimizer state a checkpoint holds: AdamW's moments, Muon's momentum (with AdamW's
    moments on the rest), or none."""
    keys = meta["tensors"]
    if not any(k.startswith("exp_avg/") for k in keys):
        return "none (weights only)"
    muon = "Muon momentum + " if any(k.startswith("momentum_buffer/") for k in keys) else ""
    return f"{muon}AdamW moments, step {int(meta['optimizer_step'])}"
