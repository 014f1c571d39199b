"""What this machine offers a process: the CPU cores it may run on, the CPU's model and features, and the folder
gptlab caches what it measures or builds for this machine in. The one place that reads /proc/cpuinfo and the cache
environment. Standard library only, so every stage can ask."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
X86_64 = ("x86_64", "AMD64")
ARM64 = ("aarch64", "arm64")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS has one, else all of them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's entries in /proc/cpuinfo ("model name", "flags", ...), values stripped; {} where there
    is no /proc/cpuinfo (not Linux) or it cannot be read."""
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip(), value.strip())
    return info


def cpu_model() -> str:
    """What the CPU is called: its model name, else what the platform says (the processor, else the architecture)."""
    return cpu_info().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The instruction-set features the CPU reports in /proc/cpuinfo: an x86-64 CPU's "flags" ("avx512f",
    "avx512_vnni", ...), an ARM64 CPU's "Features" ("asimd", "asimddp", ...); empty elsewhere."""
    if platform.machine() in X86_64:
        return frozenset(cpu_info().get("flags", "").split())
    if platform.machine() in ARM64:
        return frozenset(cpu_info().get("Features", "").split())
    return frozenset()


def cpu_has(*flags: str) -> bool:
    """Whether the CPU reports every one of `flags` (cpu_flags)."""
    return bool(flags) and set(flags) <= cpu_flags()


def cache_root() -> Path:
    """The folder gptlab keeps per-machine results in (the measured peak, the built kernels): $GPTLAB_CACHE, else
    gptlab/ in $XDG_CACHE_HOME, else ~/.cache/gptlab."""
    if os.environ.get("GPTLAB_CACHE"):
        return Path(os.environ["GPTLAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptlab"
