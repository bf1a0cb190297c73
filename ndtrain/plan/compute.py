"""How long a rank takes for some `Work` (plan/work.py): two models.

`Peak` (every GPU cluster, and this machine before `bench plan` has measured it): the
matmuls' FLOPs at the device's dense peak times an assumed efficiency (0.6 unless a cluster
file says otherwise), fp8 matmuls at the fp8 peak; elementwise work and dispatch are left
out (on a GPU they hide behind the matmuls or are small).

`Measured` (this machine, calibrated by `ndtrain bench plan`, bench/compute.py): a CPU runs
a small matmul far below its peak, and its memory-bound operations, its per-operation
dispatch and the optimizer step take a visible share of a step. So each term is priced from
a measurement taken on every local rank at once (each with its share of the cores, as in
training):
- a matmul m×k by k×n runs at rate(m, k, n) = R · e_m(m) · e_k(k) · e_n(n): R the rate of a
  1024³ matmul, e_d the rate measured with only that dimension changed (16 … 4096), relative
  to R, interpolated in log size and held constant beyond the ends (the separable model of
  a GEMM's efficiency: each dimension too small to fill the kernel's tiles costs on its own);
- the fused attention kernel (forward, and backward) at its rate measured by sequence and
  head size;
- elementwise bytes at the bandwidth of a large elementwise operation;
- each operation a fixed time forward and backward: the time of a decoder too small for its
  arithmetic to count (dispatch, autograd, the modules' Python), over its operations;
- the optimizer step (zeroing the gradients, the global-norm clip, AdamW) a time per
  parameter of the rank's shard;
- zero bubble's split of a block's backward (parallel/pipeline/weightgrad.py walks the
  graph for the split nodes and resumes autograd at each) a fixed time per block, measured
  on the same small decoder; and an MoE block's routing and loop over its experts (on a CPU
  one matmul per expert, `model/moe.py`) a fixed time per local expert, from the same
  decoder with MoE blocks of 8 experts.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ndtrain.plan.work import Matmul, Work

DIMS = ("m", "k", "n")
BASE = 1024  # the matmul size every profile is measured around


@dataclass(frozen=True)
class Peak:
    peak: float  # FLOP/s of the compute dtype
    fp8_peak: float  # FLOP/s of fp8 matmuls (0: none)
    efficiency: float

    def seconds(self, work: Work, backward: bool = False) -> float:
        matmuls = sum(mm.flops / (self.fp8_peak if mm.fp8 and self.fp8_peak else self.peak) for mm in work.matmuls)
        return (matmuls + sum(a.flops for a in work.attention) / self.peak) / self.efficiency

    def optimizer_seconds(self, params: float) -> float:
        return 0.0


@dataclass(frozen=True)
class Measured:
    rate: float  # FLOP/s of a BASE³ matmul on one rank
    profiles: dict  # "m" | "k" | "n" → ((size, relative rate), ...), sizes ascending
    bandwidth: float  # bytes/s of elementwise operations
    attention: tuple  # ((sequence, head_dim, forward FLOP/s, backward FLOP/s), ...) of the fused kernel
    forward_op_s: float  # seconds per operation of a block's forward (dispatch, autograd, Python)
    backward_op_s: float  # seconds per operation of its backward
    optimizer_s: float  # seconds per parameter: zero_grad, clip, AdamW
    split_s: float  # seconds per block of zero bubble's B/W split (finding the split nodes, resuming at each)
    expert_s: tuple  # (forward, backward) seconds per local expert an MoE block visits, beyond its arithmetic
    ranks: int  # local processes it was measured with
    threads: int  # torch threads per rank

    def efficiency(self, dim: str, size: int) -> float:
        points = self.profiles[dim]
        sizes = [p[0] for p in points]
        if size <= sizes[0]:
            return points[0][1]
        if size >= sizes[-1]:
            return points[-1][1]
        i = bisect.bisect_right(sizes, size)
        (s0, r0), (s1, r1) = points[i - 1], points[i]
        w = math.log(size / s0) / math.log(s1 / s0)
        return math.exp(math.log(r0) + w * math.log(r1 / r0))

    def matmul_seconds(self, mm: Matmul) -> float:
        if mm.m <= 0 or mm.k <= 0 or mm.n <= 0:
            return 0.0
        e = self.efficiency("m", mm.m) * self.efficiency("k", mm.k) * self.efficiency("n", mm.n)
        return mm.flops / (self.rate * e)

    def attention_seconds(self, a) -> float:
        """The fused causal kernel's rate measured at (sequence, head_dim), interpolated in log
        sizes between the nearest measured ones (the queries' and keys' geometric mean)."""
        s, d = math.sqrt(a.s_q * a.s_k), a.d
        seqs = sorted({p[0] for p in self.attention})
        dims = sorted({p[1] for p in self.attention})
        table = {(p[0], p[1]): p[2 if a.passes == 1 else 3] for p in self.attention}

        def around(x, grid):
            x = min(max(x, grid[0]), grid[-1])
            i = min(bisect.bisect_right(grid, x), len(grid) - 1)
            lo, hi = grid[max(i - 1, 0)], grid[i]
            return lo, hi, (math.log(x / lo) / math.log(hi / lo) if hi > lo else 0.0)

        s0, s1, ws = around(s, seqs)
        d0, d1, wd = around(d, dims)
        log_rate = sum(wa * wb * math.log(table[(sa, db)]) for sa, wa in ((s0, 1 - ws), (s1, ws))
                       for db, wb in ((d0, 1 - wd), (d1, wd)))
        return a.flops / math.exp(log_rate)

    def seconds(self, work: Work, backward: bool = False) -> float:
        op = self.backward_op_s if backward else self.forward_op_s
        return (sum(self.matmul_seconds(mm) for mm in work.matmuls)
                + sum(self.attention_seconds(a) for a in work.attention) + work.elementwise / self.bandwidth + work.ops * op + work.splits * self.split_s
                + work.experts * self.expert_s[1 if backward else 0])

    def optimizer_seconds(self, params: float) -> float:
        return params * self.optimizer_s

    def to_json(self) -> dict:
        return {**asdict(self), "profiles": {d: [list(p) for p in pts] for d, pts in self.profiles.items()},
                "attention": [list(p) for p in self.attention]}

    @classmethod
    def from_json(cls, data: dict) -> "Measured":
        data = dict(data)
        data["profiles"] = {d: tuple(tuple(p) for p in pts) for d, pts in data["profiles"].items()}
        data["attention"] = tuple(tuple(p) for p in data["attention"])
        data["expert_s"] = tuple(data["expert_s"])
        return cls(**data)


def compute_file(cache_dir: str | Path) -> Path:
    return Path(cache_dir).expanduser() / "cpu_compute.json"


def save(cache_dir: str | Path, model: Measured) -> Path:
    """Keyed by the number of local ranks it was measured with (each gets its share of the cores)."""
    path = compute_file(cache_dir)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[str(model.ranks)] = model.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return path


def load(cache_dir: str | Path, ranks: int) -> Measured | None:
    path = compute_file(cache_dir)
    if not path.is_file():
        return None
    entry = json.loads(path.read_text()).get(str(ranks))
    return Measured.from_json(entry) if entry else None
