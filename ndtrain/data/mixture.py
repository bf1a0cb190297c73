"""Weighted mixtures of sources: which source each row of each global batch reads.

Sampling is at the token level. Every row of a global batch is one window of
``seq_len + 1`` tokens of one source, so a source's share of the trained tokens is its
share of the rows. The rows of step s are apportioned before they are drawn: source j's
count after step s, C_j(s+1), follows its target w_j · (s+1) · G (G = train.global_batch)
by the largest deficit (`apportion`), so every C_j stays within one row of its target after
every step (tests/test_mixture.py checks it for random weights) and a source's share of
the first N rows is within 1/N of its weight. The rows of one step are then put in an order
drawn from ``default_rng([seed, MIX_KEY, s])``, so every data-parallel rank reads a mix.

Row r of step s reads source j's sample C_j(s) + (rows of j before r in step s); source j
visits its windows once per pass, each pass in an order drawn from ``[seed, j, pass]``
(`loader.EpochOrder`). A source that runs out starts a new pass in a new order.

Everything here is a pure function of (seed, weights, global batch, step): no state, so
every layout asks for its rows of the same batches and a resumed run, under any layout,
continues with exactly the batches of an uninterrupted one. The counts C(s) are computed
step by step from the last step asked for (or the nearest anchor kept every
`ANCHOR_EVERY` steps), a few microseconds a step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ndtrain.data.loader import BatchLoader, TokenStream, check_rows, shifted
from ndtrain.data.shards import DataError

MIX_KEY = 0x6D6978  # "mix": the random stream of each step's row order
ANCHOR_EVERY = 4096


def apportion(deficit: Sequence[float], total: int) -> list[int]:
    """Non-negative integers summing to `total`, each as close to its `deficit` as the sum
    allows: the floors, then one more for the largest remaining deficits (one fewer for the
    smallest, when floors of several sources already over-serve). Plain Python floats (IEEE
    doubles, as numpy's): a few sources cost less this way than numpy's per-call overhead."""
    q = [max(math.floor(d), 0) for d in deficit]
    left = total - sum(q)
    while left > 0:
        j = max(range(len(q)), key=lambda i: deficit[i] - q[i])
        q[j], left = q[j] + 1, left - 1
    while left < 0:
        j = min((i for i in range(len(q)) if q[i] > 0), key=lambda i: deficit[i] - q[i])
        q[j], left = q[j] - 1, left + 1
    return q


class MixturePlan:
    """Which source each row of each global batch reads, and which of its samples."""

    def __init__(self, weights: Sequence[float], global_batch: int, seed: int):
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise DataError(f"mixture weights {list(weights)}: need one finite weight > 0 per source")
        # Relative: normalised to sum 1, and rounded so that weights equal in meaning (7:3 and
        # 0.7:0.3, whose float sums differ in the last bit) give the same plan.
        self.weights = np.round(w / w.sum(), 12)
        self._w = [float(x) for x in self.weights]
        self.global_batch, self.seed = global_batch, seed
        zero = (0,) * len(w)
        self._anchors = {0: zero}
        self._last = (0, zero)

    def _quota(self, step: int, before: Sequence[int]) -> list[int]:
        target = (step + 1) * self.global_batch
        return apportion([w * target - c for w, c in zip(self._w, before)], self.global_batch)

    def quota(self, step: int, before: Sequence[int]) -> np.ndarray:
        """Rows per source in step `step`, given the counts `before` it."""
        return np.asarray(self._quota(step, before), dtype=np.int64)

    def _counts(self, step: int) -> tuple[int, ...]:
        s, c = self._last
        if step < s:
            s = step // ANCHOR_EVERY * ANCHOR_EVERY
            c = self._anchors[s]
        while s < step:
            c = tuple(a + b for a, b in zip(c, self._quota(s, c)))
            s += 1
            if s % ANCHOR_EVERY == 0:
                self._anchors.setdefault(s, c)
        self._last = (s, c)
        return c

    def counts(self, step: int) -> np.ndarray:
        """Rows each source served in steps 0..step−1."""
        return np.asarray(self._counts(step), dtype=np.int64)

    def step_sources(self, step: int) -> np.ndarray:
        """The source of each of the global batch's rows of `step`."""
        q = self.quota(step, self.counts(step))
        rows = np.repeat(np.arange(len(q)), q)
        return np.random.default_rng([self.seed, MIX_KEY, step]).permutation(rows)

    def samples(self, step: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's sample number) of rows start..stop−1 of `step`."""
        src = self.step_sources(step)
        index = np.empty(len(src), dtype=np.int64)
        before = self.counts(step)
        for j in range(len(self.weights)):
            mine = src == j
            index[mine] = before[j] + np.arange(int(mine.sum()))
        return src[start:stop], index[start:stop]


class MixtureLoader:
    """Global batches of a mixture by step: BatchLoader's interface, rows from several streams."""

    def __init__(self, streams: Sequence[TokenStream], weights: Sequence[float], seq_len: int,
                 global_batch: int, seed: int, names: Sequence[str] = ()):
        self.names = list(names) or [f"source {j}" for j in range(len(streams))]
        self.plan = MixturePlan(weights, global_batch, seed)
        self.seq_len, self.global_batch = seq_len, global_batch
        self.sources = []
        for j, stream in enumerate(streams):
            try:
                self.sources.append(BatchLoader(stream, seq_len, global_batch, (seed, j)))
            except DataError as e:
                raise DataError(f"data source {self.names[j]!r}: {e}") from None

    def windows(self) -> list[int]:
        """Windows of ``seq_len + 1`` tokens in each source: the samples of one pass."""
        return [s.windows for s in self.sources]

    def rows(self, step: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, int64 ``[stop - start, seq_len]``, for rows ``start..stop-1`` of ``step``."""
        check_rows(step, start, stop, self.global_batch)
        src, index = self.plan.samples(step, start, stop)
        batch = np.empty((stop - start, self.seq_len + 1), dtype=np.int64)
        for row, (j, i) in enumerate(zip(src, index)):
            loader = self.sources[j]
            batch[row] = loader.window(loader.window_of(int(i)))
        return shifted(batch)

    def source_tokens(self, steps: int) -> dict[str, int]:
        """Tokens trained from each source in steps 0..steps−1 (targets: seq_len a row)."""
        return {n: int(c) * self.seq_len for n, c in zip(self.names, self.plan.counts(steps))}

    def passes(self, steps: int, repeat: Sequence[bool]) -> list[str]:
        """What `steps` steps read of each source: a line for each source read more than once
        (it repeats, each pass in a new order); a DataError for one that may not repeat."""
        lines = []
        for name, rows, windows, again in zip(self.names, self.plan.counts(steps), self.windows(), repeat):
            if rows <= windows:
                continue
            if not again:
                raise DataError(f"data source {name!r} runs out: its {windows:,} windows of {self.seq_len + 1} "
                                f"tokens are fewer than the {int(rows):,} rows train.steps = {steps} draws from it, "
                                "and its repeat = false; add data, lower its weight or train.steps, or set repeat = true")
            lines.append(f"data source {name!r} repeats: the run reads {int(rows):,} rows of its {windows:,} windows "
                         f"({rows / windows:.2f} passes), each pass in a new order")
        return lines


@dataclass
class Source:
    """One prepared source of a mixture."""

    name: str
    weight: float
    repeat: bool
    data: object  # PreparedData


class PreparedMixture:
    """Prepared sources that share one tokenizer: what PreparedData offers the trainer (the
    vocabulary, the tokenizer, a baseline, `verify`), plus the sources themselves."""

    def __init__(self, sources: Sequence[Source]):
        self.sources = list(sources)
        first = self.sources[0].data
        tokenizer = (first.path / "tokenizer.json").read_bytes()
        for s in self.sources[1:]:
            if (s.data.path / "tokenizer.json").read_bytes() != tokenizer:
                raise DataError(f"data source {s.name!r} ({s.data.path}) was tokenized with another tokenizer than "
                                f"{self.sources[0].name!r} ({first.path}); a mixture shares one tokenizer: prepare "
                                "both with the same data.tokenizer")
        self.path = first.path  # where tokenizer.json lies
        self.vocab_size = max(s.data.vocab_size for s in self.sources)
        self.eot_id = first.eot_id
        total = sum(s.weight for s in self.sources)
        # The unigram loss of each source's validation split, weighted as the sources are.
        self.unigram_val_loss = sum(s.weight / total * s.data.unigram_val_loss for s in self.sources)
        self.meta = {k: sum(s.data.meta[k] for s in self.sources) for k in ("train_tokens", "val_tokens")}

    def tokenizer(self):
        return self.sources[0].data.tokenizer()

    def verify(self) -> None:
        for s in self.sources:
            s.data.verify()
