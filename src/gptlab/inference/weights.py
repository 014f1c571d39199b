"""Inference weights: how a prepared model's weights are laid out in memory.

Two policies, each measured by a bench (docs/benchmarks.md): every nn.Linear pre-packed in oneDNN's blocked layout
(`InferenceLinear`, for prompts, window rebuilds and torch-op decode steps), and every parameter moved into one
mapping of 2 MB pages (`move_to_huge_pages`, for the fused decode step, which streams all the weights each token).
"""

from __future__ import annotations

import mmap

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab.runtime import bf16_supported


class InferenceLinear(nn.Module):
    """y = x W^T + b, like the nn.Linear it replaces, with W pre-packed in oneDNN's blocked layout for this CPU.

    Used for prompts and window rebuilds, and for decoding where the fused step (gptlab.inference.fused) is not
    available: decoding reads every weight once per token, so these reads are its time. On a 2-core AMD EPYC
    (`gptlab bench generate`, docs/benchmarks.md) packed products of one row take less time than F.linear
    in fp32 and in bf16, and several rows (batches, prompts) gain more. W is packed for MIN_ROWS rows, the layout
    that suits batches; a single row is padded to MIN_ROWS, which measured faster than giving that layout one row.
    `widen`: a bf16 Linear on a CPU without native bf16 products is packed as its fp32 widening (the same values,
    exactly) and computes in fp32, its input widened and its output rounded back to the Linear's dtype: torch's
    bf16 products are emulated there, several times slower than fp32 ones (`gptlab bench serve --scenario
    shared-prefix`, docs/benchmarks.md). Inference only: the packed weight is not a parameter."""

    MIN_ROWS = 4

    def __init__(self, linear: nn.Linear, widen: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.out_dtype = weight.dtype  # what the model around it computes in
        self.dtype = torch.float32 if widen else weight.dtype  # what the products compute in
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.dtype), self.MIN_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach().to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        x = x.to(self.dtype)
        if rows >= self.MIN_ROWS:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            padded = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, self.MIN_ROWS - rows))  # (MIN_ROWS, in)
            y = torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")
            y = y[:rows].view(*x.shape[:-1], self.out_features)
        return y.to(self.out_dtype)

    def extra_repr(self) -> str:
        widened = f", computes_in={self.dtype}" if self.dtype != self.out_dtype else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}" \
            + widened


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can run packed Linears of `dtype` on `device` (a CPU with torch's oneDNN build)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):  # oneDNN's packed Linear, as torch.compile uses it
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_supported(device))


def widens(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a Linear of `dtype` on `device` is packed as its fp32 widening (`InferenceLinear`'s `widen`): bf16
    where oneDNN cannot run bf16 products natively but runs fp32 ones."""
    return dtype == torch.bfloat16 and not can_pack(device, dtype) and can_pack(device, torch.float32)


def pack_linears(model: nn.Module) -> None:
    """Replace, in place, each nn.Dropout of `model` by nn.Identity and, where oneDNN can run them (`can_pack`),
    each nn.Linear by an InferenceLinear (the tied LM head gets its own packed copy): for inference only. A bf16
    model on a CPU without native bf16 products gets fp32 packed copies (`InferenceLinear`'s `widen`): its prompts
    then multiply at fp32's speed, for twice the bytes of bf16 copies."""
    weight = next(model.parameters())
    widen = widens(weight.device, weight.dtype)
    pack = widen or can_pack(weight.device, weight.dtype)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Dropout):
                setattr(module, name, nn.Identity())  # a no-op in eval mode, but a call per use all the same
            elif pack and isinstance(child, nn.Linear):
                setattr(module, name, InferenceLinear(child, widen))


def move_to_huge_pages(model: torch.nn.Module) -> bool:
    """Move every parameter of `model` (CPU, inference only) into one anonymous mapping backed by 2 MB pages
    (Linux transparent huge pages, madvise mode): a decode step streams all the weights, and with 4 KB pages
    the reads cross a page, a TLB entry and a hardware-prefetch boundary every 4 KB (a small gain, measured by
    `gptlab bench decode --pages both`, docs/benchmarks.md). Returns whether it did; memory stays
    one copy (the old storage is released), tied parameters stay tied."""
    params = list(model.parameters())  # unique: a tied weight appears once
    if not params or any(p.device.type != "cpu" for p in params) or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // 64) * 64  # 64-byte aligned, a cache line each
    try:
        arena = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return False
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # keeps the mapping alive as long as a view of it lives
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            nbytes = p.numel() * p.element_size()
            home = raw[offset:offset + nbytes].view(p.dtype).view(p.shape)
            home.copy_(p.detach())
            p.data = home
    return True
