"""Two operations the model is built from, each torch's own math made cheaper where it counts: `Dropout`, whose
CPU mask takes one random 16-bit draw per element, and `chunked_loss`, the LM head's mean cross-entropy without all
its logits at once. Torch alone, like the model that imports it (tests/test_layers.py)."""

from __future__ import annotations

import torch
import torch.nn as nn


class Dropout(nn.Dropout):
    """nn.Dropout with a cheaper mask on CPUs. There torch draws one random number per element, serially, which
    took a large share of a bf16 training step of char-small (docs/benchmarks.md); here each 64-bit random word masks
    four elements, 16 bits each (p rounded to a multiple of 1/65536). The same generator (torch.manual_seed
    governs it), the same scaling by 1 / (1 - p); evaluation and GPUs keep torch's own dropout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p in (0.0, 1.0) or x.device.type != "cpu":
            return super().forward(x)
        words = torch.randint(-2**63, 2**63 - 1, ((x.numel() + 3) // 4,), dtype=torch.int64)
        keep = words.view(torch.int16)[:x.numel()].view(x.shape) >= round(self.p * 65536) - 32768
        # bool -> uint8 (the same bytes, 0 / 1) -> x.dtype: torch's CPU conversion to bf16 is faster from uint8
        return x * keep.view(torch.uint8).to(x.dtype).mul_(1.0 / (1.0 - self.p))


class _ChunkedLoss(torch.autograd.Function):
    """The mean cross-entropy of logits = x @ weight^T against targets (-1 ignored) over chunks of `chunk` rows:
    backward recomputes each chunk's logits instead of keeping all (N, V) of them. Products run in `dtype`, the
    softmax in `exact` (at least fp32), every cast explicit as the plain path's autocast makes them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, dtype: torch.dtype,
                exact: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, weight, targets)
        ctx.chunk, ctx.dtype, ctx.exact = chunk, dtype, exact
        w, total = weight.to(dtype), x.new_zeros((), dtype=exact)
        for s in range(0, x.size(0), chunk):
            logits, t = (x[s:s + chunk].to(dtype) @ w.t()).to(exact), targets[s:s + chunk]
            picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((torch.logsumexp(logits, dim=1) - picked) * (t != -1)).sum()
        return total / (targets != -1).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x, weight, targets), chunk, dtype = ctx.saved_tensors, ctx.chunk, ctx.dtype
        need_x, need_w = ctx.needs_input_grad[:2]
        w, scale = weight.to(dtype), grad / (targets != -1).sum()
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=ctx.exact, device=weight.device) if need_w else None
        for s in range(0, x.size(0), chunk):
            xs, t = x[s:s + chunk].to(dtype), targets[s:s + chunk]
            d = torch.softmax((xs @ w.t()).to(ctx.exact), dim=1)  # d loss / d logits = softmax - one-hot
            d.scatter_add_(1, t.clamp(min=0).unsqueeze(1), d.new_full((t.size(0), 1), -1.0))
            d = (d * ((t != -1).unsqueeze(1) * scale)).to(dtype)
            if need_x:
                grad_x[s:s + chunk] = d @ w
            if need_w:
                grad_w += (d.t() @ xs).to(grad_w.dtype)
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def chunked_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """The model's loss of the logits x @ weight^T (model._loss) without the (N, V) logits: x (B, T, C), weight
    (V, C), targets (B, T)."""
    device = x.device.type
    autocast = torch.is_autocast_enabled(device) and x.dtype == torch.float32  # as autocast leaves fp64 alone
    dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    exact = torch.float64 if dtype == torch.float64 else torch.float32
    return _ChunkedLoss.apply(x.reshape(-1, x.size(-1)), weight, targets.reshape(-1), chunk, dtype, exact)
