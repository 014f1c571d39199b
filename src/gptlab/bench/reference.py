"""`gptlab bench reference`: the table the hardware work starts from, before anything is optimised. One training
step of a preset's GPT (forward, backward, global-norm clipping, AdamW: the training loop's own train_step) computed
three ways, side by side on the same random token batches: the naive C++ engine in fp32 (gptlab.reference: plain
loops on one thread, no speed goal), torch in fp32 (eager, the training path's reference) and the fastest torch path
on this CPU (bf16 autocast where the CPU computes bf16 natively, else fp32). Each row: ms per step, tokens/s, model
GFLOP/s (GPT.flops_per_token: the matrix products and attention, x3 for training) and their share of the cached
measured peak of the row's precision, and the naive row's ms over the row's. Then the naive step's time by function,
from the engine's own clock (native.profile), and what no function of it accounts for.

A preset is timed at its own batch unless a naive step of that batch is over NAIVE_STEP_LIMIT model FLOPs: then at
batch 1 (char-small's full batch is over a TFLOP). `bench metal` (bench/metal.py) times other contenders
with the same pieces: StepContender, time_shape with another engine's clock, measure, print_rows. Results:
docs/benchmarks.md."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gptlab.bench.matmul import model_config
from gptlab.bench.timing import LoadWatch, median
from gptlab.config import ModelConfig, TrainConfig, build, get_preset
from gptlab.peak import Peak, Speed, peak_key, read_peak
from gptlab.runtime import bf16_supported, device_name, reuse_freed_memory, set_threads

if TYPE_CHECKING:
    from gptlab.training.step import StepContext

DEFAULT_PRESETS = ("char-quick", "char-small")
NAIVE_STEP_LIMIT = 1e12  # model FLOPs of a naive step of the preset's batch above which the preset runs batch 1
NAIVE = "naive C++ fp32"
TORCH_FP32 = "torch fp32"  # eager, the training path's reference
CPU = torch.device("cpu")
_TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}  # --tiny (tests): every preset so, batch 2
_TOKENS = 1 << 16  # random tokens the batches are drawn from


@dataclass(frozen=True)
class ReferenceShape:
    """One preset as the bench times it: its label, its model and its training settings (batch size included)."""

    name: str
    model: ModelConfig
    train: TrainConfig


@dataclass
class StepPath:
    """One way to compute the step: its name and precision, its own model and optimizer (from the same seed as the
    others), the step context (data, settings, precision) and its timed steps."""

    name: str
    precision: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ctx: StepContext
    times: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class StepContender:
    """One way to compute the step, before it is built: its name, its precision and its engine, which takes a
    fresh GPT and the training settings and returns the model and optimizer that compute the step."""

    name: str
    precision: str
    engine: Callable[[Any, TrainConfig], tuple[torch.nn.Module, torch.optim.Optimizer]]


def reference_shapes(presets: tuple[str, ...] | list[str] = DEFAULT_PRESETS, batch_size: int | None = None,
                     tiny: bool = False) -> list[ReferenceShape]:
    """The shapes `presets` are timed at: each preset's model (Tiny Shakespeare's vocabulary where it comes from
    the data) and training settings on the CPU, at `batch_size` if given, else the preset's batch or 1 (see
    NAIVE_STEP_LIMIT). tiny: every preset at a two-layer, 32-wide shape, batch 2 (tests). GptlabError on an unknown
    preset or a batch size below 1."""
    from gptlab.model import GPT

    shapes = []
    for name in presets:
        model = model_config(name)
        if tiny:
            model = build(ModelConfig, dataclasses.asdict(model), _TINY)
        train = build(TrainConfig, get_preset(name).train, {"device": "cpu", "grad_accum": 1})
        if batch_size is None and not tiny:
            with torch.device("meta"):  # the shape alone: no memory, no initialisation
                full = GPT(model).flops_per_token() * model.block_size * train.batch_size
            batch = train.batch_size if full <= NAIVE_STEP_LIMIT else 1
        else:
            batch = 2 if batch_size is None else batch_size
        train = build(TrainConfig, dataclasses.asdict(train), {"batch_size": batch})
        shapes.append(ReferenceShape(f"{name} (tiny)" if tiny else name, model, train))
    return shapes


def fastest_torch() -> tuple[str, str]:
    """(name, precision) of the fastest torch path on this CPU: bf16 autocast where bf16 is native, else fp32."""
    if bf16_supported(CPU):
        return "torch fastest (bf16 autocast)", "bf16"
    return "torch fastest (fp32: no native bf16)", "fp32"


def torch_engine(model: Any, cfg: TrainConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The training path's own: `model` itself and the optimizer training makes for it."""
    from gptlab.optim import make_optimizer

    return model, make_optimizer(model, cfg)


