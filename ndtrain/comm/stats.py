"""Byte accounting for every collective, per mesh group and per kind.

The group is a dimension (`tp`, `pp`, `dp_replicate`) or a composite of them (`dp_cp`,
`dp_shard_cp`), by the name the collective was called with; the kind is `all_reduce`,
`all_gather`, `reduce_scatter`, `all_to_all`, `broadcast`, `send` or `recv`. Each line of
metrics.jsonl carries `comm`, `{"<group>.<kind>": wire bytes}` (`as_metrics`), and
`comm_bytes`, their sum.

Two figures per call:
- payload: the bytes of the tensor the caller handed in (for all-gather, the gathered output);
- wire: the bytes one rank sends under the bandwidth-optimal ring algorithm, the quantity
  the ZeRO and Megatron papers reason with: all-reduce 2(n-1)/n·S, all-gather and
  reduce-scatter (n-1)/n·S of the full tensor, all-to-all (n-1)/n·S, send S, broadcast S;
  an all-to-all with uneven splits counts exactly the rows it sends to other ranks.
So "ZeRO-3 moves 1.5× the bytes of DP" and Megatron's 8·b·s·h·(t-1)/t are checks on `wire`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass
class Tally:
    calls: int = 0
    payload: float = 0.0
    wire: float = 0.0


RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,  # the sender counts the bytes; a receive moves nothing out
}


class CommStats:
    """Counts bytes per (dimension, collective kind). One per mesh, never global."""

    def __init__(self):
        self.tallies: dict[tuple[str, str], Tally] = defaultdict(Tally)

    def record(self, dim: str, kind: str, nbytes: int, group_size: int, wire: float | None = None) -> None:
        """`wire`: the exact bytes sent, where the ring formula does not apply (an
        all-to-all with uneven splits)."""
        t = self.tallies[(dim, kind)]
        t.calls += 1
        t.payload += nbytes
        t.wire += nbytes * RING_FACTOR[kind](group_size) if wire is None else wire

    def reset(self) -> None:
        self.tallies.clear()

    def wire_by_dim(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (dim, _), t in self.tallies.items():
            out[dim] += t.wire
        return dict(out)

    def wire(self, dim: str | None = None, kind: str | None = None) -> float:
        return sum(t.wire for (d, k), t in self.tallies.items()
                   if (dim is None or d == dim) and (kind is None or k == kind))

    def payload(self, dim: str | None = None, kind: str | None = None) -> float:
        return sum(t.payload for (d, k), t in self.tallies.items()
                   if (dim is None or d == dim) and (kind is None or k == kind))

    def as_metrics(self) -> dict[str, float]:
        """`"<group>.<kind>"` → wire bytes: the `comm` entry of a metrics.jsonl line."""
        return {f"{d}.{k}": t.wire for (d, k), t in sorted(self.tallies.items())}
