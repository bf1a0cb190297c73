"""Token streams and the stateless batch loader.

The global batch of step ``s`` is a pure function of ``(seed, s)``. Nothing else is
loader state, which buys two properties the engine relies on:

- layout invariance: every data-parallel or context-parallel rank asks for its own rows
  of the same global batch, whatever the layout, and they add up to what one device
  would see;
- exact resume: restarting at step ``s`` needs only ``s``.

Each epoch visits every window of the stream exactly once, in an order drawn from
``np.random.default_rng([seed, epoch])``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ndtrain.data.shards import DataError, read_shard

# Rows of one step straddle at most two epochs unless the batch is larger than an
# epoch; two cached permutations keep the common case free of recomputation.
PERMUTATIONS_CACHED = 2


class TokenStream:
    """A split's shards, read as one long sequence of tokens without copying them."""

    def __init__(self, shard_paths: Sequence[str | Path]):
        self.paths = [Path(p) for p in shard_paths]
        self._shards = [read_shard(p) for p in self.paths]
        sizes = [len(s) for s in self._shards]
        # _starts[i] is the stream position of shard i's first token; the last entry is the total.
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream, crossing shard boundaries as needed."""
        if not 0 <= start <= stop <= len(self):
            raise DataError(f"token slice [{start}, {stop}) lies outside a stream of {len(self)} tokens")
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        shard = first
        while start < stop:
            offset = start - int(self._starts[shard])
            take = min(stop - start, len(self._shards[shard]) - offset)
            pieces.append(self._shards[shard][offset : offset + take])
            start += take
            shard += 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.uint32)


class EpochOrder:
    """Which of `n` items global sample `k` reads: epoch k // n visits every item once, in an
    order drawn from ``np.random.default_rng([seed, epoch])`` (or in order, unshuffled).
    `seed` may be a tuple of integers (a mixture's source j draws from ``[seed, j, epoch]``)."""

    def __init__(self, n: int, seed: int | tuple[int, ...], shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._key = list(seed) if isinstance(seed, tuple) else [seed]
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng(self._key + [epoch]).permutation(self.n)
            self._perms[epoch] = perm
            if len(self._perms) > PERMUTATIONS_CACHED:
                self._perms.popitem(last=False)
        return perm

    def __getitem__(self, sample: int) -> int:
        epoch, index = divmod(sample, self.n)
        return int(self._permutation(epoch)[index]) if self.shuffle else index


def check_rows(step: int, start: int, stop: int, global_batch: int) -> None:
    if step < 0 or not 0 <= start <= stop <= global_batch:
        raise DataError(
            f"rows [{start}, {stop}) of step {step}: need step >= 0 and "
            f"0 <= start <= stop <= global_batch ({global_batch})"
        )


class BatchLoader:
    """Cuts a stream into windows of ``seq_len + 1`` tokens and serves global batches by step."""

    def __init__(self, stream: TokenStream, seq_len: int, global_batch: int, seed: int, shuffle: bool = True):
        if seq_len < 1 or global_batch < 1:
            raise DataError(f"seq_len {seq_len} and global_batch {global_batch} must both be at least 1")
        self.stream = stream
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        # Windows share their boundary token (one window's last target is the next
        # window's first input), so no token is skipped as a target except the first.
        self.windows = (len(stream) - 1) // seq_len
        if self.windows == 0:
            raise DataError(
                f"token stream of {len(stream)} tokens is too short for seq_len {seq_len}: "
                f"one window needs {seq_len + 1} tokens"
            )
        self.order = EpochOrder(self.windows, seed, shuffle)

    def epoch_of(self, step: int) -> int:
        """The epoch of the first row of ``step``'s global batch."""
        return step * self.global_batch // self.windows

    def window_of(self, sample: int) -> int:
        """The window that global sample ``sample`` (counted from step 0, row 0) reads."""
        return self.order[sample]

    def rows(self, step: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, int64 ``[stop - start, seq_len]``, for rows ``start..stop-1`` of ``step``."""
        check_rows(step, start, stop, self.global_batch)
        first = step * self.global_batch
        batch = np.empty((stop - start, self.seq_len + 1), dtype=np.int64)
        for row, sample in enumerate(range(first + start, first + stop)):
            batch[row] = self.window(self.window_of(sample))
        return shifted(batch)

    def window(self, w: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of window ``w``."""
        return self.stream.slice(w * self.seq_len, w * self.seq_len + self.seq_len + 1)


def shifted(batch: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of rows of ``seq_len + 1`` tokens: each row without its last token,
    and without its first."""
    return (torch.from_numpy(np.ascontiguousarray(batch[:, :-1])),
            torch.from_numpy(np.ascontiguousarray(batch[:, 1:])))


class RowLoader:
    """Global batches of prepared rows (data/packing.Rows), by step: the same pure function
    of (seed, step) as BatchLoader. `wrap=False` serves the rows once, in order, and empty
    rows after the last (an evaluation pass over every row, counted once)."""

    def __init__(self, rows, global_batch: int, seed: int, shuffle: bool = True, wrap: bool = True):
        if len(rows) == 0:
            raise DataError("no rows to serve")
        self.rows, self.global_batch, self.wrap = rows, global_batch, wrap
        self.order = EpochOrder(len(rows), seed, shuffle)

    @property
    def batches_per_pass(self) -> int:
        return -(-len(self.rows) // self.global_batch)

    def batch(self, step: int, start: int, stop: int):
        """Rows ``start..stop-1`` of ``step``'s global batch, as a MicroBatch."""
        check_rows(step, start, stop, self.global_batch)
        first = step * self.global_batch
        samples = range(first + start, first + stop)
        index = [self.order[k] if self.wrap else (k if k < len(self.rows) else -1) for k in samples]
        return self.rows.batch(torch.tensor(index, dtype=torch.long))
