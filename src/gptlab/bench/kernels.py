"""The products and the attention of one decode step alone, for `gptlab bench generate`: what is behind the
engine's choices of weight layout (oneDNN-packed, one row padded to a few) and of its KV cache's precision."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from gptlab.bench.timing import time_it
from gptlab.inference.loading import FLOAT_DTYPES
from gptlab.inference.weights import InferenceLinear, widens


def linear_kernel_times(model: torch.nn.Module, precision: str, device: torch.device) -> dict[str, float]:
    """Seconds to pass one row through every Linear of `model` (the matrices a batch-1 decode step reads): with
    F.linear, with oneDNN-packed weights, and packed with the row padded to 4 rows (what the engine does)."""
    dtype = FLOAT_DTYPES[precision]
    linears = [copy.deepcopy(m).to(dtype) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [InferenceLinear(m, widen=widens(device, dtype)) for m in linears]  # as pack_linears packs
    xs = [torch.randn(1, m.in_features, dtype=dtype, device=device) for m in linears]

    def plain() -> None:
        for x, m in zip(xs, linears):
            F.linear(x, m.weight, m.bias)

    computed = [x.to(m.dtype) for x, m in zip(xs, packed)]  # the dtype it multiplies in: fp32 where widened

    def one_row() -> None:
        for x, m in zip(computed, packed):
            torch.ops.mkldnn._linear_pointwise(x, m.packed, m.bias, "none", [], "")

    def padded() -> None:
        for x, m in zip(xs, packed):
            m(x)

    with torch.inference_mode():
        return {name: time_it(fn, device, min_seconds=0.5) for name, fn in
                (("F.linear", plain), ("oneDNN-packed", one_row), ("packed, padded to 4 rows", padded))}


def attention_times(device: torch.device, rows: int = 8, keys: int = 272, n_head: int = 12,
                    head_dim: int = 64) -> dict[str, float]:
    """Seconds for one decode step's attention of one layer (one query per row over `keys` cached positions) in
    fp32 and in bf16."""
    out = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        q = torch.randn(rows, n_head, 1, head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(rows, n_head, keys, head_dim, dtype=dtype, device=device) for _ in range(2))
        with torch.inference_mode():
            out[precision] = time_it(lambda: F.scaled_dot_product_attention(q, k, v), device, min_seconds=0.3)
    return out


def print_kernel_lines(model: torch.nn.Module, precisions: list[str], device: torch.device) -> None:
    """The measurements behind the engine's choices of weight layout and attention precision."""
    for p in precisions:
        times = linear_kernel_times(model, p, device)
        print(f"{p} matrices of one batch-1 decode step: " + ", ".join(f"{name} {t * 1e3:.1f} ms"
                                                                        for name, t in times.items()))
    if "bf16" in precisions:
        att = attention_times(device)
        print(f"attention of one layer, 8 rows, 1 query over 272 keys: fp32 {att['fp32'] * 1e3:.2f} ms, bf16 "
              f"{att['bf16'] * 1e3:.2f} ms")
