"""Model FLOPs utilisation: achieved training FLOPs over the hardware's peak.

GPU peaks are the vendors' dense (no sparsity) figures, by precision. A CPU has no
published figure that means anything for PyTorch, so we use the matmul rate measured on this
machine by `ndtrain bench matmul`, saved under the cache folder and labelled as such. With
neither, MFU is null: a guessed peak would make the number meaningless.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

# Dense TFLOP/s: (fp32 without tensor cores, TF32 tensor cores, bf16/fp16 tensor cores).
GPU_PEAKS = {
    "H200": (67e12, 494.7e12, 989e12),
    "H100 SXM": (67e12, 494.7e12, 989e12),
    "H100 NVL": (60e12, 417.5e12, 835e12),
    "H100 PCIe": (51e12, 378e12, 756e12),
    "H100": (67e12, 494.7e12, 989e12),
    "B200": (80e12, 1100e12, 2250e12),
    "A100": (19.5e12, 156e12, 312e12),
    "A10G": (31.2e12, 62.5e12, 125e12),
    "L40S": (91.6e12, 183e12, 362e12),
    "L4": (30.3e12, 60e12, 121e12),
    "RTX 4090": (82.6e12, 82.6e12, 165e12),
    "V100": (15.7e12, 15.7e12, 125e12),  # no TF32: fp32 stays fp32
}


def cpu_peak_file(cache_dir: str | Path) -> Path:
    return Path(cache_dir).expanduser() / "cpu_matmul_peak.json"


def measure_matmul(n: int = 1024, seconds: float = 2.0, dtype=torch.float32, threads: int | None = None) -> float:
    """Best sustained FLOP/s of n×n matmuls on the CPU over about `seconds`."""
    if threads:
        torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def save_cpu_peak(cache_dir: str | Path, flops: float, n: int, threads: int) -> Path:
    path = cpu_peak_file(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"flops": flops, "matrix": n, "threads": threads,
                                "machine": platform.processor() or platform.machine()}))
    return path


def peak_flops(device: torch.device, precision: str, cache_dir: str | Path,
               tf32: bool = False) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the figure comes from); (None, why) if unknown.
    On the CPU the "device" is the whole machine. An fp32 run with train.tf32 multiplies on
    TF32 tensor cores, so its MFU is quoted against their peak, not plain fp32's (which
    would flatter it 7×)."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), precision, tf32)
    path = cpu_peak_file(cache_dir)
    if path.is_file():
        data = json.loads(path.read_text())
        return float(data["flops"]), f"peak = CPU matmul rate measured by `ndtrain bench matmul`, {path}"
    return None, "CPU peak unknown: run `ndtrain bench matmul` once to measure it"


def gpu_peak(name: str, precision: str, tf32: bool) -> tuple[float | None, str]:
    """The datasheet peak of the GPU called `name` at `precision`, and its label."""
    for key, (fp32, tf32_peak, low) in GPU_PEAKS.items():
        if key in name:
            if precision == "fp32":
                return (tf32_peak, f"{name} datasheet, fp32 on TF32 tensor cores (train.tf32)") if tf32 \
                    else (fp32, f"{name} datasheet, fp32")
            shown = (f"bf16 ({precision} runs are quoted against the bf16 peak)" if precision in ("fp8", "nvfp4")
                     else precision)
            return low, f"{name} datasheet, {shown}"
    return None, f"unknown GPU {name!r}"
