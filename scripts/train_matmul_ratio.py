"""The ceiling on bf16's training speed-up for char-small: how much faster its own matrix products run in bf16.

    python scripts/train_matmul_ratio.py

Every nn.Linear of char-small (6 x 384, batch 16 x context 256 = 4,096 rows) does three products per training
step: the forward x W^T, the input gradient g W and the weight gradient g^T x. This times each, fp32 and bf16
(best of 10, torch's threads), and prints the GFLOP/s and the ratio of the totals: if everything else in a step
cost nothing, bf16 could not train faster than that ratio.
"""

from __future__ import annotations

import time

import torch

from gptlab.runtime import set_threads

ROWS = 16 * 256
SHAPES = ((384, 1152), (384, 384), (384, 1536), (1536, 384), (384, 65))  # (in, out): QKV, W_O, fc, proj, head


def best(fn, repeats: int = 10) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    set_threads()
    totals = {"fp32": 0.0, "bf16": 0.0}
    for k, n in SHAPES:
        parts = []
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            x, w, g = (torch.randn(*shape, dtype=dtype) for shape in ((ROWS, k), (n, k), (ROWS, n)))
            times = [best(lambda: x @ w.t()), best(lambda: g @ w), best(lambda: g.t() @ x)]
            totals[name] += sum(times)
            flops = 2 * ROWS * k * n
            parts.append(f"{name} " + " ".join(f"{flops / t / 1e9:.0f}" for t in times))
        print(f"{k:>5} -> {n:<5} GFLOP/s (forward, input grad, weight grad): " + " | ".join(parts))
    print(f"all products, one of each: fp32 {totals['fp32'] * 1e3:.1f} ms, bf16 {totals['bf16'] * 1e3:.1f} ms; "
          f"bf16 {totals['fp32'] / totals['bf16']:.2f}x fp32")


if __name__ == "__main__":
    main()
