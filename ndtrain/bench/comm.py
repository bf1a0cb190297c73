"""`ndtrain bench comm`: the interconnect, measured the way nccl-tests measures it.

Every collective the engine uses (all-reduce, reduce-scatter, all-gather, broadcast, reduce,
all-to-all, send/recv) and our own ring all-reduce (`comm/ring.py`) run over the same
message sizes, 1 KB to 256 MB by powers of 4 (capped by memory), on the same ranks. For each
size the collectives take turns, round after round (A B C … A B C …), so the machine's noise
falls on all of them alike; the median of the rounds is reported. Time is the slowest
rank's, per call; algbw = S / t and busbw = algbw × factor(n) (plan/calibration.py).

Outputs: a table per collective, a picture of bus bandwidth against size (one line per
collective), the raw figures (`comm.json`) in the output folder, and the calibration
(latency and bus bandwidth per collective for this group size) that `ndtrain plan` reads.
The last line compares our ring with the backend's all-reduce at 64 MB.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ndtrain.comm import ops
from ndtrain.comm.ring import ring_all_reduce
from ndtrain.config import ConfigError, load_config
from ndtrain.plan.calibration import bus_bandwidth, fit, machine_key, save

KINDS = ("all_reduce", "ring_all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
         "all_to_all", "send_recv")
DEFAULT_SIZES = [2**10 * 4**k for k in range(10)]  # 1 KB … 256 MB
RATIO_SIZE = 64 * 2**20
TARGET_S = 0.05  # timed seconds per (collective, size, round): enough calls to rise above the clock
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30}


def parse_sizes(items: list[str] | None) -> list[int]:
    """"1K 64M" or "1K,64M" → bytes (K, M, G are powers of 1024, as in nccl-tests)."""
    if not items:
        return list(DEFAULT_SIZES)
    sizes = []
    for item in ",".join(items).split(","):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", item.upper())
        if not m or float(m.group(1)) <= 0:
            raise ConfigError("--sizes", item, "expected a size in bytes, e.g. 1K, 4MB, 256M")
        sizes.append(int(float(m.group(1)) * _UNITS[m.group(2)]))
    return sorted(set(sizes))


def label(nbytes: float) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def _memory_cap(device: torch.device, nproc: int) -> int:
    """The largest message that leaves room: buffers take about 3 S per rank."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 4
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return avail // (4 * nproc)


