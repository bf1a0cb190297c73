"""Rows of `seq_len` positions from rendered examples: one example per row, padded, or
several per row, packed by best-fit decreasing.

An example of n tokens fills n − 1 positions: token i is the input at its position and
token i + 1 its target, IGNORE unless i + 1 is trained. In a packed row every example
keeps its own RoPE positions (0, 1, ... from its first token) and its own document id,
so attention never crosses from one example into another (model/llama.py: a document mask,
or flex_attention's block mask on CUDA)
and a packed example computes exactly what it computes alone in a padded row. Padding is
a document of its own with IGNORE targets: nothing attends to it and it adds nothing to
the loss.

Best-fit decreasing: the examples from longest to shortest, each into the open row whose
free space is smallest among those it fits, or a new row. It is the classic bin-packing
heuristic (at most 11/9 of the optimal number of rows plus a constant).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np
import torch

from ndtrain.data.batch import IGNORE, MicroBatch
from ndtrain.data.shards import DataError
from ndtrain.data.template import Example

PAD_DOC = -1  # the document id of padding
PACKINGS = ("bfd", "none")  # data.packing
TRUNCATIONS = ("keep_start", "drop")  # data.truncate


@dataclass
class FitCounts:
    kept: int = 0
    truncated: int = 0  # cut to seq_len (data.truncate=keep_start)
    dropped_long: int = 0  # longer than seq_len (data.truncate=drop)
    dropped_no_answer: int = 0  # nothing trained left within seq_len after the cut

    def describe(self) -> str:
        parts = [f"{self.kept:,} examples"]
        if self.truncated:
            parts.append(f"{self.truncated:,} truncated to train.seq_len")
        if self.dropped_long:
            parts.append(f"{self.dropped_long:,} longer than train.seq_len dropped")
        if self.dropped_no_answer:
            parts.append(f"{self.dropped_no_answer:,} dropped (no answer token within train.seq_len)")
        return ", ".join(parts)


def fit_examples(examples: list[Example], seq_len: int, truncate: str) -> tuple[list[Example], FitCounts, list[int]]:
    """Examples that fit in `seq_len` positions: longer ones cut to their first seq_len + 1
    tokens (`keep_start`) or left out (`drop`); one with no trained target left is left out.
    Every case is counted. Also returns the indices of the examples kept."""
    if truncate not in TRUNCATIONS:
        raise DataError(f"truncate {truncate!r}: choose {' or '.join(TRUNCATIONS)}")
    kept, counts, index = [], FitCounts(), []
    for i, ex in enumerate(examples):
        if ex.length > seq_len:
            if truncate == "drop":
                counts.dropped_long += 1
                continue
            ex = Example(ex.tokens[:seq_len + 1], ex.trained[:seq_len + 1])
            counts.truncated += 1
        if not ex.trained[1:].any():
            counts.dropped_no_answer += 1
            continue
        kept.append(ex)
        index.append(i)
    counts.kept = len(kept)
    return kept, counts, index


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `capacity`, by best-fit decreasing.
    Deterministic: ties go to the lower index and the older bin."""
    if any(n > capacity or n < 1 for n in lengths):
        raise ValueError(f"every length must lie in 1..{capacity}")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        j = bisect_left(free, (n, -1))  # the tightest bin with room
        if j == len(free):
            bins.append([i])
            space, b = capacity - n, len(bins) - 1
        else:
            space, b = free.pop(j)
            bins[b].append(i)
            space -= n
        if space:
            insort(free, (space, b))
    return bins


@dataclass
class Rows:
    """Fixed-length rows, ready to be served as micro-batches."""

    tokens: torch.Tensor  # [rows, seq_len]
    targets: torch.Tensor
    positions: torch.Tensor | None  # None: 0..seq_len-1 in every row (one example per row)
    doc_ids: torch.Tensor | None  # None: one document per row
    used: torch.Tensor  # [rows] positions holding examples; padding fills each row's rest
    examples: int  # examples held
    weights: torch.Tensor | None = None  # [rows, seq_len] per-target loss weights (DPO: +1 chosen, −1 rejected)
    ref_logprobs: torch.Tensor | None = None  # [rows, seq_len] what the objective subtracts (DPO: the reference's)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def padding_fraction(self) -> float:
        return 1.0 - float(self.used.sum()) / max(self.tokens.numel(), 1)

    def batch(self, index: torch.Tensor) -> MicroBatch:
        """The rows `index` (a row index of −1 is an empty row: all padding)."""
        index = torch.as_tensor(index, dtype=torch.long)
        empty = index < 0
        pick = lambda t: None if t is None else t[index.clamp_min(0)]  # noqa: E731
        mb = MicroBatch(pick(self.tokens), pick(self.targets).clone(), pick(self.positions), pick(self.doc_ids),
                        weights=pick(self.weights), ref_logprobs=pick(self.ref_logprobs))
        if empty.any():
            mb.targets[empty] = IGNORE
            if mb.doc_ids is not None:
                mb.doc_ids = mb.doc_ids.clone()
                mb.doc_ids[empty] = PAD_DOC
            for name in ("weights", "ref_logprobs"):
                if getattr(mb, name) is not None:
                    setattr(mb, name, getattr(mb, name).masked_fill(empty.unsqueeze(1), 0))
        return mb


def _inputs_and_targets(ex: Example) -> tuple[np.ndarray, np.ndarray]:
    targets = np.where(ex.trained[1:], ex.tokens[1:], IGNORE)
    return ex.tokens[:-1], targets


def pack(examples: list[Example], seq_len: int, packing: str, pad_id: int,
         groups: list[list[int]] | None = None) -> Rows:
    """Rows of `seq_len` positions holding `examples` (which must fit: see fit_examples).
    `groups`: the examples of each row, in order, chosen by the caller (DPO: a pair per row),
    laid out as packed rows."""
    if packing not in PACKINGS:
        raise DataError(f"packing {packing!r}: choose {' or '.join(PACKINGS)}")
    if groups is None:
        groups = (best_fit_decreasing([ex.length for ex in examples], seq_len) if packing == "bfd"
                  else [[i] for i in range(len(examples))])
    n = len(groups)
    tokens = np.full((n, seq_len), pad_id, dtype=np.int64)
    targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    positions = np.zeros((n, seq_len), dtype=np.int64)
    doc_ids = np.full((n, seq_len), PAD_DOC, dtype=np.int64)
    lengths = np.zeros(n, dtype=np.int64)
    for r, group in enumerate(groups):
        at = 0
        for d, i in enumerate(group):
            x, y = _inputs_and_targets(examples[i])
            end = at + len(x)
            tokens[r, at:end], targets[r, at:end] = x, y
            positions[r, at:end], doc_ids[r, at:end] = np.arange(len(x)), d
            at = end
        positions[r, at:] = np.arange(seq_len - at)
        lengths[r] = at
    t = torch.from_numpy
    if packing == "bfd":
        return Rows(t(tokens), t(targets), t(positions), t(doc_ids), t(lengths), len(examples))
    # One example per row, from position 0: plain causal attention needs no mask.
    return Rows(t(tokens), t(targets), None, None, t(lengths), len(examples))
