"""Clusters the planner knows: GPU presets from datasheets, this machine from its own
calibration, or a TOML file.

A cluster is per device: dense peak FLOP/s by precision, memory, and two links, the one
inside a node (NVLink) and the one between nodes (InfiniBand/RoCE), each as a bus
bandwidth (bytes/s one way per GPU, the figure nccl-tests reports as busbw) and a latency.
A collective of S bytes over n ranks then takes α + S·factor(n)/β (plan/calibration.py),
on the slower link if its ranks span nodes. The datasheet bandwidths are ceilings: NCCL
reaches about 80% of them on large messages.

`efficiency` is the assumed fraction of the peak that the compute kernels reach (the
"assumed MFU" of the compute alone; communication and the pipeline bubble come on top).
fp8 is the dense fp8 tensor-core peak (H100/H200 1,979 TFLOP/s, B200 4,500; the A100 has
none, so fp8 cannot be planned on it).
`headroom` (10%) is the memory a layout must leave free to count as fitting: the CUDA
context, NCCL's buffers and the allocator's fragmentation, which the plan does not count.

"this machine" is the CPU in front of you: `ndtrain bench matmul` gives its peak (all
cores), `ndtrain bench comm` the latency and bus bandwidth of each collective over gloo;
its processes share the cores and the RAM, so a process gets its share of both. Once
`ndtrain bench plan` has measured it (plan/compute.py), its compute is priced kernel by
kernel for the number of local processes it was measured with, instead of as a fraction of
the peak.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from ndtrain.config import ConfigError
from ndtrain.plan.calibration import LinkFit, calibration_file, load, nearest
from ndtrain.plan.compute import Measured, Peak

GB, TB = 1e9, 1e12
GiB = 2**30


@dataclass(frozen=True)
class Cluster:
    name: str
    peak: dict  # precision → dense FLOP/s of one device
    memory: float  # bytes of one device
    gpus_per_node: int
    intra: LinkFit  # NVLink: latency (s), bus bandwidth (bytes/s)
    inter: LinkFit  # between nodes
    efficiency: float = 0.6  # assumed fraction of the peak the compute kernels reach
    headroom: float = 0.1  # memory kept free for what the plan does not count (CUDA context, fragmentation)
    shared_node: bool = False  # a CPU: the node's processes share its peak and its memory
    fits: dict = field(default_factory=dict)  # measured {collective: {group size: LinkFit}} (this machine)
    source: str = "datasheet"
    measured: dict = field(default_factory=dict)  # this machine: {local processes: Measured} (bench plan)
    compute: Measured | None = None  # the one for this layout's processes (per_device)

    @property
    def usable_memory(self) -> float:
        return self.memory * (1 - self.headroom)

    def peak_flops(self, precision: str) -> float:
        return self.peak.get(precision) or self.peak["fp32"]

    def compute_model(self, precision: str, low: str = "fp8"):
        """How a rank's work is priced (plan/compute.py): measured kernel by kernel, or the peak
        times the efficiency; the low-precision matmuls at the `low` peak (fp8, or fp4 for NVFP4)."""
        return self.compute or Peak(self.peak_flops(precision), self.peak.get(low, 0.0), self.efficiency)

    def per_device(self, local: int) -> "Cluster":
        """A shared node split among `local` processes (a CPU); a GPU cluster as it is."""
        if not self.shared_node:
            return self
        compute = self.measured.get(local)
        if local <= 1:
            return replace(self, compute=compute)
        return replace(self, peak={k: v / local for k, v in self.peak.items()}, memory=self.memory / local,
                       compute=compute)

    def link(self, kind: str, n: int, spans_nodes: bool) -> LinkFit:
        """The latency and bus bandwidth a collective of `kind` over n ranks gets."""
        if self.fits:
            measured = self.fits.get(kind) or self.fits.get("all_reduce")
            if measured:
                return nearest(measured, n)
        return self.inter if spans_nodes else self.intra


def _gpu(name, bf16_tflops, fp32_tflops, fp8_tflops, memory_gb, nvlink_gbps, ib_gbps, gpus_per_node=8,
         fp4_tflops=0):
    peak = {"bf16": bf16_tflops * TB, "fp16": bf16_tflops * TB, "fp32": fp32_tflops * TB}
    if fp8_tflops:
        peak["fp8"] = fp8_tflops * TB
    if fp4_tflops:  # Blackwell's block-scaled tensor cores: MXFP8 at the fp8 rate, NVFP4 at this one
        peak["fp4"] = fp4_tflops * TB
    return Cluster(name, peak, memory_gb * GB, gpus_per_node, LinkFit(10e-6, nvlink_gbps * GB),
                   LinkFit(20e-6, ib_gbps * GB))


# Dense peaks (no sparsity) and links, per GPU, one direction. NVLink: A100 600 GB/s,
# H100/H200 900 GB/s, B200 1.8 TB/s bidirectional. Between nodes: one NIC per GPU, A100
# HDR 200 Gb/s, H100/H200/B200 NDR 400 Gb/s. fp32 is the non-tensor-core rate; fp8 the dense
# fp8 tensor-core rate (H100 SXM 1,979 = half its 3,958 with sparsity; HGX B200 4,500; none on
# the A100). Memory as sold (GB). fp4: the dense NVFP4 rate of Blackwell (HGX B200 9,000 =
# half of 18,000 with sparsity). GB200 (NVL72 datasheet, per GPU: dense bf16 2,500, fp8 5,000,
# fp4 10,000 TFLOP/s, 186 GB, NVLink 1.8 TB/s both ways across the 72 GPUs of a rack, one
# 400 Gb/s NIC per GPU; its fp32 is not on the datasheet: the B200's).
PRESETS: dict[str, Cluster] = {c.name: c for c in (
    _gpu("A100-40GB", 312, 19.5, 0, 40, 300, 25),
    _gpu("A100-80GB", 312, 19.5, 0, 80, 300, 25),
    _gpu("H100-SXM", 989, 67, 1979, 80, 450, 50),
    _gpu("H200", 989, 67, 1979, 141, 450, 50),
    _gpu("B200", 2250, 80, 4500, 180, 900, 50, fp4_tflops=9000),
    _gpu("GB200", 2500, 80, 5000, 186, 900, 50, gpus_per_node=72, fp4_tflops=10000),
)}
THIS_MACHINE = "this-machine"
_ALIASES = {"a100": "A100-80GB", "a100-40": "A100-40GB", "a100-80": "A100-80GB", "h100": "H100-SXM",
            "h100-sxm": "H100-SXM", "h200": "H200", "b200": "B200", "gb200": "GB200", "cpu": THIS_MACHINE, "local": THIS_MACHINE}


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def this_machine(cache_dir: str) -> Cluster:
    """The CPU, calibrated by `bench matmul` (peak) and `bench comm` (links)."""
    from ndtrain.observe.mfu import cpu_peak_file
    import json

    path = cpu_peak_file(cache_dir)
    if not path.is_file():
        raise ConfigError("--cluster", THIS_MACHINE, "this machine is not calibrated: run `ndtrain bench matmul` "
                          "(its peak) and `ndtrain bench comm` (its links) first")
    flops = _calibration(path, lambda data: float(data["flops"]))
    if not 0 < flops < math.inf:
        raise ConfigError("--cluster", THIS_MACHINE, f"the calibration {path} holds a peak of {flops} FLOP/s: "
                          "run `ndtrain bench matmul` again")
    fits = _calibration(calibration_file(cache_dir), lambda _: load(cache_dir)) \
        if calibration_file(cache_dir).is_file() else {}
    if not fits:
        raise ConfigError("--cluster", THIS_MACHINE, "no interconnect calibration: run `ndtrain bench comm` "
                          "(or `ndtrain bench plan`, which also measures the compute) first")
    link = nearest(fits["all_reduce"], 2)
    from ndtrain.plan.compute import compute_file
    measured = {}
    if compute_file(cache_dir).is_file():
        measured = _calibration(compute_file(cache_dir),
                                lambda data: {int(n): Measured.from_json(v) for n, v in data.items()})
    return Cluster(THIS_MACHINE, {"fp32": flops, "bf16": flops, "fp16": flops, "fp64": flops / 2},
                   float(physical_memory()), os.cpu_count() or 1, link, link, shared_node=True, fits=fits,
                   source="measured: bench matmul, bench comm" + (", bench plan" if measured else ""),
                   measured=measured)


def _calibration(path: Path, read):
    """`read(the JSON of path)`; a damaged calibration file is a ConfigError saying how to redo it."""
    import json
    try:
        return read(json.loads(Path(path).read_text()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError("--cluster", THIS_MACHINE, f"the calibration {path} is damaged ({type(e).__name__}); "
                          "remove it and run `ndtrain bench matmul` / `ndtrain bench plan` again") from None


def _number(data: dict, key: str, where: str, positive: bool = True) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            value < 0 or (positive and value == 0)):
        raise ConfigError(f"{where}{key}", value, f"expected a {'positive' if positive else 'non-negative'} "
                          "finite number")
    return float(value)


def from_toml(path: Path) -> Cluster:
    """A cluster file: name, gpus_per_node, memory_gb, [peak_tflops] bf16/fp16/fp32,
    [links] intra_gbps, inter_gbps, intra_latency_us, inter_latency_us; efficiency."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError("--cluster", str(path), "is not a UTF-8 text file (a TOML cluster file is UTF-8)") from None
    except OSError as e:
        raise ConfigError("--cluster", str(path), f"cannot be read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--cluster", str(path), f"not valid TOML ({e})") from None
    known = {"name", "gpus_per_node", "memory_gb", "peak_tflops", "links", "efficiency", "headroom"}
    for key in data:
        if key not in known:
            raise ConfigError(f"--cluster {path}: {key}", data[key], f"unknown key; expected {', '.join(sorted(known))}")
    peaks = data.get("peak_tflops")
    if not isinstance(peaks, dict) or "bf16" not in peaks:
        raise ConfigError(f"--cluster {path}: peak_tflops", peaks, "expected a table with at least bf16 = TFLOP/s")
    peak = {k: _number(peaks, k, "peak_tflops.") * TB for k in peaks}
    peak.setdefault("fp16", peak["bf16"])
    peak.setdefault("fp32", peak["bf16"])
    links = data.get("links", {})
    if not isinstance(links, dict):
        raise ConfigError(f"--cluster {path}: links", links, "expected a table of intra_gbps, inter_gbps, "
                          "intra_latency_us, inter_latency_us")
    efficiency = _number(data, "efficiency", "") if "efficiency" in data else 0.6
    if efficiency > 1:
        raise ConfigError("efficiency", efficiency, "must be in (0, 1]")
    headroom = _number(data, "headroom", "", positive=False) if "headroom" in data else 0.1
    if not 0 <= headroom < 1:
        raise ConfigError("headroom", headroom, "must be in [0, 1)")
    gpn = _number(data, "gpus_per_node", "")
    if gpn != int(gpn):
        raise ConfigError("gpus_per_node", gpn, "expected an integer")
    return Cluster(str(data.get("name", path.stem)), peak, _number(data, "memory_gb", "") * GB, int(gpn),
                   LinkFit(_number(links, "intra_latency_us", "links.") * 1e-6 if "intra_latency_us" in links else 10e-6,
                           _number(links, "intra_gbps", "links.") * GB),
                   LinkFit(_number(links, "inter_latency_us", "links.") * 1e-6 if "inter_latency_us" in links else 20e-6,
                           _number(links, "inter_gbps", "links.") * GB),
                   efficiency, headroom, source=str(path))


def resolve(spec: str, cache_dir: str) -> Cluster:
    """A preset name (case-insensitive, aliases allowed), `this-machine`, or a TOML file."""
    if spec.lower().endswith(".toml") or Path(spec).is_file():
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ConfigError("--cluster", spec, "file does not exist")
        return from_toml(path)
    name = _ALIASES.get(spec.lower(), spec)
    for key in PRESETS:
        if key.lower() == name.lower():
            return PRESETS[key]
    if name == THIS_MACHINE:
        return this_machine(cache_dir)
    raise ConfigError("--cluster", spec, f"unknown cluster; choose one of {', '.join([*PRESETS, THIS_MACHINE])} "
                      "or give a TOML file")
