"""`gptlab bench matmul`: the ceiling on bf16's training speed-up for one preset (char-small by default): how much
faster its own matrix products run in bf16.

Every nn.Linear of the model (for char-small: 6 x 384, batch 16 x context 256 = 4,096 rows) does three products
per training step: the forward x W^T, the input gradient g W and the weight gradient g^T x. This times each, fp32
and bf16 (best of `repeats`, torch's threads), and prints the GFLOP/s and the ratio of the totals: if everything
else in a step cost nothing, bf16 could not train faster than that ratio. With profile it also profiles one
whole training step in each precision (torch.profiler) and prints the time in matrix products and in the rest,
and what the rest is made of (`OP_KINDS`): where bf16's step goes once its products are fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gptlab.bench.timing import LoadWatch
from gptlab.config import ModelConfig, build, get_preset
from gptlab.model import GPT
from gptlab.runtime import autocast, reuse_freed_memory, set_threads

if TYPE_CHECKING:
    from torch.autograd.profiler_util import FunctionEvent

CHAR_VOCAB = 65  # Tiny Shakespeare's characters, for presets whose vocabulary comes from the data
PRODUCTS = ("forward", "input grad", "weight grad")


@dataclass
class MatmulResult:
    """GFLOP/s of each product of each Linear shape per precision, the totals, and the profiled steps."""

    rows: int
    gflops: dict[tuple[int, int], dict[str, list[float]]] = field(default_factory=dict)  # (in, out) -> prec -> 3
    total_s: dict[str, float] = field(default_factory=lambda: {"fp32": 0.0, "bf16": 0.0})
    steps: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # prec -> (step, products, rest) s
    rest: dict[str, dict[str, float]] = field(default_factory=dict)  # prec -> kind -> seconds (the rest, by kind)

    @property
    def ratio(self) -> float:
        """bf16's speed-up on all products, one of each."""
        return self.total_s["fp32"] / self.total_s["bf16"]


def best(fn: Callable[[], object], repeats: int = 10) -> float:
    """The fastest of `repeats` calls, after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def model_config(preset: str) -> ModelConfig:
    """The preset's model, with Tiny Shakespeare's vocabulary where the preset takes it from the data."""
    model = get_preset(preset).model
    return build(ModelConfig, {**model, "vocab_size": model.get("vocab_size") or CHAR_VOCAB}, {})


def linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of every distinct Linear of one block and the head: QKV, W_O, fc, proj, LM head."""
    C = config.n_embd
    return [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C), (C, config.vocab_size)]


def time_products(result: MatmulResult, shapes: list[tuple[int, int]], repeats: int) -> None:
    """Fill result.gflops and result.total_s: the three products of each shape at result.rows rows."""
    for k, n in shapes:
        result.gflops[k, n] = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            x, w, g = (torch.randn(*shape, dtype=dtype) for shape in ((result.rows, k), (n, k), (result.rows, n)))
            times = [best(lambda: x @ w.t(), repeats), best(lambda: g @ w, repeats), best(lambda: g.t() @ x, repeats)]
            result.total_s[name] += sum(times)
            result.gflops[k, n][name] = [2 * result.rows * k * n / t / 1e9 for t in times]


# What a profiled op's self time is counted as: the first of these found in the op's name or in one of its
# callers' (the innermost first), else "other"; modules of these types are labelled "module:<type>" while they run,
# so that all the work of a Dropout (its mask, its cast, its product) counts as dropout
OP_KINDS = (("module:Dropout", "dropout"), ("optimizer", "optimizer (AdamW)"), ("zero_grad", "zero_grad"),
            ("_to_copy", "casts"), ("ToCopyBackward", "casts"),
            ("aten::mm", "products"), ("aten::addmm", "products"), ("aten::bmm", "products"),
            ("layer_norm", "LayerNorm"), ("LayerNorm", "LayerNorm"), ("gelu", "GELU"), ("Gelu", "GELU"),
            ("log_softmax", "cross-entropy"), ("LogSoftmax", "cross-entropy"), ("nll_loss", "cross-entropy"),
            ("NllLoss", "cross-entropy"), ("softmax", "attention softmax"), ("Softmax", "attention softmax"),
            ("scaled_dot_product", "attention (sdpa)"), ("ScaledDotProduct", "attention (sdpa)"),
            ("module:Embedding", "embedding"), ("EmbeddingBackward", "embedding"), ("AccumulateGrad", "gradient adds"))
