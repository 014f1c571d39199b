"""Benchmarks that measure side by side in one run and print ratios (these machines are shared and noisy).

`peak` measures what the device can do: dense matmul throughput per precision and memory read bandwidth, and
caches it per device so that training can report MFU against a measured, not a datasheet, peak.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gptlab.runtime import bf16_supported, resolve_device, set_threads

CACHE = Path(os.environ.get("GPTLAB_CACHE", Path.home() / ".cache" / "gptlab"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def time_it(fn: Callable[[], Any], device: torch.device, min_seconds: float = 0.5, warmup: int = 2,
            max_iters: int = 1000) -> float:
    """Median seconds per call of fn over repeated calls lasting at least min_seconds, after warmup calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while (time.perf_counter() - start < min_seconds or len(times) < 3) and len(times) < max_iters:
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, seconds: float = 1.0) -> float:
    """Dense matmul FLOP/s for n x n @ n x n in `dtype` (the best of the sizes tried: a peak, not an average)."""
    best = 0.0
    for size in (n // 2, n):
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        t = time_it(lambda: a @ b, device, min_seconds=seconds / 2)
        best = max(best, 2 * size**3 / t)
    return best


def read_bandwidth(device: torch.device, megabytes: int = 512, seconds: float = 1.0) -> float:
    """Memory read bandwidth in bytes/s: summing a buffer much larger than the caches."""
    x = torch.ones(megabytes * (1 << 20) // 4, device=device, dtype=torch.float32)
    t = time_it(lambda: x.sum(), device, min_seconds=seconds)
    return x.numel() * 4 / t


def measure_peak(device: torch.device, quick: bool = False) -> dict[str, Any]:
    """Matmul peak per precision and read bandwidth of `device`, measured now."""
    seconds = 0.4 if quick else 1.5
    peak: dict[str, Any] = {"device": device_name(device), "fp32": matmul_flops(device, torch.float32, seconds=seconds)}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        peak["tf32"] = matmul_flops(device, torch.float32, seconds=seconds)
        torch.backends.cuda.matmul.allow_tf32 = False
    if bf16_supported(device):
        peak["bf16"] = matmul_flops(device, torch.bfloat16, seconds=seconds)
    peak["read_bytes_per_s"] = read_bandwidth(device, seconds=seconds)
    peak["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return peak


def _cache_file(device: torch.device) -> Path:
    key = "".join(c if c.isalnum() else "_" for c in device_name(device))
    return CACHE / f"peak-{device.type}-{key}.json"


def cached_peak(device: torch.device, refresh: bool = False) -> dict[str, Any]:
    """The device's measured peak, from the per-device cache when present (measured and cached otherwise)."""
    path = _cache_file(device)
    if path.is_file() and not refresh:
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            pass
    peak = measure_peak(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(peak, indent=2))
    except OSError:
        pass  # a read-only home: measure again next time
    return peak


def run_peak(device_name_arg: str = "auto", refresh: bool = True) -> dict[str, Any]:
    set_threads()
    device = resolve_device(device_name_arg)
    peak = cached_peak(device, refresh=refresh)
    print(f"device: {peak['device']}")
    print(f"{'measure':<24} {'value':>14}")
    for key in ("fp32", "tf32", "bf16"):
        if key in peak:
            print(f"{key + ' matmul':<24} {peak[key] / 1e9:>10,.0f} GFLOP/s")
    print(f"{'memory read':<24} {peak['read_bytes_per_s'] / 1e9:>11,.1f} GB/s")
    if "bf16" in peak:
        print(f"{'bf16 / fp32':<24} {peak['bf16'] / peak['fp32']:>13.2f}x")
    return peak
