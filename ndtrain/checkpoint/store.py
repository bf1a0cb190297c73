"""Checkpoints on disk: one folder per step, written atomically, checked before it is used.

    checkpoints/step_0000008/
      meta.json               the step, the model, the config, the layout that wrote it,
                              each file's size and SHA-256, and each global tensor: its shape,
                              dtype and the pieces that hold it (file, key, box, flat range)
      rank-00003.safetensors  the pieces rank 3 wrote, each a 1-D tensor
    checkpoints/latest        the newest checkpoint's name (for people and tools)

Every tensor is stored under its global name ("weight/layers.0.attention.wq.weight",
"exp_avg/…", "exp_avg_sq/…") with the global shape and the piece of it each file holds
(checkpoint/slices.py), so any layout reads any checkpoint (checkpoint/layout.py).

Writing, durably: every rank writes its share into `step_N.tmp/`, hashing the bytes as they
go, and fsyncs it; rank 0 gathers the index, writes and fsyncs meta.json, fsyncs the folder,
renames it to `step_N/` and fsyncs `checkpoints/`. Then every rank checks the new checkpoint
as a resume would (`problem`: sizes and SHA-256), and only then does rank 0 point `latest`
at it and prune older ones. A crash at any moment (a machine's included: nothing is renamed
before its bytes are on the disk) leaves the previous good checkpoints complete, and at most
a `.tmp` folder, which the next save removes. Each of these phases ends with the ranks
agreeing (`_together`): an error on one rank is raised on every rank. `run.async_save` runs
this same `save` in a thread, over a process group of its own (checkpoint/background.py).

A write that fails (a full disk: ENOSPC, a quota: EDQUOT, any other OSError) raises
`CheckpointWriteError`, one line naming the path and, for a full disk, the bytes this
rank's file needs, and the bytes written and free when the write failed (measured before
the partial file is removed, which frees its bytes again); the failing rank removes its
partial file, `latest` still names the previous good checkpoint, and the trainer stops
(train/trainer.py).

Checking (`problem`): meta.json must parse and be of this format, every file must exist
with its recorded size (cheap, before anything heavier), and its SHA-256 must match (each
file hashed by one rank). `select` walks the checkpoints from the newest and takes the
first that passes, naming the file that disqualified each one it skips.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ndtrain.checkpoint.files import (DTYPES, fsync_dir, safetensors_size, sha256_of, write_durably,
                                     write_safetensors)
from ndtrain.checkpoint.slices import Piece
from ndtrain.model.args import ModelArgs, shape_problem

FORMAT, VERSION = "ndtrain-checkpoint", 2
_STEP = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk); the previous ones are untouched."""


def free_bytes(path: Path) -> int:
    """The bytes free on the filesystem that holds `path` (or its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def write_error(e: OSError, path: Path, need: int, step: int, free: int | None = None,
                written: int | None = None) -> CheckpointWriteError:
    """One line for a failed write of `path`, where this rank's share needs `need` bytes.
    `free` and `written`: the bytes free, and those of the file written, when it failed
    (measured before the partial file is removed, which frees its bytes again)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path) if free is None else free
        so_far = f"{written:,} written, " if written else ""
        return CheckpointWriteError(f"step {step}: no space left on the device writing {path}: this rank's share "
                                    f"of the checkpoint needs {need:,} bytes; when the write failed {so_far}{free:,} "
                                    "were free; the previous checkpoints are kept (free space, or lower "
                                    "train.keep_checkpoints, and run the command again to continue)")
    return CheckpointWriteError(f"step {step}: writing {path} failed ({e.strerror or e}); the previous checkpoints "
                                "are kept")


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def step_of(path: Path) -> int:
    return int(_STEP.fullmatch(Path(path).name.removesuffix(".replaced")).group(1))


