"""The ceiling on bf16's training speed-up for char-small: how much faster its own matrix products run in bf16.

    python scripts/train_matmul_ratio.py [--profile]

Every nn.Linear of char-small (6 x 384, batch 16 x context 256 = 4,096 rows) does three products per training
step: the forward x W^T, the input gradient g W and the weight gradient g^T x. This times each, fp32 and bf16
(best of 10, torch's threads), and prints the GFLOP/s and the ratio of the totals: if everything else in a step
cost nothing, bf16 could not train faster than that ratio. With --profile it also profiles one whole training
step of char-small in each precision (torch.profiler) and prints the time in matrix products and in the rest.
"""

from __future__ import annotations

import argparse
import time

import torch

from gptlab.config import ModelConfig, build, get_preset
from gptlab.model import GPT
from gptlab.runtime import autocast, set_threads

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


def profile_steps() -> None:
    """One char-small training step (batch 16 x 256, dropout 0.2) per precision, after two warm-up steps: the
    self time of the matrix products (mm, addmm, bmm) and of everything else."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = GPT(build(ModelConfig, {**get_preset("char-small").model, "vocab_size": 65}, {})).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = torch.randint(0, 65, (16, 256)), torch.randint(0, 65, (16, 256))

    def step(precision: str) -> None:
        with autocast(torch.device("cpu"), precision):
            _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for precision in ("fp32", "bf16"):
        step(precision)
        step(precision)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            step(precision)
            seconds = time.perf_counter() - start
        events = prof.key_averages()
        products = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
        total = sum(e.self_cpu_time_total for e in events)
        print(f"{precision} step {seconds * 1e3:.0f} ms: matrix products {products / 1e3:.0f} ms, the rest "
              f"{(total - products) / 1e3:.0f} ms (profiler self times)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="store_true", help="also profile one training step per precision")
    args = parser.parse_args()
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
    if args.profile:
        profile_steps()


if __name__ == "__main__":
    main()
