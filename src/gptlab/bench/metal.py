"""`gptlab bench metal`: the fast C++ engine's ladder (gptlab.reference.fast: loop order, cache tiles, vectors,
threads, fusion) against torch, on the training step the training loop runs (train_step: forward, backward,
global-norm clipping, AdamW). One run times, per shape and interleaved step by step as `bench reference` does (its
time_shape), each chosen rung of the fast engine in fp32, the naive engine where asked (it is slow), torch in fp32
(eager) and the fastest torch path on this CPU. Each row: ms per step, tokens/s, model GFLOP/s and their share of
the cached measured peak of the row's precision, and "vs torch fp32": torch fp32's median step over the row's (above
1: faster than torch eager). Then the top rung's step by function from its own clock, with what its matrix products
(linear_forward, linear_backward) reach: their FLOPs are counted from the shape (product_flops).

A shape is a preset, or PRESET@CONTEXT: the preset's model at that context (gpt2@256: GPT-2 124M at context 256).
Results: docs/benchmarks.md."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import torch

from gptlab.bench.presets import SHAPED_PRESETS
from gptlab.bench.reference import (
    NAIVE_CONTENDER,
    TORCH_FP32,
    ReferenceShape,
    StepContender,
    fastest_torch,
    measure,
    print_machine,
    print_rows,
    reference_shapes,
    share_cell,
    time_shape,
    torch_contenders,
)
from gptlab.config import ModelConfig, TrainConfig, build
from gptlab.errors import GptlabError
from gptlab.peak import Peak

METAL_SHAPES = ("char-quick", "char-small", "gpt2@256")  # the default shapes
# the default batch of a preset not timed at its own (char-quick is, at 32); any other preset: reference_shapes' rule
METAL_BATCHES = {"char-small": 8, "gpt2": 4}
CLOCKED_PRODUCTS = ("linear_forward", "linear_backward")  # the engine's functions product_flops counts the FLOPs of


def parse_rungs(text: str | None) -> tuple[str, ...]:
    """The fast engine's rungs named in `text` ("simd,fused"; None: every rung), in the ladder's order, each once;
    GptlabError naming the rungs for a name that is none of them."""
    from gptlab.reference.fast import RUNGS

    if text is None:
        return RUNGS
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in RUNGS:
            raise GptlabError(f"--rungs: no rung named {name!r}; the rungs are {', '.join(RUNGS)} (comma-separated)")
    return tuple(rung for rung in RUNGS if rung in names)


def metal_shapes(specs: tuple[str, ...] | list[str] | None = None, batch_size: int | None = None,
                 tiny: bool = False) -> list[ReferenceShape]:
    """The shapes `specs` name (default METAL_SHAPES), each PRESET or PRESET@CONTEXT (the preset's model with
    block_size CONTEXT), at `batch_size` if given, else METAL_BATCHES' or reference_shapes' batch for the preset.
    tiny: every shape two layers 32 wide, context 16, batch 2 (or `batch_size`), whatever CONTEXT says (tests).
    GptlabError for a preset that names no GPT's shape, a context that is not a whole number of at least 1, or a
    batch size below 1."""
    if batch_size is not None and batch_size < 1:
        raise GptlabError(f"--batch-size must be >= 1, not {batch_size}")
    shapes = []
    for spec in specs or METAL_SHAPES:
        preset, _, context = spec.partition("@")
        if preset not in SHAPED_PRESETS:
            raise GptlabError(f"--presets: {spec!r} names no GPT preset; each is PRESET or PRESET@CONTEXT with PRESET "
                              f"one of {', '.join(SHAPED_PRESETS)}")
        if context and not (context.isdigit() and int(context) >= 1):
            raise GptlabError(f"--presets: {spec!r}: the context after @ must be a whole number of at least 1")
        batch = batch_size if batch_size is not None or tiny else METAL_BATCHES.get(preset)
        (shape,) = reference_shapes([preset], batch, tiny=tiny)
        if context and not tiny:
            model = build(ModelConfig, dataclasses.asdict(shape.model), {"block_size": int(context)})
            shape = dataclasses.replace(shape, name=spec, model=model)
        shapes.append(shape)
    return shapes


def product_flops(model: ModelConfig, tokens: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of a step's Linear products over `tokens` = B x T positions, counted as 2 per
    multiply-add: forward 2 N (12 C^2 L + C V), every block's QKV (C x 3C), attention output (C x C), MLP up
    (C x 4C) and down (4C x C), and the LM head (C x V); backward twice that, the input's gradient dy W and the
    weight's dy^T x of every one of them (the first block's input gradient included: the embeddings need it).
    Not counted: the biases and their gradients' column sums, an activation fused into a product, attention's
    own products (QK^T, AV: attention_forward / attention_backward)."""
    C, L, V = model.n_embd, model.n_layer, model.vocab_size
    forward = 2.0 * tokens * (12 * C * C * L + C * V)
    return forward, 2 * forward


