"""Checkpoints: every rank's state, written atomically, read back on the same layout.

A checkpoint is a folder `checkpoints/step_NNNNNNN/` of *parts*. A part (model, optimizer,
rng, ...) is identical on the ranks of its replicated dimensions, so only the rank whose
coordinates on those dimensions are all 0 writes it, under a name that carries the other
coordinates: `model-pp1-tp0.safetensors`, `optim-dp_shard3.pt`, `rng-rank5.pt`. A purely
data-parallel run therefore writes one `model.safetensors`, which is also the full model.

Atomicity: every rank writes into `step_N.tmp/`; after a barrier rank 0 writes
`meta.json`, renames the folder to `step_N/` and then replaces the `latest` file. A crash at
any point leaves either the previous checkpoint as `latest` or the new one, complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ndtrain.mesh import COMPOSITES, DIMS, ParallelMesh


class CheckpointError(RuntimeError):
    pass


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


PER_RANK = None  # `replicated` value of a part every rank keeps its own copy of (RNG state)


def file_name(name: str, mesh: ParallelMesh, replicated: tuple[str, ...] | None, tensors: bool) -> str:
    """The part's file name: the coordinates on every live dimension it is *not* replicated
    over, e.g. `optim-pp1-dp_shard0.pt`."""
    ext = "safetensors" if tensors else "pt"
    if replicated is PER_RANK:
        return f"{name}-rank{mesh.rank}.{ext}"
    reps = set(expand_dims(replicated))
    tag = "".join(f"-{d}{mesh.coords[d]}" for d in DIMS
                  if d not in reps and getattr(mesh.shape, d) > 1)
    return f"{name}{tag}.{ext}"


def writes_part(mesh: ParallelMesh, replicated: tuple[str, ...] | None) -> bool:
    """Whether this rank writes the part: only the first copy of identical copies does."""
    return replicated is PER_RANK or all(mesh.coords[d] == 0 for d in expand_dims(replicated))


def expand_dims(dims: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(d for name in dims for d in COMPOSITES.get(name, (name,)))


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".partial")
    write(tmp)
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save(run_dir: Path, step: int, mesh: ParallelMesh, parts: dict, meta: dict) -> Path:
    """Write a checkpoint. `parts`: name → (object, replicated dims or PER_RANK); an object that is a
    dict of tensors goes to safetensors, anything else to torch.save. Collective."""
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if mesh.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    for name, (obj, replicated) in parts.items():
        if not writes_part(mesh, replicated):
            continue
        tensors = _is_tensor_dict(obj)
        fname = file_name(name, mesh, replicated, tensors)
        if tensors:
            flat = {k: v.detach().contiguous().cpu() for k, v in obj.items()}
            _atomic_write(tmp / fname, lambda p: save_file(flat, str(p)))
        else:
            _atomic_write(tmp / fname, lambda p: torch.save(obj, p))
    _barrier()
    if mesh.rank == 0:
        meta = {**meta, "step": step, "mesh": dict(zip(DIMS, mesh.shape.sizes))}
        _atomic_write(tmp / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=1)))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write(final.parent / "latest", lambda p: p.write_text(final.name + "\n"))
    _barrier()
    return final


def _is_tensor_dict(obj) -> bool:
    return isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values())


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"checkpoint {path}: `latest` points to a folder without meta.json")
    return path


def read_meta(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: meta.json unreadable ({e})") from None


def load_part(path: Path, name: str, mesh: ParallelMesh, replicated: tuple[str, ...] | None,
              device: torch.device | str = "cpu"):
    """Read this rank's copy of a part written by `save` on the same layout."""
    tensors = True
    file = Path(path) / file_name(name, mesh, replicated, tensors)
    if not file.is_file():
        tensors = False
        file = Path(path) / file_name(name, mesh, replicated, tensors)
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path}: part file {file.name} is missing "
                              f"(was it written with a different layout?)")
    try:
        if tensors:
            return load_file(str(file), device=str(device))
        return torch.load(file, map_location=device, weights_only=False)
    except Exception as e:  # a truncated or corrupt file: say which
        raise CheckpointError(f"checkpoint {path}: part file {file.name} is corrupt ({type(e).__name__}: {e})") from None
