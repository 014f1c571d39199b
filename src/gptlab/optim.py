"""The optimizers (AdamW; Muon for the blocks' matrices with AdamW for the rest) and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from gptlab.config import TrainConfig
from gptlab.model import is_gpt


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Two AdamW groups of `params` (a model's parameters()): matrices (embeddings and linear weights) decay;
    biases and LayerNorm gains do not."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """cfg.optimizer: AdamW with decoupled weight decay on matrices only (the fused kernel where the device has
    one), or Muon for the transformer blocks' matrices with AdamW for the rest."""
    if cfg.optimizer == "muon":
        return muon_optimizer(model, cfg)
    device = next(model.parameters()).device
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(param_groups(model.parameters(), cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=fused)


def zeropower(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """An approximate orthogonalisation of the matrix g (U V^T of its SVD, singular values pushed towards 1) by a
    quintic Newton-Schulz iteration, in fp32; Muon's coefficients, tuned for speed over exactness."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    x = x / (x.norm() + 1e-7)
    wide = x.size(0) > x.size(1)
    if wide:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if wide else x


class Muon(torch.optim.Optimizer):
    """Muon for groups marked `muon` (2-D weights: momentum with Nesterov, orthogonalised by zeropower, scaled by
    sqrt(max(1, rows / cols)), decoupled weight decay) and AdamW for the other groups, in one optimizer so that
    checkpoints, resumes and the schedule treat it like AdamW. Each group's lr is its own (see lr_scale)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], momentum: float = 0.95,
                 eps: float = 1e-8):
        super().__init__(groups, dict(lr=lr, betas=betas, momentum=momentum, eps=eps, weight_decay=0.0, muon=False,
                                      lr_scale=1.0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon if group["muon"] else self._adamw)(p, group)

    def _muon(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(p.grad)
        update = zeropower(p.grad.add(buf, alpha=group["momentum"]))  # Nesterov
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-group["lr"] * max(1.0, p.size(0) / p.size(1)) ** 0.5)

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = state["step"].item()
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        denom = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** t))


def muon_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> Muon:
    """Muon for the transformer blocks' matrices (attention and MLP weights), at cfg.muon_lr; AdamW at cfg.lr for
    the embeddings (and the LM head tied to them), LayerNorm gains and biases, as modded-nanogpt and nanochat do."""
    blocks = model.transformer.h if is_gpt(model) else None
    matrices = [p for p in blocks.parameters() if p.requires_grad and p.dim() == 2] if blocks is not None else []
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups = [{"params": matrices, "muon": True, "lr_scale": cfg.muon_lr / cfg.lr, "weight_decay": cfg.weight_decay},
              *param_groups(rest, cfg.weight_decay)]
    return Muon([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


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
