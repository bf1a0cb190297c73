"""Pieces of global tensors, and copying the overlap of two pieces.

A *piece* is what one file or one rank holds of a global tensor (a parameter of the whole
model, or one of its optimizer moments): a box of it (its offsets and shape, which may reach
past the global shape: tensor-parallel padding), of which it holds the flat range
[start, stop) in row-major order. A tensor-parallel chunk is a box held whole; a ZeRO shard
holds a flat range of a parameter (or of a parameter's tensor-parallel chunk), usually a
partial first row, whole rows and a partial last row. A piece's data is a 1-D tensor of
stop − start elements.

Any layout can read any other through one operation, `copy_overlap`: each piece is cut into
boxes that are contiguous in its flat order (`runs`, at most 2·ndim − 1 of them), clipped to
the global shape; the intersection of two such boxes is copied with two views, reading from
the source only the rows of its run that the intersection spans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Piece:
    shape: tuple[int, ...]  # the global tensor's shape
    offsets: tuple[int, ...]  # where the box starts in it
    box: tuple[int, ...]  # the box's shape
    start: int = 0  # the flat range of the box held (stop None: to the end)
    stop: int | None = None

    @property
    def end(self) -> int:
        return math.prod(self.box) if self.stop is None else self.stop

    @property
    def numel(self) -> int:
        return self.end - self.start

    @classmethod
    def whole(cls, shape) -> "Piece":
        shape = tuple(shape)
        return cls(shape, (0,) * len(shape), shape)

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "box": list(self.box), "start": self.start, "stop": self.end}

    @classmethod
    def from_json(cls, shape, d: dict) -> "Piece":
        return cls(tuple(shape), tuple(d["offsets"]), tuple(d["box"]), d["start"], d["stop"])


def contiguous_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[int, tuple, tuple]]:
    """The flat range [a, b) of a row-major array of `shape` as boxes that are each
    contiguous in flat order: [(flat position of the box's first element, offsets, shape)]."""
    if a >= b:
        return []
    if not shape:
        return [(0, (), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(a, inner), divmod(b, inner)

    def in_row(r: int, lo: int, hi: int):
        return [(r * inner + pos, (r, *off), (1, *sh)) for pos, off, sh in contiguous_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return in_row(r0, c0, c1)
    out = []
    if c0:
        out += in_row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append((r0 * inner, (r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])))
    if c1:
        out += in_row(r1, 0, c1)
    return out


@dataclass(frozen=True)
class Run:
    """A box of a piece that is contiguous in the piece's data: data[at : at + numel(shape)]
    viewed as `shape` is the box at global `offsets`; `lo`/`hi` clip it to the global shape."""

    at: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @property
    def volume(self) -> int:
        return math.prod(max(0, h - l) for l, h in zip(self.lo, self.hi))


def runs(p: Piece) -> list[Run]:
    out = []
    for pos, off, sh in contiguous_boxes(p.box, p.start, p.end):
        offsets = tuple(o + q for o, q in zip(p.offsets, off))
        lo = tuple(max(0, o) for o in offsets)
        hi = tuple(min(n, o + s) for n, o, s in zip(p.shape, offsets, sh))
        out.append(Run(pos - p.start, offsets, sh, lo, hi))
    return out


def real_numel(p: Piece) -> int:
    """Elements of the piece inside the global shape (the rest is padding)."""
    return sum(r.volume for r in runs(p))


def _narrow(t: torch.Tensor, origin: tuple, lo: tuple, hi: tuple) -> torch.Tensor:
    for d, (o, a, b) in enumerate(zip(origin, lo, hi)):
        if a - o or b - a != t.shape[d]:
            t = t.narrow(d, a - o, b - a)
    return t


def copy_overlap(dst: Piece, dst_data: torch.Tensor, src: Piece,
                 read: Callable[[int, int], torch.Tensor]) -> int:
    """Copy into `dst_data` (the 1-D data of piece `dst`) every element `src` holds of it.
    `read(lo, hi)` returns elements [lo, hi) of the source's data; only the rows each
    overlap spans are read. Returns the number of elements copied."""
    copied = 0
    src_runs = runs(src)
    for d in runs(dst):
        if d.volume == 0:
            continue
        target = None
        for s in src_runs:
            lo = tuple(max(a, b) for a, b in zip(d.lo, s.lo))
            hi = tuple(min(a, b) for a, b in zip(d.hi, s.hi))
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            if target is None:
                target = dst_data[d.at:d.at + math.prod(d.shape)].view(d.shape)
            if s.shape:  # read the rows of the source run that the overlap spans
                inner = math.prod(s.shape[1:])
                r0, r1 = lo[0] - s.offsets[0], hi[0] - s.offsets[0]
                rows = read(s.at + r0 * inner, s.at + r1 * inner).view(r1 - r0, *s.shape[1:])
                source = _narrow(rows, (s.offsets[0] + r0, *s.offsets[1:]), lo, hi)
            else:
                source = read(s.at, s.at + 1).view(())
            _narrow(target, d.offsets, lo, hi).copy_(source)
            copied += math.prod(h - l for l, h in zip(lo, hi))
    return copied