def steps_of(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders (complete or not), newest first. A `step_N.replaced`
    counts where `step_N` is missing: a save of the same step that stopped while swapping
    the two (`_publish`)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = {p.name: p for p in root.iterdir() if p.is_dir() and _STEP.fullmatch(p.name)}
    for aside in root.glob("step_*.replaced"):
        found.setdefault(aside.name.removesuffix(".replaced"), aside)
    return sorted(found.values(), key=step_of, reverse=True)


def latest(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names (the newest one written), or None."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    return pointer.parent / pointer.read_text().strip()


def read_meta(path: Path) -> dict:
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: meta.json is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: meta.json is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: meta.json is not an {FORMAT} file")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {path}: format version {meta.get('version')}, this ndtrain reads {VERSION}")
    reason = meta_problem(meta)
    if reason:
        raise CheckpointError(f"checkpoint {path}: meta.json is damaged: {reason}")
    return meta


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(x) -> bool:
    return isinstance(x, list) and all(_is_int(v) and v >= 0 for v in x)


def _model_args_problem(args) -> str | None:
    if not isinstance(args, dict):
        return "model_args is not an object"
    try:
        problem = shape_problem(ModelArgs(**args))
    except (TypeError, ValueError, ZeroDivisionError) as e:
        return f"model_args is not a model ({type(e).__name__}: {e})"
    return f"model_args {problem[0]} = {problem[1]!r}: {problem[2]}" if problem else None


def meta_problem(meta: dict) -> str | None:
    """What in a parsed meta.json is not of the type its readers need (None: nothing): the
    step, the model's args, each file's size and hash, each tensor's shape, dtype and pieces."""
    if not _is_int(meta.get("step")) or meta["step"] < 0:
        return f"step is {meta.get('step')!r}, not a non-negative integer"
    if not isinstance(meta.get("saved_at", 0), (int, float)):
        return f"saved_at is {meta.get('saved_at')!r}, not a number"
    if "model_args" in meta:  # (a training checkpoint's; the store itself does not need one)
        problem = _model_args_problem(meta["model_args"])
        if problem:
            return problem
    files, tensors = meta.get("files"), meta.get("tensors")
    if not isinstance(files, dict) or not all(isinstance(f, dict) and _is_int(f.get("bytes")) and isinstance(
            f.get("sha256"), str) for f in files.values()):
        return "files is not an object of {name: {bytes, sha256}}"
    if not isinstance(tensors, dict):
        return "tensors is not an object"
    for key, t in tensors.items():
        if not (isinstance(t, dict) and _ints(t.get("shape")) and t.get("dtype") in DTYPES.values()
                and isinstance(t.get("pieces"), list)):
            return f"tensor {key!r} has no shape (a list of sizes), dtype ({', '.join(DTYPES.values())}) and pieces"
        for piece in t["pieces"]:
            if not (isinstance(piece, dict) and piece.get("file") in files and isinstance(piece.get("key"), str)
                    and _ints(piece.get("offsets")) and _ints(piece.get("box")) and _is_int(piece.get("start"))
                    and _is_int(piece.get("stop"))):
                return f"a piece of tensor {key!r} has no file of this checkpoint, key, offsets, box, start and stop"
    return None


def size_problem(path: Path, meta: dict) -> str | None:
    """What is missing or of the wrong size, checked with `stat` only."""
    for name, info in sorted(meta["files"].items()):
        file = Path(path) / name
        if not file.is_file():
            return f"{file} is missing"
        size = file.stat().st_size
        if size != info["bytes"]:
            return f"{file} is {size} bytes, meta.json says {info['bytes']} (truncated or overwritten)"
    return None


def _world(group=None) -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def problem(path: Path, group=None) -> str | None:
    """Why the checkpoint at `path` cannot be used, or None. Collective when distributed
    (over `group`, None: the default one): every rank checks sizes, each file's SHA-256 is
    computed by one rank, and every rank returns the same answer."""
    rank, world = _world(group)
    try:
        meta = read_meta(path)
        reason = size_problem(path, meta)
        if reason is None:
            names = sorted(meta["files"])
            for name in names[rank::world]:
                if sha256_of(Path(path) / name) != meta["files"][name]["sha256"]:
                    reason = f"{Path(path) / name} does not match its SHA-256 in meta.json (corrupted bytes)"
                    break
    except CheckpointError as e:
        reason = str(e)
    except OSError as e:
        reason = f"{path}: {e}"
    if world > 1:
        reasons = [None] * world
        dist.all_gather_object(reasons, reason, group=group)
        reason = next((r for r in reasons if r), None)
    return reason


def select(run_dir: Path, report=print) -> Path | None:
    """The newest checkpoint of the run that passes `problem`; `report(message)` is told
    about each newer one refused (on rank 0). Collective when distributed."""
    for path in steps_of(run_dir):
        reason = problem(path)
        if reason is None:
            return path
        if _world()[0] == 0:
            report(f"checkpoint {path.name} refused: {reason}; trying the previous one")
    return None


def save(run_dir: Path, step: int, entries: list[tuple[str, Piece, torch.Tensor]], meta: dict,
         keep: int = 0, group=None) -> Path:
    """Write a checkpoint: `entries` are this rank's share, (global tensor key, piece,
    1-D data). Collective over `group` (None: the default group). `keep` > 0 prunes all but
    the newest `keep` checkpoints, once the new one is durable and checked. Raises
    CheckpointError (older ones untouched) when the new one does not read back. Each phase
    ends with the ranks agreeing (`_together`): an error on one rank (a full disk) is raised
    on every rank, and nothing is renamed or pointed at after it."""
    rank, world = _world(group)
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    _together(lambda: rank == 0 and tmp.exists() and shutil.rmtree(tmp), group)
    # after it, every rank's file is on the disk
    gathered = _together(lambda: _write_share(tmp, rank, step, entries), group)
    _together(lambda: rank == 0 and _commit(tmp, final, _meta(step, meta, gathered), step), group)
    reason = problem(final, group=group)  # collective: what a resume would check, read back from the disk
    if reason is not None:
        raise CheckpointError(f"step {step}: the checkpoint just written does not read back ({reason}); "
                              "the previous checkpoints are kept")
    _together(lambda: rank == 0 and _point_latest(final, run_dir, step, keep), group)
    return final


def _write_share(tmp: Path, rank: int, step: int, entries: list) -> tuple[list, dict]:
    """This rank's file in `tmp` (fsynced), and its part of the index. A failed write
    removes the partial file and raises CheckpointWriteError."""
    name = f"rank-{rank:05d}.safetensors"
    plan = [(key, data.dtype, (data.numel(),), lambda d=data: d) for key, _, data in entries]
    need = safetensors_size(plan, {"format": FORMAT})
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        if not entries:
            return [], {}
        size, digest = write_safetensors(tmp / name, plan, {"format": FORMAT})
    except OSError as e:
        part = tmp / name
        written = part.stat().st_size if part.is_file() else None
        free = free_bytes(tmp) if e.errno in (errno.ENOSPC, errno.EDQUOT) else None  # before the unlink frees it
        part.unlink(missing_ok=True)
        raise write_error(e, Path(e.filename or part), need, step, free, written) from None
    return [(key, name, piece, DTYPES[data.dtype]) for key, piece, data in entries], \
        {name: {"bytes": size, "sha256": digest}}


def _commit(tmp: Path, final: Path, meta: dict, step: int) -> None:
    """Rank 0, once every file is durable: meta.json, the folder, the rename."""
    text = json.dumps(meta, indent=1)
    try:
        write_durably(tmp / "meta.json", text)
        fsync_dir(tmp)
        _publish(tmp, final)
    except OSError as e:
        raise write_error(e, Path(e.filename or tmp / "meta.json"), len(text), step) from None


def _point_latest(final: Path, run_dir: Path, step: int, keep: int) -> None:
    """Rank 0, once the new checkpoint reads back: `latest` names it, older ones pruned."""
    pointer = final.parent / "latest.partial"
    try:
        write_durably(pointer, final.name + "\n")
    except OSError as e:  # the new checkpoint is complete and checked: a resume finds it by its name
        raise write_error(e, pointer, len(final.name) + 1, step) from None
    os.replace(pointer, final.parent / "latest")
    fsync_dir(final.parent)
    prune(run_dir, step, keep)


def _together(fn, group=None) -> list:
    """Run `fn` on this rank, then agree: every rank's result (a list by rank), or, where any
    rank raised, that error raised on every rank (this rank's own first, else the lowest
    rank's). One all-gather when distributed; none alone."""
    rank, world = _world(group)
    if world == 1:
        return [fn()]
    try:
        mine, error = fn(), None
    except Exception as e:  # a crash (BaseException) is not agreed: the process is going
        mine, error = None, _portable(e)
    gathered = [None] * world
    dist.all_gather_object(gathered, (mine, error), group=group)
    if error is not None:
        raise error
    first = next((e for _, e in gathered if e is not None), None)
    if first is not None:
        raise first
    return [m for m, _ in gathered]


def _portable(e: Exception) -> Exception:
    """`e` if it survives pickling (to reach the other ranks as itself: an OSError keeps its
    errno and path), else a CheckpointError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return CheckpointError(f"{type(e).__name__}: {e}")


def _meta(step: int, meta: dict, gathered: list) -> dict:
    """meta.json: the caller's facts, every rank's files and where each global tensor's
    pieces are."""
    files: dict[str, dict] = {}
    tensors: dict[str, dict] = {}
    for part_index, part_files in gathered:
        files.update(part_files)
        for key, file, piece, dtype in part_index:
            t = tensors.setdefault(key, {"shape": list(piece.shape), "dtype": dtype, "pieces": []})
            t["pieces"].append({"file": file, "key": key, **piece.to_json()})
    return {"format": FORMAT, "version": VERSION, "step": step, "saved_at": time.time(), **meta,
            "files": files, "tensors": dict(sorted(tensors.items()))}


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished folder to its step's name, durably. A checkpoint already there
    (the same step saved again after a resume) is moved aside first and removed after."""
    replaced = final.with_name(final.name + ".replaced")
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        os.replace(final, replaced)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if replaced.exists():
        shutil.rmtree(replaced)


def prune(run_dir: Path, current: int, keep: int) -> None:
    """After saving step `current`: drop checkpoints newer than it (a future abandoned when
    an earlier one was resumed), leftover `.tmp` folders, and, with `keep` > 0, all but the
    `keep` newest. The one just written is always kept."""
    root = Path(run_dir) / "checkpoints"
    for leftover in (*root.glob("step_*.tmp"), *root.glob("step_*.replaced")):
        shutil.rmtree(leftover, ignore_errors=True)
    older = []
    for path in steps_of(run_dir):
        step = step_of(path)
        if step > current:
            shutil.rmtree(path, ignore_errors=True)
        elif step < current:
            older.append(path)
    if keep > 0:
        for path in older[keep - 1:]:
            shutil.rmtree(path, ignore_errors=True)
