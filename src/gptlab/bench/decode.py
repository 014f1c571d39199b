"""`gptlab bench decode`: how close one fused decode step comes to the memory-bandwidth floor, with the floor
measured beside each step, fp32, bf16 and int8 weights (int8's floor: its own bytes, gptlab.bench.engines).

A shared machine's read bandwidth drifts from moment to moment, so this alternates, `rounds` times: a
read of a 512 MB buffer (its rate is the floor of the moment), then one batch-1 decode step of a
GPT-2-124M-shaped model (random weights, 144 positions in the cache); and likewise batch-8 steps. It prints, per
precision, the median and range of (floor time / step time), the batch-8 step's aggregate tokens/s over batch
1's, from medians, and a batch-8 step at 1 cached position (attention's share is the difference). `gptlab bench
generate` measures the same share through the whole engine (sampling and Python included), token by token.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from gptlab.bench.engines import GEN_MODELS, weight_bytes_per_token
from gptlab.bench.timing import LoadWatch, median, read_then
from gptlab.config import ModelConfig, build
from gptlab.inference.loading import prepare_for_inference
from gptlab.inference.native import describe, load_library
from gptlab.model import GPT
from gptlab.runtime import set_threads

PAGES = ("2M", "4K", "both")


@dataclass
class DecodeRow:
    """One precision and page layout: the batch-1 step's share of the floor and the three step times."""

    precision: str
    pages: str
    shares: list[float]  # floor time / step time, batch 1, one per round
    batch1_s: float  # median step, 1 row at `positions` cached positions
    batch8_s: float  # median step, 8 rows at `positions`
    bare8_s: float  # median step, 8 rows at 1 position: the products without attention over a long cache

    @property
    def batch8_gain(self) -> float:
        """Batch 8's aggregate tokens/s over batch 1's."""
        return 8 * self.batch1_s / self.batch8_s


def measure_precision(base: torch.nn.Module, precision: str, layouts: list[str], rounds: int, positions: int,
                      buffer: torch.Tensor) -> list[DecodeRow] | None:
    """The rows of one precision, layouts alternating round by round (the same moments of the machine); None
    where this machine has no fused decode step."""
    models = {pages: prepare_for_inference(copy.deepcopy(base), precision, huge_pages=pages == "2M")
              for pages in layouts}
    if not all(m.fused for m in models.values()):
        return None
    weights = weight_bytes_per_token(base, precision)
    shares: dict[str, list[float]] = {pages: [] for pages in layouts}
    cases = ((1, positions), (8, positions), (8, 1))  # (rows, cached positions): the last shows attention's share
    steps: dict[tuple[str, tuple[int, int]], list[float]] = {(p, case): [] for p in layouts for case in cases}
    for rows, at in cases:
        ids = torch.randint(0, base.config.vocab_size, (rows,))
        caches = {}
        for pages, model in models.items():
            caches[pages] = model.new_kv_cache(rows, max_len=positions + 16)
            caches[pages].pos.fill_(at)
        for _ in range(rounds):
            for pages, model in models.items():
                bandwidth, seconds, _ = read_then(buffer, lambda: model.decoder.step(ids, caches[pages]))
                caches[pages].pos -= 1  # every round decodes at the same position
                steps[pages, (rows, at)].append(seconds)
                if rows == 1:
                    shares[pages].append(weights / bandwidth / seconds)
    return [DecodeRow(precision, pages, shares[pages], *(median(steps[pages, case]) for case in cases))
            for pages in layouts]


def run_decode(*, rounds: int = 60, pages: str = "2M", config: ModelConfig | None = None, positions: int = 144,
               buffer_mb: int = 512) -> list[DecodeRow]:
    """`gptlab bench decode`: prints one line per precision (and page layout) and the machine's load; returns
    the rows. pages: weights in transparent huge pages ("2M", what the engine does), in ordinary 4 KB pages
    ("4K"), or both, round by round. config (default: GPT-2-124M's shape), positions and buffer_mb exist for
    tests. Raises ValueError for an unknown `pages` or fewer than 1 round."""
    if pages not in PAGES or rounds < 1:
        raise ValueError(f"pages must be one of {PAGES} and rounds at least 1, not {pages!r} and {rounds}")
    set_threads()
    watch = LoadWatch()
    lib = load_library()
    print(f"kernel build: {describe(lib)}" if lib is not None else "kernel build: none (no g++)")
    torch.manual_seed(0)
    base = GPT(config or build(ModelConfig, GEN_MODELS["gpt2-124M"], {})).eval()
    buffer = torch.ones(buffer_mb * (1 << 20) // 4)
    layouts = ["2M", "4K"] if pages == "both" else [pages]
    rows, lines = [], []
    for precision in ("fp32", "bf16", "int8"):
        measured = measure_precision(base, precision, layouts, rounds, positions, buffer)
        if measured is None:
            lines.append(f"{precision}: no fused decode step on this machine")
            continue
        rows += measured
        for r in measured:
            label = precision + (f" {r.pages} pages" if len(layouts) > 1 else "")
            lines.append(f"{label} batch 1: {median(r.shares):.0%} of the floor (median of {rounds}; "
                         f"{min(r.shares):.0%}-{max(r.shares):.0%}), step {r.batch1_s * 1e3:.2f} ms; batch 8: step "
                         f"{r.batch8_s * 1e3:.2f} ms, {r.batch8_gain:.2f}x batch 1's tokens/s "
                         f"({r.bare8_s * 1e3:.2f} ms at 1 position)")
    print(watch.stop().report())
    print("\n".join(lines))
    return rows