LABELLED = ("Dropout", "Embedding")  # module types whose whole forward counts as theirs


def kind_of(event: FunctionEvent | None) -> str:
    """The OP_KINDS label of one profiler event, from its own name and its callers'."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    if any("module:Dropout" in n for n in names):  # a dropout's mask, cast and product, wherever autograd puts them
        return "dropout"
    for name in names:
        for key, kind in OP_KINDS:
            if key in name:
                return kind
    return "other"


def label_modules(model: torch.nn.Module) -> None:
    """Wrap the forward of every module of a LABELLED type in a profiler range "module:<type>"."""
    from torch.profiler import record_function

    for module in model.modules():
        if type(module).__name__ in LABELLED:
            ranges: list = []
            module.register_forward_pre_hook(lambda m, i, r=ranges: r.append(record_function(
                f"module:{type(m).__name__}").__enter__()))
            module.register_forward_hook(lambda m, i, o, r=ranges: r.pop().__exit__(None, None, None))


def profile_steps(config: ModelConfig, batch_size: int) -> tuple[dict[str, tuple[float, float, float]],
                                                                 dict[str, dict[str, float]]]:
    """One training step (the preset's dropout) per precision, after two warm-up steps: (step seconds, self time
    of the matrix products (mm, addmm, bmm), self time of everything else), and everything else by kind (OP_KINDS)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    model = GPT(config).train()
    label_modules(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = (torch.randint(0, config.vocab_size, (batch_size, config.block_size)) for _ in range(2))

    def step(precision: str) -> None:
        with autocast(torch.device("cpu"), precision):
            _, loss = model(x, y)
        loss.backward()
        with record_function("optimizer"):
            optimizer.step()
        with record_function("zero_grad"):
            optimizer.zero_grad(set_to_none=True)

    out, rest = {}, {}
    for precision in ("fp32", "bf16"):
        step(precision)
        step(precision)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            step(precision)
            seconds = time.perf_counter() - start
        kinds: dict[str, float] = {}
        for event in prof.events():
            kind = kind_of(event)
            kinds[kind] = kinds.get(kind, 0.0) + event.self_cpu_time_total / 1e6
        products = kinds.pop("products", 0.0)
        out[precision] = (seconds, products, sum(kinds.values()))
        rest[precision] = dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
    return out, rest


def run_matmul(*, preset: str = "char-small", batch_size: int = 16, repeats: int = 10,
               profile: bool = False) -> MatmulResult:
    """`gptlab bench matmul`: one line per Linear shape (GFLOP/s of the forward, input-gradient and
    weight-gradient products, fp32 | bf16), the machine's load, the totals and bf16's ratio; with profile, one
    profiled training step per precision after them. Returns the measurements."""
    if batch_size < 1 or repeats < 1:
        raise ValueError(f"batch_size and repeats must be at least 1, not {batch_size} and {repeats}")
    set_threads()
    reuse_freed_memory()  # as training does
    watch = LoadWatch()
    config = model_config(preset)
    result = MatmulResult(rows=batch_size * config.block_size)
    time_products(result, linear_shapes(config), repeats)
    if profile:
        result.steps, result.rest = profile_steps(config, batch_size)
    print(f"{preset}: {result.rows:,} rows (batch {batch_size} x context {config.block_size}); best of {repeats}")
    for (k, n), per in result.gflops.items():
        print(f"{k:>5} -> {n:<5} GFLOP/s ({', '.join(PRODUCTS)}): "
              + " | ".join(f"{p} " + " ".join(f"{v:.0f}" for v in values) for p, values in per.items()))
    print(watch.stop().report())
    print(f"all products, one of each: fp32 {result.total_s['fp32'] * 1e3:.1f} ms, bf16 "
          f"{result.total_s['bf16'] * 1e3:.1f} ms; bf16 {result.ratio:.2f}x fp32")
    for precision, (seconds, products, rest) in result.steps.items():
        print(f"{precision} step {seconds * 1e3:.0f} ms: matrix products {products * 1e3:.0f} ms, the rest "
              f"{rest * 1e3:.0f} ms (profiler self times)")
        print("  the rest: " + ", ".join(f"{kind} {t * 1e3:.1f}" for kind, t in result.rest[precision].items()
                                          if t >= 0.00005) + " ms")
    return result
