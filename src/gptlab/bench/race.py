"""`gptlab bench race`: the training time each contender needs to reach a target validation loss on the bundled
Tiny Shakespeare, in one run on one machine: the reference — nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide,
context 64, batch 12, lr 1e-3 with a cosine over 2000 steps, fp32, AdamW) reproduced through gptlab — then the
default preset (or the presets asked for: char-race is tuned for this race in fp32) with each optimizer in each
precision. The target is the reference's own final validation loss unless one is given.

Every contender is evaluated often (every `eval_every` steps, the same fixed batches for all); the clock counts
training steps only (evaluations and checkpoints are left out), so a contender's time to the target is the training
time at its first evaluation at or under it.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptlab.bench.timing import LoadWatch

REFERENCE = dict(train=dict(batch_size=12, grad_accum=1, max_steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100,
                            beta2=0.99, weight_decay=0.1, precision="fp32"),
                 model=dict(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0))


@dataclass
class Lap:
    """One contender's race: when it reached the target (None: never) and where it ended."""

    name: str
    steps_to_target: int | None
    seconds_to_target: float | None
    final_val: float
    train_seconds: float


def time_to_target(history: list[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    """(step, training seconds) of the first evaluation whose validation loss is at or under `target`."""
    for row in history:
        if row.get("kind") == "eval" and row["val_loss"] <= target:
            return row["step"], row["train_s"]
    return None, None


def contenders(optimizers: list[str], precisions: list[str] | None = None, changes: dict | None = None,
               presets: list[str] | None = None) -> list[tuple[str, str, dict, dict]]:
    """(name, preset, model overrides, train overrides) of each preset (default ["char-quick"], the default
    preset) with each optimizer in each precision (default ["auto"]: the preset's own choice, bf16 where the CPU
    computes it natively; "fp32" shows what a CPU without native bf16 gets), plus `changes` ({"model": ...,
    "train": ...}, which tests use to shrink the race)."""
    changes, precisions = changes or {}, precisions or ["auto"]
    return [(f"{preset}, {opt}" + ("" if precision == "auto" else f", {precision}"), preset,
             dict(changes.get("model", {})), {**changes.get("train", {}), "optimizer": opt, "precision": precision})
            for preset in presets or ["char-quick"] for precision in precisions for opt in optimizers]


def run_lap(name: str, data: Path, model: dict, train: dict, folder: Path, eval_every: int, target: float | None,
            quiet: bool = True, preset: str | None = None) -> tuple[Lap, list[dict[str, Any]]]:
    """Train one contender (`preset`, default the default preset, with `model` and `train` over it) into `folder`;
    its Lap against `target` (None: decided later) and its history."""
    from gptlab.runs import resolve, start

    spec = resolve(preset, model=model, train={**train, "eval_interval": eval_every, "eval_batches": 20},
                   run=folder, data=data, quiet=quiet)
    with contextlib.redirect_stdout(io.StringIO()):  # the evaluations' lines: the race prints one table
        result = start(spec, quiet=quiet)
    steps, seconds = time_to_target(result.history, target) if target is not None else (None, None)
    return Lap(name, steps, seconds, result.val_loss, result.train_seconds), result.history


def run_race(optimizers: list[str], target: float | None = None, eval_every: int = 25, data: Path | None = None,
             reference: dict | None = None, changes: dict | None = None,
             precisions: list[str] | None = None, presets: list[str] | None = None) -> list[Lap]:
    """The race, printed as a table whose last line is the headline; returns the laps (the reference first)."""
    from gptlab.runs import data_dir_for

    data = data or data_dir_for(None, "char-quick", quiet=True)
    reference = reference or REFERENCE
    watch, laps = LoadWatch(), []
    with tempfile.TemporaryDirectory(prefix="gptlab-bench-race-") as tmp:
        ref_lap, ref_history = run_lap("nanoGPT CPU recipe (reference)", data, reference["model"],
                                       reference["train"], Path(tmp) / "reference", eval_every, None)
        target = ref_lap.final_val if target is None else target
        ref_lap.steps_to_target, ref_lap.seconds_to_target = time_to_target(ref_history, target)
        laps.append(ref_lap)
        for name, preset, model, train in contenders(optimizers, precisions, changes, presets):
            laps.append(run_lap(name, data, model, train, Path(tmp) / name.replace(", ", "-"), eval_every,
                                target, preset=preset)[0])
    print_race(laps, target, watch.stop().report())
    return laps


def print_race(laps: list[Lap], target: float, load: str) -> None:
    print(f"race to validation loss {target:.4f} on the bundled Tiny Shakespeare (training time: steps only)")
    print(f"{'contender':<34} {'steps':>6} {'seconds':>8} {'final val':>9} {'all steps s':>11} {'vs reference':>12}")
    ref = laps[0].seconds_to_target
    for lap in laps:
        steps = f"{lap.steps_to_target:,}" if lap.steps_to_target is not None else "never"
        seconds = f"{lap.seconds_to_target:.1f}" if lap.seconds_to_target is not None else "-"
        ratio = f"{ref / lap.seconds_to_target:.2f}x" if ref and lap.seconds_to_target else "-"
        print(f"{lap.name:<34} {steps:>6} {seconds:>8} {lap.final_val:>9.4f} {lap.train_seconds:>11.1f} {ratio:>12}")
    print(load)
    best = min((lap for lap in laps[1:] if lap.seconds_to_target), key=lambda lap: lap.seconds_to_target,
               default=None)
    if best is None or not ref:
        print("headline: no contender reached the target")
    else:
        print(f"headline: {best.name} reaches the reference's {target:.4f} {ref / best.seconds_to_target:.2f}x "
              "faster than the reference")
