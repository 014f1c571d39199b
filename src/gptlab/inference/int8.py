"""Weight-only int8: every matrix stored as int8 with one fp32 scale per output channel (row), activations fp32.

A decode step reads every weight once per token, so its time is the weights' bytes over the memory bandwidth:
int8 reads a quarter of fp32's bytes and half of bf16's. Quantization is symmetric and per row: scale = max|w_row|
/ 127, q = round(w / scale) in [-127, 127], so w ~ q * scale with an error of at most scale / 2 per weight.

`Int8Linear` is the torch path, the reference the native kernel is held to (tests/test_int8.py) and the fallback
where it cannot run: it widens q to fp32, multiplies in fp32 and scales each output's sum, on any device. Prompts (many rows at once)
take a faster product where the CPU computes bf16 natively: q is exact in bf16 (|q| <= 127 needs 7 of its 8
significant bits), so only x and the product's result are rounded to bf16, as under autocast, and the scales are
applied after, in fp32 (`bf16_rows`). `quantize_model` turns a model's nn.Linears into Int8Linears, the LM head
included (the largest matrix of GPT-2: 50257 x 768); the token embedding it is tied to then holds the dequantized
values, so embedding and head stay the same weights (and the head's torch products read them rather than
dequantize the largest matrix at every call).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab.model import is_gpt

QMAX = 127  # symmetric: -128 is never used, so -q is always representable
BF16_ROWS = 16  # from this many rows on (a prompt, not a decode step) the bf16 product pays for its conversion


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (q (N, K) int8, scale (N,) fp32) with w ~ q * scale[:, None]; scale = max|w_row| / 127,
    so each row's largest weight maps to +-127 and every weight is off by at most scale / 2. A row of zeros gets
    scale 0 (and q 0): it dequantizes to zeros exactly."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / QMAX  # (N,)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # a zero row: 0 / 1 = 0, not NaN
    q = torch.round(w / divisor[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q (N, K) int8 and scale (N,) -> the fp32 weights q * scale[:, None] (N, K)."""
    return q.float() * scale[:, None]


class Int8Linear(nn.Module):
    """y = x (q * scale)^T + b: an nn.Linear with its weight quantized per output row (`quantize_rows`), the bias
    kept in fp32. `q`, `scale` and `sums` (each row's sum of q, int32: the native VNNI product needs it) are
    frozen parameters, not buffers, so that `move_to_huge_pages` moves them with the rest. Inference only."""

    def __init__(self, linear: nn.Linear, bf16_rows: int | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.q = nn.Parameter(q, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.sums = nn.Parameter(q.sum(dim=1, dtype=torch.int32), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.dense: nn.Parameter | None = None  # the dequantized weight where it is kept anyway (a tied embedding)
        self.bf16_rows = bf16_rows  # inputs of this many rows or more multiply in bf16 (None: never)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight (out, in) this layer multiplies by."""
        return dequantize_rows(self.q, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_rows is not None and self.dense is None and x.numel() >= self.bf16_rows * self.in_features:
            return self.forward_bf16(x)
        if self.dense is not None:  # the tied head: its dequantized weights are kept anyway
            return F.linear(x.float(), self.dense, self.bias)
        # q widened to fp32 (exact), one fp32 product, then the scales, as the native kernel sums: the reference it
        # is held to. Scaling the (rows, N) sums rather than the (N, K) weights spares a pass over the weights per
        # call, most of a prompt chunk's extra time over fp32's on CPUs without native bf16 (docs/benchmarks.md)
        y = F.linear(x.float(), self.q.float()) * self.scale
        return y if self.bias is None else y + self.bias

    def forward_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """x (q^T) in bf16 with fp32 accumulation, its result rounded to bf16, then the scales and the bias in
        fp32: the reference's result up to two roundings to bf16, of x and of the sum x q^T, each off by at most
        2^-8 of itself (q is exact in bf16: the weights themselves are never rounded). Faster than the reference
        on prompts where the CPU computes bf16 natively. q is converted to bf16 at every call (half the bytes of
        the reference's fp32 copy); none is kept, so that int8 weights stay int8 in memory."""
        y = F.linear(x.to(torch.bfloat16), self.q.to(torch.bfloat16)).float() * self.scale
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_model(model: nn.Module, bf16_rows: int | None = None) -> None:
    """Replace, in place, every nn.Linear of `model` (fp32) by an Int8Linear, multiplying inputs of `bf16_rows`
    rows or more in bf16 (None: always fp32). A token embedding tied to the LM head (GPT's wte) is set to the
    head's dequantized weights, untied: the embedding and the head keep meaning the same matrix, and a decoder
    reading either one sees the same numbers."""
    wte = model.transformer.wte if is_gpt(model) else None
    tied = wte is not None and isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is wte.weight
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child, bf16_rows))
    if tied:
        wte.weight = nn.Parameter(model.lm_head.dequantized(), requires_grad=False)
        model.lm_head.dense = wte.weight  # the head's products read it: no 50257 x 768 dequantization per prompt
