"""The files that make a Hugging Face model usable beyond its weights, and how they travel
from a HF folder through runs and back out.

- Tokenizer files (tokenizer.json, tokenizer_config.json with its bos/eos/pad tokens and
  chat template, chat_template.jinja, special_tokens_map.json, ...): a run keeps them next
  to its tokenizer.json, as long as that tokenizer.json is the source's (an SFT run that adds
  the builtin template's tokens writes its own: data/template.py).
- generation_config.json: its `eos_token_id` (one id or a list: instruct models end turns
  with <|eot_id|>, <|im_end|>) is where `ndtrain generate` and HF `generate` stop. A
  fine-tuning run adds the ids its chat template ends answers with.
- config.json, kept in a run as `hf_config.json`: the family the model came from and the
  keys we do not own (token ids, dtype), so an export writes the same family and, unless
  told otherwise, the same dtype.

`carry` copies them from `model.init_from` (a HF folder, or another run) into a new run;
`export` writes them beside exported weights.
"""

from __future__ import annotations

import filecmp
import os
import tempfile
from contextlib import contextmanager
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt")
GENERATION = "generation_config.json"
HF_CONFIG = "hf_config.json"  # a HF source's config.json, as a run keeps it


def read_json(path: Path) -> dict | None:
    """A JSON object file, or None when it is missing or not an object."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def source_dir(init_from: str) -> tuple[Path, bool] | None:
    """(the folder model.init_from names, whether it is a HF folder); None without one."""
    kind, sep, path = init_from.partition(":")
    if not sep or kind not in ("hf", "run"):
        return None
    folder = Path(path).expanduser()
    if kind == "run" and (folder / "meta.json").is_file():  # a checkpoint folder: its run's files
        folder = folder.parent.parent
    return folder, kind == "hf"


def carry(init_from: str, run_dir: Path, stop_ids=()) -> None:
    """Copy the model files of `init_from` into `run_dir` where it has none yet (its own win),
    the tokenizer files only when run_dir's tokenizer.json is the source's; then add
    `stop_ids` (a chat template's) to the generation config's eos ids."""
    run_dir = Path(run_dir)
    found = source_dir(init_from) if init_from else None
    if found is not None:
        source, is_hf = found
        same_tokenizer = all((d / "tokenizer.json").is_file() for d in (source, run_dir)) and filecmp.cmp(
            source / "tokenizer.json", run_dir / "tokenizer.json", shallow=False)
        names = [(GENERATION, GENERATION), ("config.json" if is_hf else HF_CONFIG, HF_CONFIG)]
        if same_tokenizer:
            names += [(n, n) for n in TOKENIZER_FILES]
        for src, dst in names:
            if (source / src).is_file() and not (run_dir / dst).exists():
                shutil.copyfile(source / src, run_dir / dst)
    if stop_ids:
        add_eos_ids(run_dir, stop_ids)


def eos_ids(folder: Path) -> list[int] | None:
    """The eos ids of `folder`'s generation_config.json (None: none given)."""
    config = read_json(Path(folder) / GENERATION) or {}
    ids = config.get("eos_token_id")
    if ids is None:
        return None
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def add_eos_ids(folder: Path, ids) -> None:
    """generation_config.json's eos_token_id, extended by `ids` (written if missing)."""
    path = Path(folder) / GENERATION
    config = read_json(path) or {}
    merged = sorted(set(eos_ids(folder) or []) | {int(i) for i in ids})
    config["eos_token_id"] = merged[0] if len(merged) == 1 else merged
    path.write_text(json.dumps(config, indent=2) + "\n")


def export(run_dir: Path, out: Path, eot_token: str | None, eot_id: int | None, max_seq_len: int) -> None:
    """Beside exported weights in `out`: the run's tokenizer files and generation config,
    or, for a run that has none (a pretraining run of ours), a tokenizer_config.json naming
    the end-of-text token and a generation config that stops there."""
    run_dir, out = Path(run_dir), Path(out)
    for name in TOKENIZER_FILES + (GENERATION,):
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, out / name)
    if (out / "tokenizer.json").is_file() and not (out / "tokenizer_config.json").is_file() and eot_token:
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot_token, "model_max_length": max_seq_len},
            indent=1))
    if not (out / GENERATION).is_file() and eot_id is not None:
        add_eos_ids(out, [eot_id])


def check_export_dir(out: Path, overwrite: bool) -> None:
    """Refuse (ValueError) a file, or a non-empty `out` without `overwrite`."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError("is a file, not a folder")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not overwrite:
        raise ValueError(f"is not empty ({', '.join(present[:3])}{', ...' if len(present) > 3 else ''}); old weights "
                         "beside the new ones would be read too: choose a new folder, or add --overwrite to replace "
                         "its model files")


@contextmanager
def staged_export(out: Path, overwrite: bool):
    """A fresh folder beside `out` for an export to write into. When the export returns, its
    files replace `out`'s model files (`clear_for_export`); when it fails, the folder is
    removed and `out` is as it was: an export is never left half-written."""
    out = Path(out)
    check_export_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield stage
        clear_for_export(out, overwrite)
        out.mkdir(exist_ok=True)
        for p in sorted(stage.iterdir()):
            os.replace(p, out / p.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def clear_for_export(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty `out` (ValueError), or with `overwrite` remove what an export
    writes or what would be read in its place: weights of any format, their indexes, the
    config and the tokenizer files. Other files stay."""
    out = Path(out)
    check_export_dir(out, overwrite)
    if not out.is_dir():
        return
    written = set(TOKENIZER_FILES) | {GENERATION, "config.json"}
    for p in out.iterdir():
        weights = p.name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json"))
        if p.is_file() and (weights or p.name in written):
            p.unlink()
