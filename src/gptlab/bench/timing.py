"""What every bench shares: timers that wait for the device, a per-position clock for generation, a memory-read
probe, and what else the machine did while a bench ran (these machines are shared and noisy, so each bench
prints its load beside its figures)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from gptlab.machine import usable_cores

_R = TypeVar("_R")

BUSY_CPUS = 0.3  # other processes using more than this many CPUs' worth of time during a bench: a busy machine


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def time_it(fn: Callable[[], object], device: torch.device, min_seconds: float = 0.5, warmup: int = 2,
            max_iters: int = 1000, best: bool = False) -> float:
    """Seconds per call of fn over repeated calls lasting at least min_seconds, after warmup calls: the median,
    or with best the fastest call (what the device can do when nothing else runs)."""
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
    return min(times) if best else median(times)


def median(values: list[float]) -> float:
    """The middle value (the upper one of an even count); NaN for none."""
    return sorted(values)[len(values) // 2] if values else float("nan")


def read_then(buffer: torch.Tensor, fn: Callable[[], _R]) -> tuple[float, float, _R]:
    """One read of `buffer` (a CPU tensor much larger than the caches), then fn(): (the read's bytes/s, fn's
    seconds, fn's result). A shared machine's read bandwidth drifts from moment to moment, so the
    benches hold each decode step to the floor of its own moment, read just before it."""
    t0 = time.perf_counter()
    buffer.sum()
    t1 = time.perf_counter()
    result = fn()
    t2 = time.perf_counter()
    return buffer.numel() * buffer.element_size() / (t1 - t0), t2 - t1, result


def read_bandwidth(device: torch.device, megabytes: int = 512, seconds: float = 1.0) -> float:
    """Memory read bandwidth in bytes/s: summing a buffer much larger than the caches, fastest call."""
    x = torch.ones(megabytes * (1 << 20) // 4, device=device, dtype=torch.float32)
    t = time_it(lambda: x.sum(), device, min_seconds=seconds, best=True)
    return x.numel() * 4 / t


class Clock:
    """Time stamps of each new position of a generation; also a transformers streamer (whose first put() is the
    prompt, skipped)."""

    def __init__(self, skip: int = 0) -> None:
        self.skip, self.stamps, self.ids = skip, [], []
        self.start = time.perf_counter()

    def put(self, value: torch.Tensor | Iterable[int]) -> None:
        if self.skip:
            self.skip -= 1
            return
        self.stamps.append(time.perf_counter())
        self.ids.append(value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else list(value))

    def end(self) -> None:
        pass

    @property
    def seconds(self) -> float:
        """From the start to the last new position."""
        return self.stamps[-1] - self.start


# ---- the machine's load ------------------------------------------------------------------------------------

@dataclass
class Sample:
    """CPU time counters at one moment (Linux /proc; the tick fields are None elsewhere)."""

    wall: float
    loadavg: tuple[float, float, float]
    busy_ticks: int | None = None  # every CPU's non-idle time, other VMs' steal included
    own_ticks: int | None = None  # this process's user + system time, all threads
    processes: dict[int, tuple[str, int]] = field(default_factory=dict)  # pid -> (command, user + system ticks)


def _ticks(stat_line: str) -> tuple[str, int]:
    """(command, utime + stime) from a /proc/PID/stat line (the command is in parentheses and may hold spaces)."""
    name, rest = stat_line[stat_line.index("(") + 1:stat_line.rindex(")")], stat_line[stat_line.rindex(")") + 2:]
    fields = rest.split()
    return name, int(fields[11]) + int(fields[12])


def sample() -> Sample:
    """The machine's CPU counters now."""
    now, loadavg = time.perf_counter(), os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    try:
        cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        busy = sum(int(v) for i, v in enumerate(cpu[:8]) if i not in (3, 4))  # all but idle and iowait
        own = _ticks(Path("/proc/self/stat").read_text())[1]
    except (OSError, ValueError, IndexError):
        return Sample(now, loadavg)
    processes = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                processes[int(entry.name)] = _ticks((entry / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue  # ended meanwhile
    return Sample(now, loadavg, busy, own, processes)


@dataclass
class Load:
    """What the machine did while a bench ran, beside the bench itself."""

    loadavg: tuple[float, float, float]  # at the end of the run
    cpus: int  # CPUs this process may use
    threads: int  # torch's intra-op threads
    seconds: float
    others: float | None = None  # CPUs' worth of time used by everything but this process; None: unknown
    busiest: list[tuple[str, float]] = field(default_factory=list)  # (command, share of one CPU), busiest first

    @property
    def busy(self) -> bool:
        """Other work ran: more than BUSY_CPUS of other processes' time during the run, or (where that cannot
        be read) a 1-minute load above this bench's threads + 1."""
        if self.others is not None:
            return self.others > BUSY_CPUS
        return self.loadavg[0] > self.threads + 1

    def line(self) -> str:
        """One line for the bench's output."""
        text = (f"machine load: {self.loadavg[0]:.2f} {self.loadavg[1]:.2f} {self.loadavg[2]:.2f} (1/5/15 min); "
                f"{self.cpus} usable CPUs, {self.threads} torch threads")
        if self.others is not None:
            text += f"; other processes used {self.others:.2f} CPUs during the {self.seconds:.0f} s run"
            if self.busiest:
                text += " (" + ", ".join(f"{name} {share:.0%}" for name, share in self.busiest) + ")"
            elif self.others > BUSY_CPUS:
                text += " (no process of this machine's view accounts for it: other containers or VMs)"
        return text

    def report(self) -> str:
        """The load line, and a warning line under it when other work was running."""
        warning = "\nwarning: other work was running on this machine: this bench's figures may be low and noisy"
        return self.line() + (warning if self.busy else "")


def load_since(start: Sample, end: Sample | None = None, top: int = 3) -> Load:
    """The machine's load from `start` to `end` (default: now)."""
    end = end or sample()
    seconds = max(end.wall - start.wall, 1e-9)
    load = Load(end.loadavg, usable_cores(), torch.get_num_threads(), seconds)
    if None in (start.busy_ticks, end.busy_ticks, start.own_ticks, end.own_ticks):
        return load
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    own = end.own_ticks - start.own_ticks
    load.others = max(0.0, (end.busy_ticks - start.busy_ticks - own) / hz / seconds)
    shares = []
    for pid, (name, ticks) in end.processes.items():
        used = ticks - start.processes[pid][1] if pid in start.processes else 0  # a newcomer's start is unknown
        if used > 0:
            shares.append((name, used / hz / seconds))
    load.busiest = [s for s in sorted(shares, key=lambda s: -s[1])[:top] if s[1] >= 0.05]
    return load


class LoadWatch:
    """Started when a bench starts; stop() gives the machine's load over the bench."""

    def __init__(self) -> None:
        self.start = sample()

    def stop(self) -> Load:
        return load_since(self.start)
