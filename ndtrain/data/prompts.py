"""Where RL's prompts come from: a built-in verifiable task (`rl.task`, data/verifiable.py)
or your own file of questions and reference answers (`rl.data`).

`rl.data` is a JSONL or parquet file, or a folder of them (every `.jsonl` and `.parquet`
under it). Each record is a question and its answer (data/chat.py): `{"prompt": ...,
"answer": ...}` or `{"messages": [...], "answer": ...}`, rendered by the chat template
(`data.template`) exactly as `ndtrain sft` renders the same record. A record is named by
its file and line (`file.jsonl:12`; a parquet file's row, from 1) and held out when a hash
of that name says so (`data.val_fraction`): the very split `ndtrain sft` makes of the same
file, so an SFT warm-up on it never trains on a prompt RL evaluates.

Both sources answer `draw(seed, key, n, split)`: `n` problems of the training split (a
seeded sample, a pure function of the arguments) or of the held-out split.
"""

from __future__ import annotations

import random
from pathlib import Path

from ndtrain.data.chat import BadRecord, Conversation, parse_record, read_jsonl
from ndtrain.data.sft import split
from ndtrain.data.shards import DataError
from ndtrain.data.verifiable import Problem, draw_problems, make_task

SUFFIXES = (".jsonl", ".parquet")


class TaskPrompts:
    """A built-in task's problems, drawn on the fly."""

    def __init__(self, task):
        self.task = task
        self.name = task.name

    def draw(self, seed: int, key: str, n: int, split_name: str) -> list[Problem]:
        return draw_problems(self.task, seed, key, n, split_name)


class FilePrompts:
    """The records of `rl.data`, split into training and held-out prompts."""

    def __init__(self, source: str, val_fraction: float, on_bad_record: str = "error"):
        conversations, self.skipped = read_prompts(source, on_bad_record)
        train, held = split(conversations, val_fraction)
        self.name = Path(source).name
        self.splits = {"train": [_problem(c) for c in train], "held_out": [_problem(c) for c in held]}

    def draw(self, seed: int, key: str, n: int, split_name: str) -> list[Problem]:
        """Held out: the first `n`, spread evenly over the split (the same for every key).
        Training: `n` drawn without replacement while the split lasts (a seeded shuffle per
        draw), with replacement beyond."""
        pool = self.splits[split_name]
        if split_name == "held_out":
            n = min(n, len(pool))
            return [pool[i * len(pool) // n] for i in range(n)]
        rng = random.Random(f"{seed}/data/{key}")
        return rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]


def _problem(conv: Conversation) -> Problem:
    question = conv.prompt_turns[-1].content
    return Problem(question, conv.answer, conv)


def prompt_files(source: str) -> tuple[Path, list[Path]]:
    """(the folder keys are relative to, the files of `source`)."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise DataError(f"rl.data {source}: no .jsonl or .parquet files in this folder")
        return path, files
    if not path.is_file():
        raise DataError(f"rl.data {source}: no such file or folder")
    if path.suffix not in SUFFIXES:
        raise DataError(f"rl.data {source}: prompts are JSONL (.jsonl) or parquet (.parquet)")
    return path.parent, [path]


def read_prompts(source: str, on_bad_record: str = "error") -> tuple[list[Conversation], list[str]]:
    """Every question of `source` (and the records skipped)."""
    root, files = prompt_files(source)
    conversations, skipped = [], []
    for path in files:
        key = path.relative_to(root).as_posix()
        records = read_jsonl(path, key, on_bad_record) if path.suffix == ".jsonl" else read_parquet(path, key,
                                                                                                   on_bad_record)
        conversations += records.conversations
        skipped += records.skipped
    if len(conversations) < 2:
        raise DataError(f"rl.data {source}: {len(conversations)} usable record(s); need at least two (one to hold "
                        "out)" + (f"; skipped, first: {skipped[0]}" if skipped else ""))
    if not all(c.turns[-1].trained and c.turns[-1].role == "assistant" and c.chat for c in conversations):
        bad = next(c.key for c in conversations if not c.chat)
        raise DataError(f"rl.data {bad}: a record needs 'answer' (a reference answer to check against), with "
                        "'prompt' or 'messages'")
    return conversations, skipped


def read_parquet(path: Path, key_prefix: str, on_bad_record: str = "error"):
    """The records of a parquet file, one per row (a prompt file fits in memory)."""
    import pyarrow.parquet as pq

    from ndtrain.data.chat import Records
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds on a corrupt file
        raise DataError(f"rl.data {path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    out = Records([])
    for i, row in enumerate(rows, start=1):
        try:
            turns, chat = parse_record(row)
        except BadRecord as e:
            if on_bad_record == "error":
                raise DataError(f"{path}:{i}: {e} (data.on_bad_record=skip leaves such records out)") from None
            out.skipped.append(f"{path}:{i}: {e}")
            continue
        out.conversations.append(Conversation(f"{key_prefix}:{i}", turns, chat))
    return out


def prompt_source(cfg):
    """The source `cfg.rl` names: rl.data's file, or rl.task's problems."""
    r = cfg.rl
    if r.data:
        return FilePrompts(r.data, cfg.data.val_fraction, cfg.data.on_bad_record)
    return TaskPrompts(make_task(r.task, r.size, r.reverse_answer))
