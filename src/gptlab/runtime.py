"""Where and how tensors run: device choice, precision, threads."""

from __future__ import annotations

import contextlib
import os

import torch

from gptlab.errors import GptlabError


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


def resolve_precision(name: str, device: torch.device) -> str:
    """"auto" is bf16 where the hardware computes it natively (measured faster, see docs/benchmarks.md), else
    fp32; asking for bf16 where it is unsupported raises GptlabError."""
    if name == "auto":
        return "bf16" if bf16_supported(device) else "fp32"
    if name == "bf16" and device.type != "mps" and not bf16_supported(device):
        raise GptlabError(f"this {device.type} has no native bf16 support; use --precision fp32")
    return name


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass: bf16 matrix products over fp32 master weights."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def set_threads() -> None:
    """Use one intra-op thread per core this process may run on (torch's default counts hyper-threads)."""
    if "OMP_NUM_THREADS" not in os.environ:
        try:
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
        except AttributeError:  # no sched_getaffinity on macOS
            pass


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