def naive_engine(model: Any, cfg: TrainConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The naive C++ engine's: `model` computed by it, and its AdamW."""
    from gptlab.reference.naive_training import naive_model, naive_optimizer

    model = naive_model(model)
    return model, naive_optimizer(model, cfg)


NAIVE_CONTENDER = StepContender(NAIVE, "fp32", naive_engine)


def torch_contenders() -> list[StepContender]:
    """Torch in fp32 (eager, the training path's reference), then the fastest torch path on this CPU."""
    return [StepContender(TORCH_FP32, "fp32", torch_engine), StepContender(*fastest_torch(), torch_engine)]


def _step_paths(shape: ReferenceShape, contenders: list[StepContender] | None = None) -> list[StepPath]:
    """Each contender (default: the naive engine, then torch_contenders), each its own model from the preset's
    seed, over one random token stream (what a step reads of a Dataset: no corpus needed)."""
    from gptlab.data.batches import Dataset
    from gptlab.model import GPT
    from gptlab.training.step import StepContext

    cfg, T = shape.train, shape.model.block_size
    stream = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(shape.model.vocab_size, (max(_TOKENS, T + 1),), generator=stream).numpy()
    data = Dataset(path=None, train=tokens, val=tokens, tokenizer=None, meta={})
    paths = []
    for contender in contenders or [NAIVE_CONTENDER, *torch_contenders()]:
        torch.manual_seed(cfg.seed)
        model, optimizer = contender.engine(GPT(shape.model).train(), cfg)
        paths.append(StepPath(contender.name, contender.precision, model, optimizer,
                              StepContext(data, cfg, T, CPU, contender.precision)))
    return paths


def time_shape(shape: ReferenceShape, steps: int, warmup: int, peak: Peak | None,
               contenders: list[StepContender] | None = None, lib: Any = None, clocked: int = 0) -> dict[str, Any]:
    """`warmup` untimed steps, then `steps` timed ones, of each contender's path (default: the naive engine's,
    torch's), interleaved step by step (a busy machine slows them alike); the clock of `lib` (default the naive
    engine's library: the one contenders[clocked] computes with) is reset after the warm-up and read after the
    last step. Returns the shape's result (see shape_result)."""
    from gptlab.reference.library import load_library, profile, reset_profile
    from gptlab.training.step import train_step

    paths = _step_paths(shape, contenders)
    lib = load_library() if lib is None else lib
    for step in range(warmup + steps):
        if step == warmup:
            reset_profile(lib)
        for path in paths:
            start = time.perf_counter()
            train_step(path.model, path.optimizer, path.ctx, step)
            if step >= warmup:
                path.times.append(time.perf_counter() - start)
    return shape_result(shape, paths, profile(lib), peak, clocked)


def shape_result(shape: ReferenceShape, paths: list[StepPath], by_function: dict[str, float],
                 peak: Peak | None, clocked: int = 0) -> dict[str, Any]:
    """The rows (from each path's median step; share None without a peak; vs_naive: the clocked path's median over
    the row's) and the clocked path's engine's seconds per step by function (its clock's total over the timed steps
    / steps, slowest first, functions that never ran left out), with `naive_rest`: the rest of its mean timed step.
    clocked: the index of the path whose engine `by_function` clocks (default 0, the naive engine; the keys keep
    its name)."""
    model, cfg = paths[0].model, shape.train
    flops_per_token, tokens = model.flops_per_token(), cfg.batch_size * shape.model.block_size
    naive_s, rows = median(paths[clocked].times), []
    for path in paths:
        seconds, key = median(path.times), peak_key(path.precision)
        tokens_per_s, share = Speed(tokens, flops_per_token, peak.flops(key) if peak else None).rates(1, seconds)
        rows.append({"contender": path.name, "precision": path.precision, "ms_per_step": seconds * 1e3,
                     "best_ms": min(path.times) * 1e3, "tokens_per_s": tokens_per_s,
                     "gflops": tokens_per_s * flops_per_token / 1e9, "share": share, "peak": key,
                     "vs_naive": naive_s / seconds})
    steps = len(paths[clocked].times)
    functions = {k: v / steps for k, v in sorted(by_function.items(), key=lambda kv: -kv[1]) if v > 0}
    naive_step = sum(paths[clocked].times) / steps
    c = shape.model
    return {"preset": shape.name, "n_layer": c.n_layer, "n_embd": c.n_embd, "block_size": c.block_size,
            "vocab_size": c.vocab_size, "dropout": c.dropout, "batch_size": cfg.batch_size, "tokens_per_step": tokens,
            "params": model.num_params(), "flops_per_token": flops_per_token, "steps": steps, "rows": rows,
            "naive_step_s": naive_step, "naive_by_function": functions,
            "naive_rest_s": naive_step - sum(functions.values())}


def run_reference_bench(shapes: list[ReferenceShape], *, steps: int = 2, warmup: int = 1,
                        as_json: bool = False) -> dict[str, Any]:
    """`gptlab bench reference`: time every shape (time_shape), then print the machine, its load and, per shape,
    the table and the naive step by function, the headline last; as_json: one JSON object instead. The peak is
    the cached one (never measured here: that would need a quiet machine); without it the share is left out.
    Returns what as_json prints. ValueError for steps below 1 or warmup below 0; ReferenceUnavailable (one line)
    where there is no C++ compiler."""
    report, load = measure(shapes, steps, warmup, time_shape)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, load)
    return report


