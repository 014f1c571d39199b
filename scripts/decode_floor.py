"""How close one fused decode step comes to the memory-bandwidth floor, with the floor measured beside each step.

    python scripts/decode_floor.py [--rounds 60] [--pages 2M|4K|both]

A shared machine's read bandwidth drifts by tens of percent within seconds (docs/benchmarks.md), so this
alternates, `rounds` times: a read of a 512 MB buffer (its rate is the floor of the moment), then one batch-1
decode step of a GPT-2-124M-shaped model (random weights, 144 positions in the cache); and likewise batch-8
steps. It prints, per precision, the median and range of (floor time / step time) and the batch-8 step's
aggregate tokens/s over batch 1's, from medians, and a batch-8 step at 1 cached position (attention's share is
the difference). `gptlab bench generate` measures the same share through the
whole engine (sampling and Python included), token by token.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from gptlab.bench import GEN_MODELS, weight_bytes_per_token
from gptlab.config import ModelConfig, build
from gptlab.engine import cache_dtype, prepare_for_inference
from gptlab.model import GPT
from gptlab.runtime import set_threads


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def timed_step(model: torch.nn.Module, cache, ids: torch.Tensor, buffer: torch.Tensor) -> tuple[float, float]:
    """One read of `buffer`, then one fused decode step: (read bytes/s, step seconds)."""
    t0 = time.perf_counter()
    buffer.sum()
    t1 = time.perf_counter()
    model.fused_decoder.step(ids, cache)
    t2 = time.perf_counter()
    cache.pos -= 1
    return buffer.numel() * 4 / (t1 - t0), t2 - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--pages", choices=["2M", "4K", "both"], default="2M",
                        help="weights in transparent huge pages (what the engine does), in ordinary 4 KB pages, "
                             "or both, round by round")
    args = parser.parse_args()
    set_threads()
    torch.manual_seed(0)
    base = GPT(build(ModelConfig, GEN_MODELS["gpt2-124M"], {})).eval()
    buffer = torch.ones(512 * (1 << 20) // 4)
    layouts = ["2M", "4K"] if args.pages == "both" else [args.pages]
    for precision in ("fp32", "bf16"):
        models = {pages: prepare_for_inference(copy.deepcopy(base), precision, huge_pages=pages == "2M")
                  for pages in layouts}
        if any(m.fused_decoder is None for m in models.values()):
            print(f"{precision}: no fused decode step on this machine")
            continue
        weights = weight_bytes_per_token(base, precision)
        shares = {pages: [] for pages in layouts}
        cases = ((1, 144), (8, 144), (8, 1))  # (rows, cached positions): the last shows attention's share
        steps = {(pages, case): [] for pages in layouts for case in cases}
        for rows, positions in cases:
            ids = torch.randint(0, base.config.vocab_size, (rows,))
            caches = {}
            for pages, model in models.items():
                caches[pages] = model.new_kv_cache(rows, dtype=cache_dtype(model), max_len=160)
                caches[pages].pos.fill_(positions)
            for _ in range(args.rounds):
                for pages, model in models.items():  # layouts alternate: the same moments of the machine
                    bandwidth, seconds = timed_step(model, caches[pages], ids, buffer)
                    steps[pages, (rows, positions)].append(seconds)
                    if rows == 1:
                        shares[pages].append(weights / bandwidth / seconds)
        for pages in layouts:
            one, eight, bare = (median(steps[pages, case]) for case in cases)
            label = f"{precision}" + (f" {pages} pages" if len(layouts) > 1 else "")
            print(f"{label} batch 1: {median(shares[pages]):.0%} of the floor (median of {args.rounds}; "
                  f"{min(shares[pages]):.0%}-{max(shares[pages]):.0%}), step {one * 1e3:.2f} ms; batch 8: step "
                  f"{eight * 1e3:.2f} ms, {8 * one / eight:.2f}x batch 1's tokens/s ({bare * 1e3:.2f} ms at 1 "
                  "position)")


if __name__ == "__main__":
    main()
