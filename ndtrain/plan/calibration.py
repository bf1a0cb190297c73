"""What `ndtrain bench comm` measured, in the form the planner reads: per collective and
group size, a latency α and a bus bandwidth β, so that one call on S bytes over n ranks
takes t(S) = α + S · factor(n) / β, and the measured points themselves, which the planner
follows where it has them (a real curve bends: gloo's large reduce-scatters slow down).

factor(n) is the bus-bandwidth factor of nccl-tests (NVIDIA's `PERFORMANCE.md`): the share
of S that crosses the slowest link under the bandwidth-optimal algorithm, 2(n−1)/n for an
all-reduce, (n−1)/n for a reduce-scatter, an all-gather or an all-to-all (S = the whole
buffer, not one rank's part), 1 for a broadcast, a reduce or a send/recv. Bus bandwidth is
then comparable across collectives and group sizes, and close to the link's speed.

The file lives in the cache folder next to `bench matmul`'s CPU peak, keyed by device and
backend; each run replaces the entries of the group size it measured.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass
from pathlib import Path

from ndtrain.comm.stats import RING_FACTOR

# The share of S on the slowest link: CommStats' wire bytes per rank (comm/stats.py), plus a
# reduce (pipelined down a ring, each rank passes S on) and a send/recv pair (S each way).
BUS_FACTOR = {**{k: v for k, v in RING_FACTOR.items() if k not in ("send", "recv")},
              "reduce": lambda n: 1.0, "send_recv": lambda n: 1.0}


def bus_bandwidth(kind: str, n: int, nbytes: float, seconds: float) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in bytes/s of one call: algbw = S / t, busbw =
    algbw × factor(n). Our ring all-reduce counts as an all-reduce."""
    algbw = nbytes / seconds
    return algbw, algbw * BUS_FACTOR[_base(kind)](n)


def _base(kind: str) -> str:
    return "all_reduce" if kind == "ring_all_reduce" else kind


@dataclass(frozen=True)
class LinkFit:
    """t(S) = α + S·factor(n)/β; with measured `points` ((bus bytes, seconds), from `bench
    comm`), the measured curve itself, interpolated (log-log) between them and continued
    at the last bandwidth beyond them: gloo's collectives are far from one straight line."""

    latency_s: float
    busbw: float  # bytes/s
    points: tuple = ()

    def seconds(self, kind: str, n: int, nbytes: float) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        x = nbytes * BUS_FACTOR[_base(kind)](n)  # the bytes on the slowest link
        if not self.points:
            return self.latency_s + x / self.busbw
        pts = self.points
        if x <= pts[0][0]:
            return pts[0][1]
        if x >= pts[-1][0]:
            (x0, t0), (x1, t1) = pts[-2] if len(pts) > 1 else (0.0, 0.0), pts[-1]
            return t1 + (x - x1) * (t1 - t0) / (x1 - x0) if x1 > x0 and t1 > t0 else t1 * x / x1
        for (x0, t0), (x1, t1) in zip(pts, pts[1:]):
            if x0 <= x <= x1:
                w = math.log(x / x0) / math.log(x1 / x0)
                return math.exp(math.log(t0) + w * math.log(t1 / t0))
        raise AssertionError("unreachable")


def fit(kind: str, n: int, points: list[tuple[float, float]]) -> LinkFit:
    """α and β from (bytes, seconds) points, minimising the squared *relative* error of
    t = α + x/β with x = S·factor(n), so that 1 KB and 256 MB weigh alike."""
    xs = [s * BUS_FACTOR[_base(kind)](n) for s, _ in points]
    ts = [t for _, t in points]
    # Normal equations of min Σ ((α + k·x − t)/t)², k = 1/β.
    a11 = sum(1 / t**2 for t in ts)
    a12 = sum(x / t**2 for x, t in zip(xs, ts))
    a22 = sum(x * x / t**2 for x, t in zip(xs, ts))
    b1 = sum(1 / t for t in ts)
    b2 = sum(x / t for x, t in zip(xs, ts))
    det = a11 * a22 - a12 * a12
    alpha, k = ((a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det) if det > 0 else (-1.0, -1.0)
    if alpha < 0 or k <= 0:  # too few or too noisy points: the largest sets β, the smallest α
        (x0, t0), (x1, t1) = min(zip(xs, ts)), max(zip(xs, ts))
        k = t1 / x1
        alpha = max(t0 - k * x0, 0.0)
    return LinkFit(alpha, 1.0 / k, tuple(sorted(zip(xs, ts))))


def calibration_file(cache_dir: str | Path) -> Path:
    return Path(cache_dir).expanduser() / "comm_calibration.json"


def machine_key(device: str, backend: str) -> str:
    return f"{platform.node() or 'host'}/{device}/{backend}"


def save(cache_dir: str | Path, key: str, n: int, fits: dict[str, LinkFit]) -> Path:
    path = calibration_file(cache_dir)
    data = json.loads(path.read_text()) if path.is_file() else {}
    entry = data.setdefault(key, {})
    for kind, f in fits.items():
        entry.setdefault(kind, {})[str(n)] = {"latency_s": f.latency_s, "busbw": f.busbw,
                                             "bus_bytes_seconds": [list(p) for p in f.points]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return path


def load(cache_dir: str | Path, key: str | None = None) -> dict[str, dict[int, LinkFit]]:
    """{collective: {group size: fit}} for this machine (the first entry if `key` is None
    and this host has none); {} when `bench comm` never ran here."""
    path = calibration_file(cache_dir)
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not data:
        return {}
    entry = data.get(key) if key else None
    if entry is None:
        mine = [k for k in data if k.startswith(f"{platform.node() or 'host'}/")]
        entry = data[(mine or sorted(data))[0]]
    return {kind: {int(n): LinkFit(v["latency_s"], v["busbw"], tuple(map(tuple, v.get("bus_bytes_seconds", []))))
                   for n, v in sizes.items()}
            for kind, sizes in entry.items()}


def nearest(fits: dict[int, LinkFit], n: int) -> LinkFit:
    """The fit measured on the group size closest to n (bus bandwidth hardly depends on n)."""
    return fits[min(fits, key=lambda m: (abs(m - n), -m))]
