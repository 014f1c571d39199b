"""The naive engine beside gptlab's torch model on one batch: the largest absolute and relative difference of the
logits, the loss and every parameter's gradient (what `gptlab reference check` prints)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from gptlab.model import GPT
from gptlab.reference import naive_gpt as rm

PRECISIONS = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True)
class Difference:
    """One tensor compared: max |a - b| and max |a - b| / max |b| (a the engine's, b torch's)."""

    tensor: str
    max_abs: float
    max_rel: float


def difference(name: str, a: torch.Tensor, b: torch.Tensor) -> Difference:
    gap = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    return Difference(name, gap, gap / scale if scale > 0 else (0.0 if gap == 0 else float("inf")))


def compare_engines(model: GPT, x: torch.Tensor, y: torch.Tensor, precision: str = "fp32") -> list[Difference]:
    """The engine and the torch model (a copy of `model` in `precision`, no dropout) on the batch (x, y): the
    logits, the loss, then every parameter's gradient, in the model's parameter order (frozen ones too: a LoRA
    run's merged model keeps its base's weights frozen)."""
    dtype = PRECISIONS[precision]
    torch_model = copy.deepcopy(model).to(dtype).eval().requires_grad_(True)
    torch_model.zero_grad(set_to_none=True)
    logits, loss, grads = rm.step(torch_model, x, y, grads=True)
    expected_logits, expected_loss = torch_model(x, y)
    expected_loss.backward()
    out = [difference("logits", logits, expected_logits.detach()),
           difference("loss", torch.tensor(loss, dtype=torch.float64), expected_loss.detach())]
    out += [difference(f"grad {name}", grads[name], p.grad) for name, p in torch_model.named_parameters()]
    return out
