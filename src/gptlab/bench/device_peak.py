"""`gptlab bench peak`: what the device can do, now: dense matmul throughput per precision and memory read
bandwidth. The result is kept per device (gptlab.peak: its file, schema and atomic write) so that training
reports MFU against a measured, not a datasheet, peak; a peak measured while other work ran is printed but not
cached, since it would understate the device and inflate every later MFU figure."""

from __future__ import annotations

import dataclasses
import time

import torch

from gptlab.bench.timing import Load, LoadWatch, read_bandwidth, time_it
from gptlab.peak import Peak, read_peak, write_peak
from gptlab.runtime import bf16_supported, configure_matmul, device_name, resolve_device, set_threads

CPU_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (4096, 512, 2048), (2048, 4096, 2048))
CUDA_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 4096))
QUICK_SHAPES = ((256, 256, 256), (512, 512, 512))


def matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 1.0,
                 shapes: tuple[tuple[int, int, int], ...] | None = None) -> float:
    """Dense matmul FLOP/s in `dtype`: the best over (m, k, n) shapes large enough to keep every core (or SM)
    busy, square and transformer-like (the fp32 BLAS on some CPUs is faster on the latter), each timed by its
    fastest call, so MFU is held against the highest rate the device really reaches."""
    shapes = shapes or (CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES)
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = time_it(lambda: a @ b, device, min_seconds=seconds / len(shapes), best=True)
        best = max(best, 2 * m * k * n / t)
    return best


def measure_peak(device: torch.device, quick: bool = False) -> Peak:
    """Matmul peak per precision (fp32; tf32 on CUDA; bf16 where native) and read bandwidth of `device`, now.
    quick: small sizes, a fraction of a second (for tests; too small to reach the peak)."""
    seconds, shapes, megabytes = (0.2, QUICK_SHAPES, 64) if quick else (3.0, None, 512)
    configure_matmul(device, "fp32")  # exact fp32 products: TF32 is measured on its own below
    fp32, tf32, bf16 = matmul_flops(device, torch.float32, seconds, shapes), None, None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = matmul_flops(device, torch.float32, seconds, shapes)
        torch.backends.cuda.matmul.allow_tf32 = False
    if bf16_supported(device):
        bf16 = matmul_flops(device, torch.bfloat16, seconds, shapes)
    return Peak(fp32, device_name(device), tf32, bf16, read_bandwidth(device, megabytes, seconds / 2),
                torch.__version__, time.strftime("%Y-%m-%d %H:%M:%S"))


def measure_and_cache(device: torch.device, quick: bool = False) -> tuple[Peak, Load]:
    """Measure the peak of `device` and, when no other work ran meanwhile, keep it as the device's peak, which
    gptlab.peak.read_peak reads (a cache folder that cannot be written: measured again next time). Returns the
    peak and the machine's load over the measurement."""
    watch = LoadWatch()
    peak = measure_peak(device, quick=quick)
    load = watch.stop()
    peak = dataclasses.replace(peak, load=load.line())
    if not load.busy:
        write_peak(device, peak)
    return peak, load


def not_cached_warning(load: Load) -> str:
    """The one line saying why a peak was not cached."""
    other = f"{load.others:.2f} CPUs of other work" if load.others is not None else f"load {load.loadavg[0]:.2f}"
    return (f"warning: measured while other work was running ({other}): not cached, so MFU figures keep the "
            "earlier peak; rerun on a quiet machine")


def cached_peak(device: torch.device, refresh: bool = False, quick: bool = False) -> Peak:
    """The device's measured peak, from the per-device cache when present; measured otherwise (and cached when
    the machine was quiet, with a one-line warning when it was not)."""
    peak = None if refresh else read_peak(device)
    if peak is None:
        peak, load = measure_and_cache(device, quick=quick)
        if load.busy:
            print(not_cached_warning(load), flush=True)
    return peak


def run_peak(*, device: str = "auto", quick: bool = False) -> Peak:
    """`gptlab bench peak`: measure now, print the table (with the machine's load above it), cache the result
    unless the machine was busy. quick: tiny sizes (tests). Returns the peak."""
    set_threads()
    dev = resolve_device(device)
    peak, load = measure_and_cache(dev, quick=quick)
    print(f"device: {peak.device}")
    print(load.line())
    if load.busy:
        print(not_cached_warning(load))
    print(f"{'measure':<24} {'value':>14}")
    for key, flops in (("fp32", peak.fp32), ("tf32", peak.tf32), ("bf16", peak.bf16)):
        if flops is not None:
            print(f"{key + ' matmul':<24} {flops / 1e9:>10,.0f} GFLOP/s")
    print(f"{'memory read':<24} {peak.read_bytes_per_s / 1e9:>11,.1f} GB/s")
    if peak.bf16 is not None:
        print(f"{'bf16 / fp32':<24} {peak.bf16 / peak.fp32:>13.2f}x")
    return peak
