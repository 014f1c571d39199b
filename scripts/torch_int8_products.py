"""torch's int8 products against gptlab's torch int8 path, for the decode fallback without a compiler: one row of x
against a (2304, 768) weight (GPT-2's c_attn), weight-only int8 with per-row scales. Prints the median time of each
over `--calls` calls in one process, and the largest error of each against the fp32 product of the dequantized
weights (the int8 reference).

    .venv/bin/python scripts/torch_int8_products.py [--calls 200]
"""

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F


def median_ms(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    calls = parser.parse_args().calls
    torch.manual_seed(0)
    n, k = 2304, 768
    weight = torch.randn(n, k)
    scale = weight.abs().amax(1) / 127
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    x = torch.randn(1, k)
    reference = F.linear(x, q.float() * scale[:, None])
    linear = torch.nn.Linear(k, n, bias=False)
    linear.weight.data = q.float() * scale[:, None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
        dynamic = quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear: per_channel_dynamic_qconfig},
                                   dtype=torch.qint8)
    rows = {
        "dequantize, then F.linear (gptlab's torch int8 path)": lambda: F.linear(x, q.float() * scale[:, None]),
        "torch._weight_int8pack_mm (weight-only, fp32 x)": lambda: torch._weight_int8pack_mm(x, q, scale),
        "fbgemm dynamic int8 Linear (x rounded to 8 bits)": lambda: dynamic(x),
        "fp32 F.linear (the bytes of fp32 weights)": lambda: F.linear(x, weight),
    }
    print(f"one row x ({n}, {k}), median of {calls} calls, {torch.get_num_threads()} threads; largest |y| "
          f"{reference.abs().max().item():.2f}")
    for name, fn in rows.items():
        error = (fn() - reference).abs().max().item() if "fp32 F.linear" not in name else float("nan")
        print(f"{name}: {median_ms(fn, calls):.3f} ms, largest error against the int8 reference {error:.2g}")


if __name__ == "__main__":
    main()
