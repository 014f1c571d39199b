"""How close one fused decode step comes to the memory-bandwidth floor, with the floor measured beside each step.

    python scripts/decode_floor.py [--rounds 60] [--pages 2M|4K]

A shared machine's read bandwidth drifts by tens of percent within seconds (docs/benchmarks.md), so this
alternates, `rounds` times: a read of a 512 MB buffer (its rate is the floor of the moment), then one batch-1
decode step of a GPT-2-124M-shaped model (random weights, 144 positions in the cache); and likewise batch-8
steps. It prints, per precision, the median and range of (floor time / step time) and the batch-8 step's
aggregate tokens/s over batch 1's, from medians. `gptlab bench generate` measures the same share through the
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--pages", choices=["2M", "4K"], default="2M",
                        help="weights in transparent huge pages (what the engine does) or in ordinary 4 KB pages")
    args = parser.parse_args()
    set_threads()
    torch.manual_seed(0)
    base = GPT(build(ModelConfig, GEN_MODELS["gpt2-124M"], {})).eval()
    buffer = torch.ones(512 * (1 << 20) // 4)
    for precision in ("fp32", "bf16"):
        model = prepare_for_inference(copy.deepcopy(base), precision, huge_pages=args.pages == "2M")
        if model.fused_decoder is None:
            print(f"{precision}: no fused decode step on this machine")
            continue
        weights = weight_bytes_per_token(base, precision)
        shares, steps = [], {1: [], 8: []}
        for rows in (1, 8):
            cache = model.new_kv_cache(rows, dtype=cache_dtype(model), max_len=160)
            cache.pos.fill_(144)
            ids = torch.randint(0, base.config.vocab_size, (rows,))
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                buffer.sum()
                t1 = time.perf_counter()
                model.fused_decoder.step(ids, cache)
                t2 = time.perf_counter()
                cache.pos -= 1
                steps[rows].append(t2 - t1)
                if rows == 1:
                    shares.append(weights / (buffer.numel() * 4 / (t1 - t0)) / (t2 - t1))
        print(f"{precision} batch 1: {median(shares):.0%} of the floor (median of {args.rounds}; "
              f"{min(shares):.0%}-{max(shares):.0%}), step {median(steps[1]) * 1e3:.2f} ms; batch 8: step "
              f"{median(steps[8]) * 1e3:.2f} ms, {8 * median(steps[1]) / median(steps[8]):.2f}x batch 1's tokens/s")


if __name__ == "__main__":
    main()
