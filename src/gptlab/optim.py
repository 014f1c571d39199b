"""The optimizer and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from gptlab.config import TrainConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (embeddings and linear weights) decay; biases and LayerNorm gains do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only; the fused kernel where the device has one."""
    device = next(model.parameters()).device
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=fused)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate at `step`: linear warm-up to cfg.lr over warmup_steps, then cosine decay to min_lr at
    decay_steps, then min_lr. A pure function of the step, so a resumed run follows the same schedule."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def step_if_finite(optimizer: torch.optim.Optimizer, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """optimizer.step() unless the loss or the gradient norm is inf or NaN, decided on the device so the host
    never waits for it: fused AdamW skips its whole update (weights, moments and step count) when handed a
    non-zero `found_inf`, the flag torch's GradScaler uses. Optimizers without that flag are checked on the
    host. Returns a 0-dim bool tensor: whether the step was applied."""
    finite = torch.isfinite(loss) & torch.isfinite(norm)
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = (~finite).float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif finite:
        optimizer.step()
    return finite