def _fast_engine(rung: str, model: Any, cfg: TrainConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from gptlab.reference.fast import fast_model, fast_optimizer

    model = fast_model(model, rung)
    return model, fast_optimizer(model, cfg, rung)


def fast_contender(rung: str) -> StepContender:
    """The row of one rung of the fast engine: fp32, its model and its AdamW."""
    return StepContender(f"fast C++ fp32 ({rung})", "fp32", functools.partial(_fast_engine, rung))


def time_metal_shape(shape: ReferenceShape, steps: int, warmup: int, peak: Peak | None, rungs: tuple[str, ...],
                     naive: bool = False) -> dict[str, Any]:
    """The naive engine (with `naive`), each of `rungs`, torch fp32 and the fastest torch path, timed on `shape`
    by bench.reference.time_shape with the top rung's clock; returns metal_result's."""
    from gptlab.reference.fast import fast_library

    contenders = [*([NAIVE_CONTENDER] if naive else []), *map(fast_contender, rungs), *torch_contenders()]
    top = int(naive) + len(rungs) - 1  # the last rung's row
    result = time_shape(shape, steps, warmup, peak, contenders, fast_library(rungs[-1]), clocked=top)
    return metal_result(result, shape, contenders[top].name, peak)


def metal_result(result: dict[str, Any], shape: ReferenceShape, top: str, peak: Peak | None) -> dict[str, Any]:
    """time_shape's result made this bench's: each row's vs_torch (torch fp32's median over the row's) in place of
    vs_naive; the clock's figures under top_* with `top` the clocked rung's row; `products`: what product_flops
    counts and what the top rung's linear_forward and linear_backward reach (seconds per step, GFLOP/s, share of
    the fp32 peak; None where the function never ran or there is no peak); `headline`: the top rung over torch fp32
    and the fastest torch path, and both products together."""
    rows = {row["contender"]: row for row in result["rows"]}
    torch_ms = rows[TORCH_FP32]["ms_per_step"]
    for row in result["rows"]:
        del row["vs_naive"]  # the top rung's median over the row's: the ratio here is torch fp32's
        row["vs_torch"] = torch_ms / row["ms_per_step"]
    result = {**{k: v for k, v in result.items() if not k.startswith("naive_")}, "top": top,
              "top_step_s": result["naive_step_s"], "top_by_function": result["naive_by_function"],
              "top_rest_s": result["naive_rest_s"]}
    forward, backward = product_flops(shape.model, result["tokens_per_step"])
    seconds = {name: result["top_by_function"].get(name, 0.0) for name in CLOCKED_PRODUCTS}
    products = {name: _reach(flops, seconds[name], peak)
                for name, flops in zip(CLOCKED_PRODUCTS, (forward, backward))}
    both = _reach(forward + backward, sum(seconds.values()), peak)
    fastest = rows[fastest_torch()[0]]
    result["products"] = {**products, "both": both}
    result["headline"] = {"vs_torch_fp32": rows[top]["vs_torch"],
                          "vs_torch_fastest": fastest["ms_per_step"] / rows[top]["ms_per_step"],
                          "torch_fastest": fastest["contender"], "products_gflops": both["gflops"],
                          "products_share": both["share"]}
    return result


def _reach(flops: float, seconds: float, peak: Peak | None) -> dict[str, Any]:
    """FLOPs done in `seconds`: the rate in GFLOP/s and its share of the fp32 peak (None without time or peak)."""
    rate = flops / seconds if seconds > 0 else None
    share = rate / peak.fp32 if rate is not None and peak is not None else None
    return {"flops": flops, "seconds": seconds, "gflops": rate / 1e9 if rate is not None else None, "share": share}


def run_metal_bench(shapes: list[ReferenceShape], rungs: tuple[str, ...] | None = None, *, naive: bool = False,
                    steps: int = 3, warmup: int = 1, as_json: bool = False) -> dict[str, Any]:
    """`gptlab bench metal`: time every shape (time_metal_shape) with `rungs` (default every rung; the last is the
    top rung, whose clock is read) and, with `naive`, the naive engine; then print the machine, the fast library,
    the load and, per shape, the table and the top rung's step by function, the headlines last; as_json: one JSON
    object instead. The peak is the cached one (bench.reference.measure). Returns what as_json prints. ValueError
    for steps below 1 or warmup below 0; ReferenceUnavailable (one line) where there is no C++ compiler."""
    from gptlab.reference.fast import RUNGS, describe_rung, fast_library, tiles

    rungs = rungs or RUNGS
    lib = fast_library(rungs[-1])  # built (or refused in one line) before anything is timed
    report, load = measure(shapes, steps, warmup, functools.partial(time_metal_shape, rungs=rungs, naive=naive))
    report.update(naive=naive, fast={"rungs": list(rungs), "top": rungs[-1], "library": describe_rung(lib),
                                     "tiles": tiles(lib)})
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_metal_report(report, load)
    return report


def print_metal_report(report: dict[str, Any], load: str) -> None:
    """The machine and the peak, the load, the fast library, what the columns and the products' FLOPs are, each
    shape's table and its top rung's step by function, then one headline line per shape."""
    print_machine(report, load)
    fast, tile = report["fast"], report["fast"]["tiles"]
    print(f"fast engine (top rung): {fast['library']}; kernel block {tile['mr']} x {tile['nr']}, cache tiles "
          f"MC {tile['mc']}, KC {tile['kc']}, NC {tile['nc']}")
    print(f"threads: torch {report['threads']}, the rungs from threads up as many, those below it and the naive "
          "engine one; a share is of the peak of the precision the row computes in (fp32 / bf16), measured with "
          "torch's threads")
    steps = report["shapes"][0]["steps"] if report["shapes"] else 0
    print(f"ms/step: the median of {steps} timed steps after {report['warmup']} untimed (best: the fastest); "
          "tokens/s, GFLOP/s (model FLOPs) and the share from the median; vs torch fp32: the torch fp32 ms over the "
          "row's (above 1: faster than torch eager)")
    print("the products: linear_forward's FLOPs 2 B T (12 C^2 L + C V) a step (every block's four Linears and the LM "
          "head), linear_backward's twice that (dy W and dy^T x); biases, fused activations and attention's own "
          "products not counted")
    for result in report["shapes"]:
        print_rows(result, "vs_torch", "vs torch fp32")
        _print_clock(result)
    print()
    for result in report["shapes"]:
        print(_headline(result, fast["top"]))


def _print_clock(result: dict[str, Any]) -> None:
    """The top rung's step by function (ms a step, share of its mean timed step; the products' GFLOP/s and share
    of the fp32 peak beside theirs), with the rest."""
    step = result["top_step_s"]
    print(f"{result['top']} step by function (the engine's clock; mean of the timed steps, {step * 1e3:,.2f} ms):")
    for name, seconds in result["top_by_function"].items():
        reach = result["products"].get(name)
        rate = f" {reach['gflops']:>10,.3f} GFLOP/s {share_cell(reach['share'])} of the fp32 peak" if reach else ""
        print(f"  {name:<36} {seconds * 1e3:>12,.2f} ms {seconds / step:>7.2%}{rate}")
    rest = result["top_rest_s"]
    print(f"  {'the rest (no function of the engine)':<36} {rest * 1e3:>12,.2f} ms {rest / step:>7.2%}  "
          "(the dropout masks' draws, gradients zeroed, copies, Python)")


def _headline(result: dict[str, Any], rung: str) -> str:
    """"PRESET: top rung RUNG X.XXx torch eager fp32, Y.YYx torch fastest; the products at Z% of the fp32 peak"."""
    h = result["headline"]
    if h["products_share"] is not None:
        products = f"at {h['products_share']:.2%} of the fp32 peak"
    elif h["products_gflops"] is not None:
        products = f"at {h['products_gflops']:,.3f} GFLOP/s (no peak measured)"
    else:
        products = "not clocked"
    return (f"{result['preset']}: top rung {rung} {h['vs_torch_fp32']:,.2f}x torch eager fp32, "
            f"{h['vs_torch_fastest']:,.2f}x torch fastest; the products {products}")
