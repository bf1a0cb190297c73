"""Supervised fine-tuning records: chat conversations read from JSONL, checked line by line.

A line holds one record in one of these shapes:
- `{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}`, a chat;
- `{"prompt": ..., "completion": ...}`: two strings (plain text, no chat template: the
  completion follows the prompt directly, as in TRL), or two lists of messages (a chat
  whose last turns, the completion, are the answer);
- `{"prompt": ..., "answer": ...}` or `{"messages": [...], "answer": ...}`: a question and
  its reference answer (RL's `rl.data`, whose SFT warm-up reads the same file), a chat: the
  prompt (a string is one user turn; messages are the turns before the answer, their
  assistant turns context) then the answer as the assistant's turn. A number answer is
  written as text.

A record is bad when its line is not UTF-8 text (never replaced and trained on), is not
JSON, has neither shape, names a role the template
does not know, has an empty answer, has no assistant turn to learn from, opens with the
assistant (no prompt) or does not end with the assistant's answer. Every bad
record is reported as `FILE:LINE: why`; `on_bad_record="error"` stops at the first one,
`"skip"` leaves them out and counts them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ndtrain.data.shards import DataError

ROLES = ("system", "user", "assistant")
BAD_RECORD_POLICIES = ("error", "skip")  # data.on_bad_record


@dataclass(frozen=True)
class Turn:
    role: str
    content: str
    trained: bool = False  # the loss covers this turn (the assistant's, or a completion)


@dataclass
class Conversation:
    """One example: its turns in order. `key` names it (`file:line`, or a file for the
    embedded set) and decides its split. `chat` is False for a plain prompt/completion
    pair, which is two untemplated texts."""

    key: str
    turns: list[Turn]
    chat: bool = True

    @property
    def prompt_turns(self) -> list[Turn]:
        """The turns before the last answer: what a model is asked at evaluation."""
        last = max(i for i, t in enumerate(self.turns) if t.trained)
        return self.turns[:last]

    @property
    def answer(self) -> str:
        """The last trained turn: the reference an evaluation compares with."""
        return next(t.content for t in reversed(self.turns) if t.trained)


@dataclass
class Records:
    conversations: list[Conversation]
    skipped: list[str] = field(default_factory=list)  # "file:line: why", one per skipped record


class BadRecord(ValueError):
    pass


def _messages(value, what: str, trained_role: str | None) -> list[Turn]:
    if not isinstance(value, list) or not value:
        raise BadRecord(f"{what} must be a non-empty list of messages")
    turns = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRecord(f"{what}[{i}] must be an object with string fields 'role' and 'content'")
        if m["role"] not in ROLES:
            raise BadRecord(f"{what}[{i}]: role {m['role']!r} is not one of the template's roles "
                            f"({', '.join(ROLES)})")
        turns.append(Turn(m["role"], m["content"], m["role"] == trained_role))
    return turns


def parse_record(record) -> tuple[list[Turn], bool]:
    """(turns, chat) of one decoded JSON line; raises BadRecord with the reason."""
    if not isinstance(record, dict):
        raise BadRecord("a record must be a JSON object")
    if "answer" in record and "completion" not in record:
        turns, chat = _question(record), True
    elif "messages" in record:
        turns, chat = _messages(record["messages"], "messages", "assistant"), True
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            turns, chat = [Turn("user", prompt), Turn("assistant", completion, True)], False
        elif isinstance(prompt, list) and isinstance(completion, list):
            answer = _messages(completion, "completion", "assistant")
            if any(t.role != "assistant" for t in answer):
                raise BadRecord("completion may only hold assistant messages")
            turns, chat = _messages(prompt, "prompt", None) + answer, True
        else:
            raise BadRecord("'prompt' and 'completion' must both be strings or both be lists of messages")
    else:
        raise BadRecord("a record needs 'messages', or 'prompt' and 'completion' (or 'answer')")
    _check_turns(turns)
    return turns, chat


def _question(record: dict) -> list[Turn]:
    """The turns of a prompt/answer record: the prompt's, then the answer's."""
    answer = record["answer"]
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise BadRecord("'answer' must be a string (or a number)")
    if "messages" in record:
        turns = _messages(record["messages"], "messages", None)
    elif isinstance(record.get("prompt"), str):
        turns = [Turn("user", record["prompt"])]
    elif isinstance(record.get("prompt"), list):
        turns = _messages(record["prompt"], "prompt", None)
    else:
        raise BadRecord("a record with 'answer' needs 'prompt' (a string or a list of messages) or 'messages'")
    if turns[-1].role == "assistant":
        raise BadRecord("the prompt ends with the assistant's turn; the answer is the assistant's")
    return turns + [Turn("assistant", answer, True)]


def _check_turns(turns: list[Turn]) -> None:
    if not any(t.role == "assistant" for t in turns):
        raise BadRecord("no assistant turn: nothing to learn from")
    if turns[0].role == "assistant":
        raise BadRecord("the first turn is the assistant's: there is no prompt to answer")
    if turns[-1].role != "assistant":
        raise BadRecord(f"the last turn is the {turns[-1].role}'s; a conversation must end with the assistant's answer")
    if any(t.role == "system" for t in turns[1:]):
        raise BadRecord("a system message may only come first")
    for t in turns:
        if t.trained and not t.content.strip():
            raise BadRecord("an assistant turn is empty")
        try:
            t.content.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRecord(f"a {t.role} turn holds a lone surrogate escape (\\u{ord(e.object[e.start]):04x}), "
                            "half of a UTF-16 pair, not a character") from None


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    # Only "\n" ends a line: a JSON string may hold U+2028 and friends unescaped. Bytes: each
    # line is decoded on its own (`_text`), so one that is not UTF-8 is a bad record of its
    # own, never silently replaced.
    try:
        with open(path, "rb") as f:
            yield from enumerate(f, start=1)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def _text(raw: bytes) -> str:
    """A line as text; BadRecord when it is not UTF-8 (trained on, U+FFFD would stand in)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)") from None


def read_jsonl(path: str | Path, key_prefix: str, on_bad_record: str = "error") -> Records:
    """Every record of a JSONL file; blank lines are ignored."""
    return read_records(path, key_prefix, lambda record, key: Conversation(key, *parse_record(record)), on_bad_record)


def read_records(path: str | Path, key_prefix: str, build, on_bad_record: str = "error") -> Records:
    """`build(record, key)` of every record of a JSONL file (it raises BadRecord on a bad
    one), in `Records.conversations`; blank lines are ignored."""
    if on_bad_record not in BAD_RECORD_POLICIES:
        raise DataError(f"on_bad_record {on_bad_record!r}: choose error or skip")
    path = Path(path)
    out = Records([])
    for lineno, raw in _lines(path):
        if not raw.strip():
            continue
        try:
            line = _text(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadRecord(f"not valid JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise BadRecord("JSON nested too deeply to read") from None
            item = build(record, f"{key_prefix}:{lineno}")
        except BadRecord as e:
            where = f"{path}:{lineno}: {e}"
            if on_bad_record == "error":
                raise DataError(where + " (data.on_bad_record=skip leaves such records out)") from None
            out.skipped.append(where)
            continue
        out.conversations.append(item)
    return out
