"""Preference pairs for DPO: records → a prompt with a chosen and a rejected answer, rendered
by the chat template, split, fitted to `seq_len` and laid out one pair per row.

A JSONL line holds one pair in one of three shapes (as TRL reads them):
- `{"prompt": "...", "chosen": "...", "rejected": "..."}`: plain text, no chat template (the
  answer follows the prompt directly, closed by end-of-text), as SFT's prompt/completion;
- `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`: a chat whose
  answers are the assistant messages of `chosen` and `rejected`;
- `{"chosen": [messages], "rejected": [messages]}`: two whole chats, equal but for their last
  turn, the assistant's, which is the choice.

Only the choice's tokens (and the marker closing it) are the answer; earlier assistant
turns are context. A bad record (not JSON, a field missing, an empty choice, chats whose
prompts differ, an unknown role) is reported as `FILE:LINE: why`, and `data.on_bad_record`
stops or skips it as for SFT.

A pair whose chosen conversation equals its rejected one holds no preference (its loss is
log 2 whatever the model, its gradient zero): it is left out, counted in one line of the
data's description, and a source of nothing else is refused.

A row holds the pair's two rendered examples one after the other, each with its own
positions and document id (the packing of data/packing.py), so the chosen answer never
attends to the rejected one. Per target, `weights` is +1 on the chosen answer's tokens and
−1 on the rejected one's, so Σ weight · log p is the policy's log-ratio of the pair. A pair
longer than the row is left out, and counted.

The embedded set `stdlib-pairs` (`stdlib_pairs`): functions of the standard library with a
short body holding a quote (data/instructions.py), the prompt asking for `"` or `'` quotes
(a coin per function), the chosen answer the body with its quotes written as asked, the
rejected one the same body with them written the other way.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from ndtrain.data import instructions
from ndtrain.data.batch import IGNORE
from ndtrain.data.chat import BadRecord, Conversation, Turn, _check_turns, _messages, read_records
from ndtrain.data.packing import pack
from ndtrain.data.sft import Described, ShortSequence, load_records, split
from ndtrain.data.shards import DataError
from ndtrain.data.template import Example, render

EMBEDDED_NAME = "stdlib-pairs"
CHOSEN, REJECTED = 0, 1  # the document ids of a row's two examples


@dataclass
class Pair:
    key: str
    chosen: Conversation
    rejected: Conversation


def _choice(prompt: list[Turn], answer: list[Turn], key: str, chat: bool) -> Conversation:
    _check_turns(prompt + answer)
    return Conversation(key, prompt + answer, chat)


def parse_pair(record, key: str) -> Pair:
    """A Pair from one decoded JSON line; raises BadRecord with the reason."""
    if not isinstance(record, dict):
        raise BadRecord("a record must be a JSON object")
    missing = [f for f in ("chosen", "rejected") if f not in record]
    if missing:
        raise BadRecord(f"a preference record needs 'chosen' and 'rejected' (missing {', '.join(missing)})")
    prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise BadRecord("'chosen' and 'rejected' are strings: 'prompt' must be a string too")
        head = [Turn("user", prompt)]
        return Pair(key, *(_choice(head, [Turn("assistant", a, True)], key, False) for a in (chosen, rejected)))
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise BadRecord("'chosen' and 'rejected' must both be strings or both be lists of messages")
    if prompt is not None:
        head = _messages(prompt, "prompt", None)
        answers = [_messages(chosen, "chosen", "assistant"), _messages(rejected, "rejected", "assistant")]
        if any(t.role != "assistant" for a in answers for t in a):
            raise BadRecord("with a 'prompt', 'chosen' and 'rejected' may only hold assistant messages")
        return Pair(key, *(_choice(head, a, key, True) for a in answers))
    whole = [_messages(chosen, "chosen", None), _messages(rejected, "rejected", None)]
    if whole[0][:-1] != whole[1][:-1]:
        raise BadRecord("'chosen' and 'rejected' must be the same conversation but for the last (assistant) turn")
    if whole[0][-1].role != "assistant" or whole[1][-1].role != "assistant":
        raise BadRecord("the last turn of 'chosen' and of 'rejected' must be the assistant's: the choice")
    return Pair(key, *(_choice(w[:-1], [Turn("assistant", w[-1].content, True)], key, True) for w in whole))


QUOTE_ASKS = {'"': 'Write its strings in double quotes (").', "'": "Write its strings in single quotes (')."}


def asked_quote(key: str, index: int) -> str:
    """The quote the prompt of a file's `index`-th pair asks for: `"` and `'` in turn, from a
    fair coin per file (`key`), so both splits (made by file) ask for each about equally."""
    return '"' if (hashlib.sha256(key.encode()).digest()[0] + index) % 2 == 0 else "'"


def stdlib_pairs(cache_dir: str, max_lines: int = 8, max_chars: int = 320) -> list[Pair]:
    """The embedded set: each function of the standard library whose body has 1 to
    `max_lines` non-blank lines, at most `max_chars` characters and a quote character (and
    a prompt of at most `max_chars`). The prompt ends by asking for one quote style (a coin
    in turn within a file, `asked_quote`); the chosen answer is the body with every quote written in
    that style, the rejected one the same body in the other. Half the pairs prefer each
    style, so a drift towards either style, which training on labels that say nothing can
    still cause, moves as many held-out pairs one way as the other: only following the
    request, which the reference (fine-tuned on both answers) does not do, raises the
    held-out accuracy."""
    out, per_file = [], {}
    for conv in instructions.stdlib_functions(cache_dir):
        prompt, body = conv.turns[0].content, conv.answer
        lines = sum(1 for x in body.splitlines() if x.strip())
        if not 1 <= lines <= max_lines or len(body) > max_chars or len(prompt) > max_chars:
            continue
        forms = {'"': body.replace("'", '"'), "'": body.replace('"', "'")}
        if forms['"'] == forms["'"]:
            continue
        per_file[conv.key] = index = per_file.get(conv.key, -1) + 1
        asked = asked_quote(conv.key, index)
        other = "'" if asked == '"' else '"'
        head = [Turn("user", prompt.rstrip("\n") + "\n" + QUOTE_ASKS[asked])]
        out.append(Pair(conv.key, Conversation(conv.key, head + [Turn("assistant", forms[asked], True)]),
                        Conversation(conv.key, head + [Turn("assistant", forms[other], True)])))
    return out


@dataclass
class PairCounts:
    kept: int = 0
    dropped_long: int = 0  # both answers do not fit in train.seq_len

    def describe(self) -> str:
        return f"{self.kept:,} pairs" + (f", {self.dropped_long:,} longer than train.seq_len left out"
                                         if self.dropped_long else "")


@dataclass
class PreferenceData(Described):
    """Both splits as rendered (chosen, rejected) examples, and what was left out."""

    template: object  # data/template.BuiltinTemplate | HFTemplate
    train: list[tuple[Example, Example]]
    val: list[tuple[Example, Example]]
    counts: dict[str, PairCounts] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    identical: list[str] = field(default_factory=list)  # the keys of pairs whose two answers are equal

    def describe(self) -> str:
        line = (f"\nleft out {len(self.identical):,} pairs whose chosen answer equals the rejected one (nothing to "
                f"prefer: loss log 2 whatever the model), first: {self.identical[0]}" if self.identical else "")
        return super().describe() + line


def _read(path, key_prefix: str, on_bad_record: str):
    return read_records(path, key_prefix, parse_pair, on_bad_record)


def _render(template, pairs: list[Pair], seq_len: int) -> tuple[list[tuple[Example, Example]], PairCounts]:
    """The pairs that fit in a row; raises ShortSequence when none does."""
    chosen, rejected = render(template, [p.chosen for p in pairs]), render(template, [p.rejected for p in pairs])
    kept = [(c, r) for c, r in zip(chosen, rejected) if c.length + r.length <= seq_len]
    if not kept:
        shortest = min((c.length + r.length, p.key) for c, r, p in zip(chosen, rejected, pairs))
        raise ShortSequence(seq_len, *shortest)
    return kept, PairCounts(len(kept), len(pairs) - len(kept))


def load_pairs(source: str, on_bad_record: str = "error",
               cache_dir: str = "~/.cache/ndtrain") -> tuple[list[Pair], list[str], list[str]]:
    """Every pair of `source` (a JSONL file, a folder of them, or the embedded set) whose
    two answers differ, the records skipped, and the keys of the pairs left out because
    chosen equals rejected. Raises DataError on a bad record (data.on_bad_record=error), and
    when no pair is left."""
    embedded = {EMBEDDED_NAME: lambda: stdlib_pairs(cache_dir)}
    pairs, skipped = load_records(source, on_bad_record, _read, embedded, "preference data")
    identical = [p.key for p in pairs if p.chosen.turns == p.rejected.turns]
    if len(identical) == len(pairs):
        raise DataError(f"{source}: the chosen answer of every one of its {len(pairs):,} pairs equals the rejected "
                        f"one (first: {identical[0]}): there is no preference to learn")
    return [p for p in pairs if p.chosen.turns != p.rejected.turns], skipped, identical


def prepare_preferences(source: str, template, seq_len: int, val_fraction: float, on_bad_record: str = "error",
                        cache_dir: str = "~/.cache/ndtrain") -> PreferenceData:
    """Read, split (by key, as SFT), render and fit. Raises DataError (ShortSequence when no
    pair fits) on bad input."""
    pairs, skipped, identical = load_pairs(source, on_bad_record, cache_dir)
    train_p, val_p = split(pairs, val_fraction)
    splits, counts = {}, {}
    for name, group in (("train", train_p), ("val", val_p)):
        splits[name], counts[name] = _render(template, group, seq_len)
    return PreferenceData(template, splits["train"], splits["val"], counts, skipped, identical)


def pair_rows(pairs: list[tuple[Example, Example]], seq_len: int, pad_id: int):
    """One pair per row (data/packing.Rows): the chosen example (document 0), then the
    rejected one (document 1); `weights` +1 on the chosen answer's targets, −1 on the
    rejected one's, 0 elsewhere."""
    examples = [ex for pair in pairs for ex in pair]
    rows = pack(examples, seq_len, "bfd", pad_id, groups=[[2 * i, 2 * i + 1] for i in range(len(pairs))])
    trained = rows.targets != IGNORE
    sign = torch.where(rows.doc_ids == CHOSEN, 1.0, torch.where(rows.doc_ids == REJECTED, -1.0, 0.0))
    rows.weights = (sign * trained).to(torch.float64)
    return rows


def control_signs(seed: int, step: int, global_batch: int) -> torch.Tensor:
    """The negative control's labels for `step`'s global batch: +1 keeps a row's pair as it
    is, −1 swaps chosen and rejected (its weights negated). Exactly half the rows of every
    batch are swapped (an odd batch's last one by a fair coin), which ones drawn from
    (seed, step): the labels the control trains on carry no preference for any feature of
    the answers, not even a net one of a few percent, as independent coins would."""
    rng = np.random.default_rng([seed, step, 0xD90])
    order = rng.permutation(global_batch)
    swapped = global_batch // 2 + int(global_batch % 2 == 1 and rng.random() < 0.5)
    signs = np.ones(global_batch)
    signs[order[:swapped]] = -1.0
    return torch.from_numpy(signs)
