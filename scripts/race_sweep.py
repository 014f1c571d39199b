"""The race's levers one at a time (issue 25, part 3): trains variants of the default preset in fp32 on the bundled
Tiny Shakespeare, evaluated as `gptlab bench race` evaluates (every 25 steps, 20 fixed batches), and prints for each
the first step at or under the target, the tokens and the model FLOPs (GPT.flops_per_token) it took to get there,
its final loss and its training seconds. Steps and tokens do not depend on the machine's load; seconds do (run it alone for those).

    python scripts/race_sweep.py                    # every variant below
    python scripts/race_sweep.py base cos-300       # some of them
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

TARGET = 1.9026  # the nanoGPT CPU recipe's final validation loss in `gptlab bench race` (docs/benchmarks.md)
FP32 = {"precision": "fp32"}

# name: (model overrides, train overrides) on top of the char-quick preset
VARIANTS: dict[str, tuple[dict, dict]] = {
    "base": ({}, {}),
    "muon": ({}, {"optimizer": "muon"}),
}
for n in (250, 300, 400, 450, 500):  # the cosine's end placed near where the target falls
    VARIANTS[f"cos-{n}"] = ({}, {"max_steps": n})
for n in (200, 250, 300):
    VARIANTS[f"muon-cos-{n}"] = ({}, {"max_steps": n, "optimizer": "muon"})
for lr in (3e-3, 1e-2, 1.5e-2):
    VARIANTS[f"lr-{lr:g}-cos-300"] = ({}, {"max_steps": 300, "lr": lr, "min_lr": lr / 10})
for bs in (16, 24, 48):
    VARIANTS[f"batch-{bs}-cos-{int(300 * 32 / bs)}"] = ({}, {"batch_size": bs, "max_steps": int(300 * 32 / bs)})
for mlr in (0.01, 0.04):
    VARIANTS[f"muon-lr-{mlr:g}-cos-250"] = ({}, {"optimizer": "muon", "muon_lr": mlr, "max_steps": 250})
VARIANTS["3-layers-cos-300"] = ({"n_layer": 3}, {"max_steps": 300})
for layers, width in ((2, 192), (3, 192), (2, 256)):  # wider and shallower: fewer steps to the target
    for n in (300, 400):
        VARIANTS[f"{layers}x{width}-cos-{n}"] = ({"n_layer": layers, "n_embd": width, "n_head": 4}, {"max_steps": n})
W192 = {"n_layer": 2, "n_embd": 192, "n_head": 4}
VARIANTS["2x192-batch-16-cos-600"] = (W192, {"batch_size": 16, "max_steps": 600})
for n in (175, 200, 250):  # Muon on the wider, shallower model
    VARIANTS[f"2x192-muon-cos-{n}"] = (W192, {"optimizer": "muon", "max_steps": n})
for mlr in (0.03, 0.04, 0.06):
    for n in (150, 175, 200, 225, 250):
        VARIANTS[f"2x192-muon-lr-{mlr:g}-cos-{n}"] = (W192, {"optimizer": "muon", "muon_lr": mlr, "max_steps": n})
VARIANTS["2x192-muon-lr-0.04-adamw-lr-0.01-cos-175"] = (W192, {"optimizer": "muon", "muon_lr": 0.04, "lr": 0.01,
                                                               "min_lr": 0.001, "max_steps": 175})
VARIANTS["2x192-muon-batch-24-cos-250"] = (W192, {"optimizer": "muon", "batch_size": 24, "max_steps": 250})
VARIANTS["2x256-muon-cos-200"] = ({"n_layer": 2, "n_embd": 256, "n_head": 4}, {"optimizer": "muon", "max_steps": 200})
VARIANTS["3x192-muon-cos-200"] = ({"n_layer": 3, "n_embd": 192, "n_head": 4}, {"optimizer": "muon", "max_steps": 200})
VARIANTS["context-32-batch-64-cos-300"] = ({"block_size": 32}, {"batch_size": 64, "max_steps": 300})
VARIANTS["warmup-20-cos-300"] = ({}, {"max_steps": 300, "warmup_steps": 20})


def run(name: str, model: dict, train: dict, data: Path, folder: Path) -> str:
    """One variant, raced as `gptlab bench race` races a contender (bench.race.run_lap), as a table row."""
    from gptlab.bench.race import run_lap
    from gptlab.config import ModelConfig, build
    from gptlab.model import build_model

    began = time.perf_counter()
    lap, _ = run_lap(name, data, model, {**FP32, **train}, folder, 25, TARGET)
    wall = time.perf_counter() - began
    config = json.loads((folder / "config.json").read_text())
    cfg_m, cfg_t = config["model"], config["train"]
    per_token = build_model(build(ModelConfig, cfg_m, {})).flops_per_token()  # model FLOPs, training (x3)
    tokens = (lap.steps_to_target or 0) * cfg_t["batch_size"] * cfg_t["grad_accum"] * cfg_m["block_size"]
    to_target = lap.seconds_to_target if lap.seconds_to_target is not None else float("nan")
    return (f"{name:<30} {lap.steps_to_target if lap.steps_to_target is not None else 'never':>6} {tokens:>10,} "
            f"{tokens * per_token / 1e12:>8.2f} {lap.final_val:>9.4f} {to_target:>8.1f} {lap.train_seconds:>8.1f} "
            f"{wall:>7.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help=f"default: all of {', '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        print(f"race_sweep: unknown variant {', '.join(unknown)}", file=sys.stderr)
        return 2
    import torch

    from gptlab.runs import data_dir_for
    if args.threads:
        torch.set_num_threads(args.threads)
    data = data_dir_for(None, "char-quick", quiet=True)
    print(f"target {TARGET}; fp32; {torch.get_num_threads()} torch threads")
    print(f"{'variant':<30} {'steps':>6} {'tokens':>10} {'TFLOP':>8} {'final val':>9} {'to tgt s':>8} "
          f"{'train s':>8} {'wall s':>7}")
    with tempfile.TemporaryDirectory(prefix="gptlab-race-sweep-") as tmp:
        for name in args.variants or VARIANTS:
            model, train = VARIANTS[name]
            print(run(name, model, train, data, Path(tmp) / name), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
