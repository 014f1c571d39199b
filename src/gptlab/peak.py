"""A device's measured peak, which `gptlab bench peak` writes and MFU is held against: its file (one per device, in
gptlab's cache folder, machine.cache_root), its schema (Peak), an atomic write and a read that gives None for a file
that is missing, damaged or not a peak. And Speed: a step rate as tokens/s and MFU against that peak."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from gptlab.errors import GptlabError
from gptlab.machine import cache_root
from gptlab.rundir import write_atomic
from gptlab.runtime import device_name

JSON_NAMES = {"torch_version": "torch"}  # field -> its key in the file, where they differ


@dataclass(frozen=True)
class Peak:
    """What a device reached when it was measured: dense matmul FLOP/s per precision and memory read bandwidth,
    with what was measured and when. Only fp32 is always there: tf32 is CUDA's, bf16 is measured where native."""

    fp32: float  # exact fp32 products
    device: str = ""  # what the device is (runtime.device_name)
    tf32: float | None = None
    bf16: float | None = None
    read_bytes_per_s: float | None = None
    torch_version: str = ""
    measured_at: str = ""  # local time, %Y-%m-%d %H:%M:%S
    load: str = ""  # the machine's load over the measurement, as bench.timing.Load.line() says it

    def flops(self, precision: str) -> float | None:
        """The peak a run in `precision` is held against (see peak_key)."""
        return getattr(self, peak_key(precision))

    def to_json(self) -> dict[str, Any]:
        return {JSON_NAMES.get(k, k): v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: Any) -> Peak | None:
        """The peak in `data` (a peak file's JSON), or None when it is not one: no fp32 figure, or a figure that is
        not a positive number."""
        if not isinstance(data, dict):
            return None
        keys = {JSON_NAMES.get(f.name, f.name): f.name for f in fields(cls)}
        values = {keys[k]: v for k, v in data.items() if k in keys}
        numbers = [values.get(k) for k in ("fp32", "tf32", "bf16", "read_bytes_per_s")]
        if values.get("fp32") is None or not all(v is None or _positive(v) for v in numbers):
            return None
        return cls(**{k: str(v) if k in ("device", "torch_version", "measured_at", "load") else v
                      for k, v in values.items()})


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def peak_key(precision: str) -> str:
    """Which measured peak a run in `precision` is held against: bf16, or fp32 (its products are never TF32)."""
    return "bf16" if precision == "bf16" else "fp32"


def peak_file(device: torch.device) -> Path:
    """Where `device`'s measured peak is kept: peak-TYPE-NAME.json in gptlab's cache folder (machine.cache_root),
    NAME the device's (runtime.device_name) with every character but letters and digits made _."""
    key = "".join(c if c.isalnum() else "_" for c in device_name(device))
    return cache_root() / f"peak-{device.type}-{key}.json"


def read_peak(device: torch.device) -> Peak | None:
    """The measured peak of `device`, or None when it was never measured or its file is unreadable or not a peak."""
    try:
        return Peak.from_json(json.loads(peak_file(device).read_text()))
    except (OSError, ValueError):
        return None


def write_peak(device: torch.device, peak: Peak) -> bool:
    """Keep `peak` as `device`'s, replacing the file in one step; False where the cache folder cannot be written
    (a read-only home: the peak is measured again next time)."""
    path = peak_file(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(peak.to_json(), indent=2).encode())
    except (OSError, GptlabError):
        return False
    return True


@dataclass
class Speed:
    """Turns a step rate into tokens/s and MFU: the model's FLOPs per second over the measured peak of the
    active precision on every process together (None until `gptlab bench peak` has measured the device)."""

    tokens_per_step: int
    flops_per_token: float
    peak_flops: float | None = None

    def rates(self, steps: int, seconds: float) -> tuple[float, float | None]:
        """(tokens per second, MFU or None) for `steps` steps in `seconds`."""
        tokens_per_s = steps * self.tokens_per_step / max(seconds, 1e-9)
        return tokens_per_s, tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else None

    def report(self, steps: int, seconds: float) -> dict[str, float]:
        """The rates as a log row has them: tokens_per_s, and mfu when the peak is known."""
        tokens_per_s, mfu = self.rates(steps, seconds)
        return {"tokens_per_s": round(tokens_per_s, 1), **({"mfu": round(mfu, 4)} if mfu is not None else {})}


def cached_speed(device: torch.device, precision: str, tokens_per_step: int, flops_per_token: float,
                 world_size: int = 1) -> Speed:
    """A Speed held against the measured peak of `device` times world_size; never measures (that would steal time
    from the run being timed): without a measured peak, MFU is simply not reported."""
    peak = read_peak(device)
    per_device = peak.flops(precision) if peak else None
    return Speed(tokens_per_step, flops_per_token, per_device * world_size if per_device else None)
