"""The files and folders a config names: the data, tokenizer, run and cache paths checked
before anything starts (`check_files`), whether a folder is prepared data, whether a
directory can be written, whether a folder may become a run directory."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ndtrain.config.schema import Config, ConfigError

EMBEDDED_DATA = ("stdlib", "stdlib-functions", "stdlib-pairs")  # pretraining corpus, SFT instruction set, DPO pairs
# What ndtrain makes first in a folder it runs in: the run's lock (cli/run.py, before anything
# else), the checkpoints of `convert --from-hf`. A folder holding either is an ndtrain run.
RUN_MARKS = (".lock", "checkpoints")


def check_files(cfg: Config) -> None:
    """data.path and data.tokenizer exist; run.dir and the data cache can be written."""
    d, r = cfg.data, cfg.run
    if d.path not in EMBEDDED_DATA and not Path(os.path.expanduser(d.path)).exists():
        raise ConfigError("data.path", d.path, "path does not exist (use \"stdlib\" for the embedded corpus, "
                          "\"stdlib-functions\" for the embedded instruction set, \"stdlib-pairs\" for the embedded "
                          "preference pairs)")
    if d.tokenizer.startswith("hf:"):
        if not (Path(os.path.expanduser(d.tokenizer[3:])) / "tokenizer.json").is_file():
            raise ConfigError("data.tokenizer", d.tokenizer, "hf:DIR needs a Hugging Face model folder with a "
                                                             "tokenizer.json")
    elif d.tokenizer and not Path(os.path.expanduser(d.tokenizer)).is_file():
        raise ConfigError("data.tokenizer", d.tokenizer, "file does not exist")
    if r.dir:  # the default, runs/<task>-<time>, is checked where the CLI names it
        check_writable_dir("run.dir", r.dir)
        check_run_folder("run.dir", r.dir)
    if not is_prepared_folder(d.path):
        check_writable_dir("data.cache_dir", d.cache_dir)
    check_preset_vocabulary(cfg)


BPE_SIZED = ("tiny", "small", "tiny-moe", "small-moe")  # demo and test presets: the fresh BPE sizes them


def check_preset_vocabulary(cfg: Config) -> None:
    """A preset that names a vocabulary (125M: 32,000 tokens; 1B, 8B: Llama 3's 128,256) gets
    a tokenizer or an explicit model.vocab_size: otherwise the smaller fresh BPE of
    data.vocab_size would silently shrink it (the 1B preset with 4,096 tokens is 0.98 B
    parameters, not 1.24 B)."""
    from ndtrain.model.args import PRESETS, param_count
    m, d = cfg.model, cfg.data
    named = PRESETS[m.preset].vocab_size if m.preset in PRESETS and m.preset not in BPE_SIZED else None
    if named is None or m.vocab_size is not None or m.init_from or d.tokenizer or is_prepared_folder(d.path) \
            or named <= d.vocab_size:
        return
    shrunk = param_count(cfg.model_args(vocab_size=d.vocab_size)) / 1e9
    raise ConfigError("model.preset", m.preset, f"names a {named:,}-token vocabulary, but data.tokenizer is unset, so "
                      f"a fresh {d.vocab_size:,}-token BPE would make it a {shrunk:.2f} B-parameter model: set "
                      f"data.tokenizer (hf:DIR or a tokenizer.json of {named:,} tokens), or data.vocab_size={named} "
                      f"to train a BPE that size, or model.vocab_size={d.vocab_size} to train the smaller model "
                      "knowingly")


def is_prepared_folder(path: str) -> bool:
    """A folder `ndtrain prepare` wrote (read as is: no tokenizer training, no cache)."""
    return path != "stdlib" and (Path(path).expanduser() / "meta.json").is_file()


def check_run_folder(key: str, value: str) -> None:
    """A run writes only into a new folder, an empty one, or an ndtrain run (where the
    resume rules apply): raise ConfigError for any other existing folder, naming a few of
    the files ndtrain would write beside, or over (a user's own config.toml)."""
    path = Path(os.path.expanduser(value))
    if not path.is_dir() or any((path / mark).exists() for mark in RUN_MARKS):
        return
    held = sorted(p.name for p in path.iterdir())
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ConfigError(key, value, f"is a folder that is neither empty nor an ndtrain run (it holds {shown}); "
                          "choose a new or empty folder")


def check_out_folder(key: str, value: str, overwrite: bool = False) -> None:
    """The one rule of every command's `--out` (trace, bench; convert --to-hf adds that an
    ndtrain run is no model folder): a folder that can be written, and new, empty or an
    ndtrain run, unless `--overwrite` lets the command write beside (and over) what it
    holds. Raises ConfigError naming a few of the files."""
    check_writable_dir(key, value)
    if overwrite:
        return
    try:
        check_run_folder(key, value)
    except ConfigError as e:
        raise ConfigError(key, value, e.rule + ", or add --overwrite to write beside (and over) its files") from None


def check_writable_dir(key: str, value: str, path: str | Path | None = None) -> None:
    """Raise ConfigError unless a directory can be created or written at `path` (default:
    `value`). Permission bits cannot tell (root, read-only mounts), so the nearest existing
    directory is probed with a temporary directory, removed at once."""
    target = Path(os.path.expanduser(str(path if path is not None else value)))
    if target.exists() and not target.is_dir():
        raise ConfigError(key, value, "exists and is not a directory")
    parent = target
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(key, value, f"cannot be created: {parent} is a file")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ndtrain-probe-", dir=parent))
    except OSError as e:
        raise ConfigError(key, value, f"cannot be written: creating a directory in {parent} fails "
                          f"({e.strerror})") from None
