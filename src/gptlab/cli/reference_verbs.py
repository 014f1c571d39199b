"""`gptlab reference`: the naive C++ engine (gptlab.reference) held against the torch model on a run."""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.cli.common import Subcommands, announce, at_least, command
from gptlab.errors import GptlabError

CHECKS = Subcommands("reference", "WHAT")


def add_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="run folder (default: the most recent under runs/)")
    p.add_argument("--precision", choices=("fp32", "fp64"), default="fp32",
                   help="both sides in this precision (fp64: the engine's double build beside torch in float64) "
                        "(default fp32)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences in the batch (default 4)")
    p.add_argument("--seed", type=int, default=0, help="which batch of the validation split (default 0)")


@CHECKS("check", "the naive engine beside the torch model on a batch of the run's data: the largest absolute "
           "and relative difference of the logits, the loss and every parameter's gradient", add_check)
def check_run(args: argparse.Namespace) -> int:
    from gptlab import lora
    from gptlab.checkpoint import load_run
    from gptlab.data.batches import batch_generator, get_batch, load_dataset
    from gptlab.model import is_gpt
    from gptlab.reference.check import compare_engines
    from gptlab.reference.library import load_library
    from gptlab.runs import latest_run, run_data_dir

    at_least(args, batch_size=1)
    run = Path(args.run) if args.run else latest_run()
    loaded = load_run(run)
    if not is_gpt(loaded.model):
        raise GptlabError(f"run {run} is not a GPT (the reference engine implements the GPT alone)")
    data = run_data_dir(run)
    if data is None:
        raise GptlabError(f"run {run} has no data folder recorded (an imported model); train it on data first")
    load_library()  # no compiler: refused in one line before the data is read
    split = load_dataset(data).val
    x, y = get_batch(split, args.batch_size, loaded.model.config.block_size, batch_generator(args.seed, 0, -1))
    announce(loaded)
    rows = compare_engines(loaded.model, x, y, args.precision)
    width = max(len(r.tensor) for r in rows)
    merged = ", the LoRA adapters merged into the base" if lora.settings(loaded.state.train) else ""
    print(f"reference engine vs torch{merged}, {args.precision}, batch {args.batch_size} x {x.shape[1]} of {data}'s "
          f"validation split (relative: max |a - b| / max |b|)")
    print(f"{'tensor':<{width}}  {'max abs':>10}  {'max rel':>10}")
    for r in rows:
        print(f"{r.tensor:<{width}}  {r.max_abs:>10.3e}  {r.max_rel:>10.3e}")
    worst = max(rows, key=lambda r: r.max_rel)
    print(f"worst: {worst.tensor}, relative {worst.max_rel:.3e}")
    return 0


@command("reference", "the naive C++ engine (no autograd) against the torch model: `reference check`")
def cmd_reference(args: argparse.Namespace) -> int:
    return CHECKS.run(args)


def add_reference(p: argparse.ArgumentParser) -> None:
    CHECKS.add_to(p)