def measure(shapes: list[ReferenceShape], steps: int, warmup: int,
            time_one: Callable[[ReferenceShape, int, int, Peak | None], dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """time_one(shape, steps, warmup, peak) of every shape with torch's threads set and freed memory reused (as
    training does), under a load watch: (the report: the machine, its threads, the cached peak, the load and the
    shapes' results; the load's printed lines). ValueError for steps below 1 or warmup below 0."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be at least 1 and warmup at least 0, not {steps} and {warmup}")
    set_threads()
    reuse_freed_memory()  # as training does
    peak = read_peak(CPU)
    watch = LoadWatch()
    results = [time_one(shape, steps, warmup, peak) for shape in shapes]
    load = watch.stop()
    return {"device": device_name(CPU), "threads": torch.get_num_threads(), "warmup": warmup,
            "peak": peak.to_json() if peak else None, "load": load.line(), "busy": load.busy,
            "shapes": results}, load.report()


def print_machine(report: dict[str, Any], load: str) -> None:
    """The device and its cached peaks (or how to measure them), then the load."""
    peak = report["peak"]
    if peak:
        print(f"device: {report['device']}; peaks measured {peak.get('measured_at') or '?'}: " + ", ".join(
            f"{k} {peak[k] / 1e9:,.0f} GFLOP/s" for k in ("fp32", "bf16") if peak.get(k)))
    else:
        print(f"device: {report['device']}; no measured peak for it, so no share of the peak (\"-\"): "
              "`gptlab bench peak` measures it on a quiet machine and keeps it")
    print(load)


def print_report(report: dict[str, Any], load: str) -> None:
    """The machine and the peak, the load, what the columns are, each shape's table and its naive step by
    function, then one headline line per shape."""
    print_machine(report, load)
    print(f"threads: torch {report['threads']}, the naive engine one; a share is of the peak of the precision "
          "the row computes in (fp32 / bf16), measured with torch's threads")
    steps = report["shapes"][0]["steps"] if report["shapes"] else 0
    print(f"ms/step: the median of {steps} timed steps after {report['warmup']} untimed (best: the fastest); "
          "tokens/s, GFLOP/s (model FLOPs) and the share from the median; vs naive: the naive ms over the row's")
    for result in report["shapes"]:
        _print_shape(result)
    print()
    for result in report["shapes"]:
        naive, fp32, fast = result["rows"]
        share = f"at {naive['share']:.2%} of the fp32 peak" if naive["share"] is not None else "(no peak measured)"
        print(f"{result['preset']}: {fast['contender']} runs {fast['vs_naive']:,.2f}x the naive engine's tokens/s, "
              f"torch fp32 {fp32['vs_naive']:,.2f}x; the naive step {share}")


def share_cell(share: float | None) -> str:
    """A share of the peak as a table cell, 7 wide (a percentage to two decimals), or "-" without a peak."""
    return f"{share:>7.2%}" if share is not None else f"{'-':>7}"


def _print_shape(result: dict[str, Any]) -> None:
    """One shape: its model line, its table, and the naive step by function with the rest."""
    print_rows(result)
    step = result["naive_step_s"]
    print(f"{NAIVE} step by function (the engine's clock; mean of the timed steps, {step * 1e3:,.2f} ms):")
    for name, seconds in result["naive_by_function"].items():
        print(f"  {name:<36} {seconds * 1e3:>12,.2f} ms {seconds / step:>7.2%}")
    rest = result["naive_rest_s"]
    print(f"  {'the rest (no function of the engine)':<36} {rest * 1e3:>12,.2f} ms {rest / step:>7.2%}  "
          "(residual adds, copies, dropout masks drawn by torch, Python)")


def print_rows(result: dict[str, Any], ratio: str = "vs_naive", title: str = "vs naive") -> None:
    """One shape's model line and its table of rows, the last column each row's `ratio` headed `title`."""
    print()
    print(f"{result['preset']}: {result['n_layer']} layers x {result['n_embd']} wide, context {result['block_size']}, "
          f"vocabulary {result['vocab_size']}, {result['params'] / 1e6:.2f}M parameters, "
          f"{result['flops_per_token'] / 1e6:,.3f} MFLOP per token (training); batch {result['batch_size']}; "
          f"dropout {result['dropout']}")
    batch, width = f"{result['batch_size']} x {result['block_size']}", max(9, len(title))
    print(f"{'contender':<38} {'batch x T':>10} {'ms/step':>12} {'best':>12} {'tokens/s':>10} {'GFLOP/s':>9} "
          f"{'% peak':>7} {title:>{width}}")
    for r in result["rows"]:
        print(f"{r['contender']:<38} {batch:>10} {r['ms_per_step']:>12,.2f} {r['best_ms']:>12,.2f} "
              f"{r['tokens_per_s']:>10,.1f} {r['gflops']:>9.3f} {share_cell(r['share'])} {r[ratio]:>{width - 1},.2f}x")