class Buffers:
    """The tensors of one message size (float32), allocated once per size."""

    def __init__(self, nbytes: int, n: int, device: torch.device):
        numel = max(n, nbytes // 4 // n * n)  # divisible by n: every rank's part is equal
        self.nbytes = numel * 4
        self.full = torch.zeros(numel, device=device)  # zeros: repeated sums never overflow
        self.part = torch.zeros(numel // n, device=device)
        self.other = torch.empty(numel, device=device)


def _calls(group, b: Buffers) -> dict:
    n, r = group.size, group.rank
    return {
        "all_reduce": lambda: ops.all_reduce(b.full, group),
        "ring_all_reduce": lambda: ring_all_reduce(b.full, group),
        "reduce_scatter": lambda: ops.reduce_scatter(b.part, b.full, group),
        "all_gather": lambda: ops.all_gather(b.full, b.part, group),
        "broadcast": lambda: ops.broadcast(b.full, group, src=0),
        # Not in comm/ops (the engine never reduces to one rank): the backend's, uncounted.
        "reduce": lambda: dist.reduce(b.full, dst=group.ranks[0], group=group.pg),
        "all_to_all": lambda: ops.all_to_all(b.other, b.full, group),
        "send_recv": lambda: [w.wait() for w in ops.send_recv([(b.full, (r + 1) % n)],
                                                             [(b.other, (r - 1) % n)], group)],
    }


def _agree(value: float, op, device: torch.device) -> float:
    """The MAX (or MIN) of a number over the ranks (bookkeeping, not counted)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t)


def _timed(call, iters: int, device: torch.device) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return _agree((time.perf_counter() - t0) / iters, dist.ReduceOp.MAX, device)  # the slowest rank


def measure(group, sizes: list[int], rounds: int, device: torch.device, kinds=KINDS) -> list[dict]:
    """Per collective of `kinds` and size: the median over rounds of the slowest rank's time
    per call, the collectives taking turns within each round (collective over `group`)."""
    rows = []
    for size in sizes:
        b = Buffers(size, group.size, device)
        calls = {k: call for k, call in _calls(group, b).items() if k in kinds}
        iters = {}
        for kind, call in calls.items():  # warm-up, and how many calls fill TARGET_S
            iters[kind] = max(1, min(1000, int(TARGET_S / max(_timed(call, 1, device), 1e-7))))
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(rounds):
            for kind, call in calls.items():
                times[kind].append(_timed(call, iters[kind], device))
        for kind in calls:
            t = statistics.median(times[kind])
            algbw, busbw = bus_bandwidth(kind, group.size, b.nbytes, t)
            rows.append({"kind": kind, "size": size, "bytes": b.nbytes, "seconds": t, "algbw": algbw, "busbw": busbw})
        del b, calls
    return rows


def measure_between(group, sizes: list[int], device: torch.device, kinds=KINDS, calls: int = 8) -> list[dict]:
    """Each collective as a training step issues it: after some computation (a 128×1024 by
    1024×1024 matmul, a few milliseconds on one CPU core), so the ranks arrive as they finish
    it and gloo's threads wake from idle. The time of `calls` × (matmul, collective) less that
    of `calls` matmuls, the two alternating, the median of three; the slowest rank's."""
    import torch.nn.functional as F

    x, w = torch.randn(128, 1024, device=device), torch.randn(1024, 1024, device=device)
    rows = []
    for size in sizes:
        b = Buffers(size, group.size, device)
        for kind, call in ((k, c) for k, c in _calls(group, b).items() if k in kinds):
            call()
            both, alone = [], []
            for _ in range(3):
                for out, with_call in ((both, True), (alone, False)):
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        F.linear(x, w)
                        if with_call:
                            call()
                    out.append(_agree((time.perf_counter() - t0) / calls, dist.ReduceOp.MAX, device))
            t = max(statistics.median(both) - statistics.median(alone), 1e-6)
            algbw, busbw = bus_bandwidth(kind, group.size, b.nbytes, t)
            rows.append({"kind": kind, "size": size, "bytes": b.nbytes, "seconds": t, "algbw": algbw, "busbw": busbw})
        del b
    return rows


def fits_of(rows: list[dict], n: int, sizes: list[int] | None = None) -> dict:
    """{collective: LinkFit} from measured rows (those of `sizes`, or all)."""
    fits = {}
    for kind in KINDS:
        pts = [(r["bytes"], r["seconds"]) for r in rows if r["kind"] == kind and (sizes is None or r["size"] in sizes)]
        if pts:
            fits[kind] = fit(kind, n, pts)
    return fits


def _worker(sizes: list[int], rounds: int, device_kind: str) -> dict:
    from ndtrain.launch import init_process, shutdown
    from ndtrain.mesh import MeshShape, ParallelMesh

    env = init_process(device_kind)
    try:
        world = dist.get_world_size()
        mesh = ParallelMesh.build(MeshShape(dp_shard=world), env.device)
        group = mesh.group("dp_shard")
        cap = _agree(_memory_cap(env.device, env.local_world), dist.ReduceOp.MIN, env.device)
        rows = measure(group, [s for s in sizes if s <= cap], rounds, env.device)
        backend = dist.get_backend()
        return {"rows": rows, "n": world, "device": env.device.type, "backend": backend,
                "capped": [s for s in sizes if s > cap]}
    finally:
        shutdown()


def draw(rows: list[dict], n: int, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    for kind in KINDS:
        pts = [(r["bytes"], r["busbw"] / 1e9) for r in rows if r["kind"] == kind]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=kind.replace("_", "-"),
                    linestyle="--" if kind == "ring_all_reduce" else "-")
    ax.set_xscale("log", base=2)
    sizes = sorted({r["bytes"] for r in rows})
    ax.set_xticks(sizes, [label(s).replace(" ", "") for s in sizes], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"ndtrain bench comm: {n} ranks")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _table(rows: list[dict]) -> list[str]:
    sizes = sorted({r["size"] for r in rows})
    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    by = {(r["kind"], r["size"]): r for r in rows}
    lines = ["busbw GB/s (time per call)", f"{'size':>8}  " + "  ".join(f"{k:>20}" for k in kinds)]
    for s in sizes:
        cells = []
        for k in kinds:
            r = by.get((k, s))
            cells.append(f"{r['busbw'] / 1e9:8.3f} ({r['seconds'] * 1e3:8.3f} ms)" if r else " " * 20)
        lines.append(f"{label(s):>8}  " + "  ".join(f"{c:>20}" for c in cells))
    return lines


def run(args) -> int:
    from ndtrain.launch import launch_local

    cfg = load_config(args.config, args.overrides)
    if args.nproc < 2:
        raise ConfigError("--nproc", args.nproc, "a collective needs at least 2 ranks")
    sizes = parse_sizes(args.sizes)
    measured = sorted(set(sizes) | {RATIO_SIZE})  # the ring/backend line always has its 64 MB
    out = Path(args.out) if args.out else Path("runs") / f"bench-comm-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    print(f"bench comm: {args.nproc} ranks · {len(measured)} sizes {label(measured[0])} … {label(measured[-1])} · "
          f"{args.rounds} rounds, collectives alternating → {out}", flush=True)
    result = launch_local(args.nproc, _worker, measured, args.rounds, cfg.run.device)[0]
    rows = result["rows"]
    out.mkdir(parents=True, exist_ok=True)
    n = result["n"]
    fits = fits_of(rows, n, sizes)
    key = machine_key(result["device"], result["backend"])
    calib = save(cfg.data.cache_dir, key, n, fits)
    (out / "comm.json").write_text(json.dumps({**result, "fits": {k: vars(f) for k, f in fits.items()}}, indent=1))
    asked = [r for r in rows if r["size"] in sizes]
    picture = draw(asked, n, out / "comm-busbw.png")
    print("\n".join(_table(asked)))
    if result["capped"]:
        print(f"left out (memory): {', '.join(label(s) for s in result['capped'])}")
    print("fit t = α + S·factor(n)/busbw: " + " · ".join(
        f"{k} α {f.latency_s * 1e6:,.0f} µs busbw {f.busbw / 1e9:.2f} GB/s" for k, f in fits.items()))
    print(f"calibration {calib} ({key}, {n} ranks)\npicture     {picture}\nfigures     {out / 'comm.json'}")
    size = max(r["size"] for r in rows if r["size"] <= RATIO_SIZE)  # 64 MB unless memory capped it
    at = {r["kind"]: r for r in rows if r["size"] == size}
    ratio = at["ring_all_reduce"]["busbw"] / at["all_reduce"]["busbw"]
    print(f"ndtrain ring/backend all_reduce busbw ratio at {label(size)}: {ratio:.2f}", flush=True)
    return 0
