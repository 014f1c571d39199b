"""Where and how tensors run: device, precision, threads, host-to-device copies, torch.compile, and what the
device is called (the measured peak that MFU is reported against is gptlab.peak's)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Callable

import torch

from gptlab.errors import GptlabError
from gptlab.machine import cpu_model, usable_cores

log = logging.getLogger("gptlab")


def resolve_device(name: str = "auto") -> torch.device:
    """"auto" picks cuda, then mps, then cpu; a named device that is absent raises GptlabError."""
    available = {"cpu": True, "cuda": torch.cuda.is_available(),
                 "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()}
    if name == "auto":
        name = next(d for d in ("cuda", "mps", "cpu") if available[d])
    if not available.get(name, False):
        raise GptlabError(f"device {name!r} is not available on this machine; use --device cpu or auto")
    return torch.device(name)


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 matrix products run natively (not emulated) on `device`."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def resolve_precision(name: str, device: torch.device, bf16_storage: bool | None = None) -> str:
    """"auto" is bf16 where the hardware computes it natively (measured faster, see docs/benchmarks.md), else
    fp32; asking for bf16 where it is unsupported raises GptlabError. `bf16_storage`: None for training (it
    computes in bf16); for inference, whether bf16 may be storage only (a CPU whose native decode step can be
    built: it widens bf16 weights to fp32 in registers, on any CPU), where it is then allowed, and where "auto" is
    bf16 too: decoding waits on the weights' bytes, which bf16 halves (the AVX2 build's step measured faster in
    bf16 than in fp32, never slower; next-token KL divergence from fp32 about 5e-5 on a trained run: both in
    docs/benchmarks.md). int8 stays a choice: "auto" does not quantize."""
    if name == "auto":
        return "bf16" if bf16_supported(device) or (bf16_storage and device.type == "cpu") else "fp32"
    if name == "bf16" and device.type != "mps" and not bf16_supported(device):
        if bf16_storage and device.type == "cpu":
            return name
        why = (" (training computes in bf16)" if bf16_storage is None else
               " and no g++ for the native decode step that stores bf16 on any CPU" if device.type == "cpu" else "")
        raise GptlabError(f"this {device.type} has no native bf16 support{why}; use --precision fp32")
    return name


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass: bf16 matrix products over fp32 master weights."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def configure_matmul(device: torch.device, precision: str) -> None:
    """On CUDA, let the few fp32 matrix products left under bf16 autocast use TF32 tensor cores; "fp32" keeps
    exact fp32 products, so that the fp32 path stays the reference."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = precision == "bf16"
        torch.backends.cudnn.allow_tf32 = precision == "bf16"


def set_threads() -> None:
    """Use one intra-op thread per core this process may run on (torch's default counts hyper-threads)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cores()))


def reuse_freed_memory() -> bool:
    """Keep the memory a training step frees for the next step instead of handing it back to the OS. glibc serves
    large blocks (32 MB and up always; smaller ones by a sliding threshold) with a fresh mmap and unmaps them on
    free, so every step page-faults its largest tensors anew: the bf16 copies autocast makes of the weights, their
    gradients, the logits (what that costs a step: `gptlab bench train --preset finetune`, docs/benchmarks.md).
    Process-wide, and the process keeps its peak memory until
    it ends; the numbers computed do not change. Returns whether the allocator took the settings (glibc on Linux;
    elsewhere nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    # no block from mmap (every one from the heap, which falls back to mmap itself when it cannot grow), and the
    # heap never trimmed (-1): a step's peak comes back every step (a 1 GiB threshold still trimmed between the
    # variants of `gptlab bench train`, and their steps page-faulted again)
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, -1))


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to `device`; on CUDA through pinned memory without waiting, so the host can prepare
    the next batch while the device computes."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def compile_model(model: torch.nn.Module, warm_up: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """torch.compile(model), compiled now by running warm_up on it once (compilation is lazy, and a failure must
    surface here, not mid-run). The random state is restored and gradients cleared afterwards, so training
    starts from the state it would have without compiling. Where compiling is unavailable or fails: one
    warning, and the model as it was."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        compiled = torch.compile(model)
        with torch.random.fork_rng(devices=devices):
            warm_up(compiled)
    except Exception as exc:  # noqa: BLE001 - whatever the compiler raises (no C++ compiler, unsupported op, ...)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        log.warning("torch.compile is unavailable here (%s: %s); training without it", type(exc).__name__, reason)
        compiled = model
    model.zero_grad(set_to_none=True)
    return compiled


# ---- the device's name ---------------------------------------------------------------------------------------

def device_name(device: torch.device) -> str:
    """What the device is, as the peak's file is named by it: the GPU's name, or the CPU's model and this process's
    thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({torch.get_num_threads()} threads)"
