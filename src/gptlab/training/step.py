"""One optimizer step and one evaluation, the two things the training loop repeats: pure functions of the model,
the data and the settings, used by the loop and by `gptlab bench train`."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gptlab.config import TrainConfig
from gptlab.data.batches import Dataset, batch_generator, get_batch
from gptlab.distributed.distributed import Parallel
from gptlab.optim import lr_at, step_if_finite
from gptlab.runtime import autocast, to_device
from gptlab.training.faults import NonFiniteLoss


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, dataset: Dataset, cfg: TrainConfig, block_size: int,
                  device: torch.device, precision: str, dist: Parallel | None = None) -> dict[str, float]:
    """Mean loss over cfg.eval_batches fixed batches of each split, in eval mode (no dropout); with several
    processes, each scores its rows of every batch."""
    dist = dist or Parallel(device)
    was_training = model.training
    model.eval()
    out = {}
    for split, tokens in (("train", dataset.train), ("val", dataset.val)):
        total = torch.zeros((), device=device)
        for i in range(cfg.eval_batches):
            x, y = dist.local_rows(*get_batch(tokens, cfg.batch_size, block_size, batch_generator(cfg.seed, i, -1)))
            with autocast(device, precision):
                total += dist.mean(model(to_device(x, device), to_device(y, device))[1])
        out[split] = total.item() / cfg.eval_batches
    model.train(was_training)
    return out


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Dataset, cfg: TrainConfig,
               block_size: int, step: int, device: torch.device, precision: str,
               dist: Parallel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over cfg.grad_accum micro-batches (each process taking its rows of each); returns
    (mean loss over all processes, gradient norm before clipping) as tensors. A step whose loss or norm is not
    finite is never applied (decided on the device, see step_if_finite); where the host would wait for the
    device to learn it (CUDA, see defers_finite_check) the loop reads it back later, elsewhere this raises
    NonFiniteLoss at once."""
    dist = dist or Parallel(device)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)  # Muon's matrices: their own peak
    loss_sum = torch.zeros((), device=device)
    for micro in range(cfg.grad_accum):
        x, y = get_batch(dataset.train, cfg.batch_size, block_size, batch_generator(cfg.seed, step, micro))
        x, y = dist.local_rows(x, y)
        with dist.no_sync(last=micro == cfg.grad_accum - 1):
            with autocast(device, precision):
                _, loss = model(to_device(x, device), to_device(y, device))
            (loss / cfg.grad_accum).backward()
        loss_sum += loss.detach()
    norm = dist.clip_grad_norm(model, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    loss = dist.mean(loss_sum / cfg.grad_accum)
    applied = step_if_finite(optimizer, loss, norm)
    optimizer.zero_grad(set_to_none=True)
    if not defers_finite_check(device) and not applied:
        raise NonFiniteLoss(f"step {step + 1}: the loss ({loss.item()}) or gradient norm ({norm.item()}) is not "
                            "finite, so the step was not applied")
    return loss, norm


def defers_finite_check(device: torch.device) -> bool:
    """Whether the host learns of non-finite steps only at log rows and evaluations (on CUDA: asking after
    every step would make the host wait for the GPU every step; elsewhere the answer is free)."""
    return device.type == "cuda"


def warm_up(dataset: Dataset, cfg: TrainConfig, block_size: int, device: torch.device, precision: str,
            dist: Parallel | None = None) -> Callable[[torch.nn.Module], None]:
    """One forward and backward pass on the first batch, to compile the training graph before the clock runs."""
    dist = dist or Parallel(device)

    def run(model: torch.nn.Module) -> None:
        x, y = dist.local_rows(*get_batch(dataset.train, cfg.batch_size, block_size, batch_generator(cfg.seed, 0)))
        with autocast(device, precision):
            _, loss = model(to_device(x, device), to_device(y, device))
        loss.backward()
    return run
