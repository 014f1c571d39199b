"""The naive engine's optimizer step: global-norm clipping and AdamW, computed by reference.cpp.

`NaiveAdamW` is a torch Optimizer (so the schedule sets each group's lr, and checkpoints hold its state as they
hold torch's AdamW: `step`, `exp_avg` and `exp_avg_sq` per tensor) whose update is the C++ `adamw`; its groups are
the torch path's (optim.param_groups: the matrices decay, biases and LayerNorm gains do not).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import torch

from gptlab.reference import library
from gptlab.reference.naive_gpt import DTYPES


def _suffix(t: torch.Tensor) -> str:
    if t.dtype not in DTYPES or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("the reference engine takes contiguous fp32 or fp64 tensors on the CPU")
    return DTYPES[t.dtype]


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The global norm of the parameters' gradients (each tensor once), computed by the engine, which scales them
    all by max_norm / (norm + 1e-6) when that is below 1 (max_norm 0: no clipping; inf: a factor of inf, none). Returns the norm
    before clipping, as a 0-dim tensor of the gradients' dtype."""
    grads = [p.grad for p in dict.fromkeys(params) if p.grad is not None]
    if not grads:
        return torch.zeros(())
    suffix = _suffix(grads[0])
    if any(_suffix(g) != suffix for g in grads):
        raise ValueError("the reference engine clips gradients of one dtype")
    pointers = (ctypes.c_void_p * len(grads))(*[g.data_ptr() for g in grads])
    sizes = torch.tensor([g.numel() for g in grads], dtype=torch.int64)
    fn = getattr(lib or library.load_library(), f"gptlab_clip_grad_norm_{suffix}")
    return torch.tensor(fn(pointers, sizes.data_ptr(), len(grads), float(max_norm)), dtype=grads[0].dtype)


class NaiveAdamW(torch.optim.Optimizer):
    """AdamW whose update is the engine's (decoupled weight decay per group, bias correction), on fp32 or fp64
    CPU tensors; `library`: the engine that computes it (the naive one unless given: a fast rung's, fp32)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float = 1e-8,
                 library: ctypes.CDLL | None = None):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.library = library

    @torch.no_grad()
    def step(self, closure=None):
        lib = self.library or library.load_library()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                grad = p.grad.contiguous()
                fn = getattr(lib, f"gptlab_adamw_{_suffix(p)}")
                fn(p.data_ptr(), grad.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
                   p.numel(), group["lr"], beta1, beta2, group["eps"], group["weight_decay"], int(state["step"]))
