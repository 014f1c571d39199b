"""One optimizer step and one evaluation, the two things the training loop repeats: pure functions of the model,
the optimizer and one StepContext (what every step shares), used by the loop and by `gptlab bench train`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gptlab.config import TrainConfig
from gptlab.data.batches import Dataset, batch_generator, draw_batch, pass_batches, pass_rows
from gptlab.distributed.processes import Parallel
from gptlab.optim import lr_at, step_if_finite
from gptlab.reference.naive_adamw import NaiveAdamW, clip_grad_norm
from gptlab.runtime import autocast, to_device
from gptlab.training.faults import NonFiniteLoss


@dataclass(frozen=True)
class StepContext:
    """What every training step and evaluation of one run shares: the data, the settings (batch size, micro-steps,
    seed, clipping, evaluation batches), the context length, where and in what precision it computes, and this
    process's place among the training processes (one process alone when not given)."""

    dataset: Dataset
    cfg: TrainConfig
    block_size: int
    device: torch.device
    precision: str
    parallel: Parallel | None = None  # None: made Parallel(device), one process

    def __post_init__(self) -> None:
        if self.parallel is None:
            object.__setattr__(self, "parallel", Parallel(self.device))

    def batch(self, split: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's rows of one batch of the split ("train" or "val") drawn by `generator`, on the device."""
        batch = draw_batch(self.dataset, split, self.cfg.batch_size, self.block_size, generator)
        x, y = self.parallel.local_rows(*batch)
        return to_device(x, self.device), to_device(y, self.device)

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The model's loss on (x, y) in the run's precision."""
        with autocast(self.device, self.precision):
            return model(x, y)[1]


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, ctx: StepContext) -> dict[str, float]:
    """Mean loss of each split in eval mode (no dropout): over cfg.eval_batches fixed batches, or where one pass over
    the split takes no more rows than those would (a small split), over that one pass, each target once (the
    split's mean loss per target, as `gptlab eval` counts it). With several processes, each scores its rows of
    every batch."""
    was_training = model.training
    model.eval()
    out = {split: _split_loss(model, ctx, split) for split in ("train", "val")}
    model.train(was_training)
    return out


def _split_loss(model: torch.nn.Module, ctx: StepContext, split: str) -> float:
    cfg, parallel = ctx.cfg, ctx.parallel
    if pass_rows(ctx.dataset, split, ctx.block_size) > cfg.eval_batches * cfg.batch_size:
        total = torch.zeros((), device=ctx.device)
        for i in range(cfg.eval_batches):
            total += parallel.mean(ctx.loss(model, *ctx.batch(split, batch_generator(cfg.seed, i, -1))))
        return total.item() / cfg.eval_batches
    nats = count = torch.zeros((), device=ctx.device)
    for batch in pass_batches(ctx.dataset, split, cfg.batch_size, ctx.block_size):
        x, y = (to_device(t, ctx.device) for t in parallel.local_rows(*batch))
        n = (y != -1).sum()
        nats = nats + torch.where(n > 0, ctx.loss(model, x, y).float() * n, 0.0)  # rows of padding alone: no loss
        count = count + n
    return (parallel.mean(nats) / parallel.mean(count.float())).item()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: StepContext,
               step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimizer step number `step` over cfg.grad_accum micro-batches (each process taking its rows of each);
    returns (mean loss over all processes, gradient norm before clipping) as tensors. A step whose loss or norm is
    not finite is never applied (decided on the device, see step_if_finite); where the host would wait for the
    device to learn it (CUDA, see defers_finite_check) the loop reads it back later, elsewhere this raises
    NonFiniteLoss at once."""
    cfg, parallel = ctx.cfg, ctx.parallel
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)  # Muon's matrices: their own peak
    loss_sum = torch.zeros((), device=ctx.device)
    batches = [ctx.batch("train", batch_generator(cfg.seed, step, micro)) for micro in range(cfg.grad_accum)]
    weights = lesson_weights([y for _, y in batches], parallel) if ctx.dataset.chat else None
    for micro, (x, y) in enumerate(batches):
        with parallel.no_sync(last=micro == cfg.grad_accum - 1):
            loss = ctx.loss(model, x, y)
            (loss / cfg.grad_accum if weights is None else loss * weights[micro]).backward()
        loss_sum += loss.detach() if weights is None else loss.detach() * weights[micro] * cfg.grad_accum
    limit = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    if isinstance(optimizer, NaiveAdamW):  # the reference engine clips in C++ too
        norm = clip_grad_norm(model.parameters(), limit, optimizer.library)
    else:
        norm = parallel.clip_grad_norm(model, limit)
    loss = parallel.mean(loss_sum / cfg.grad_accum)
    applied = step_if_finite(optimizer, loss, norm)
    optimizer.zero_grad(set_to_none=True)
    if not defers_finite_check(ctx.device) and not applied:
        raise NonFiniteLoss(f"step {step + 1}: the loss ({loss.item()}) or gradient norm ({norm.item()}) is not "
                            "finite, so the step was not applied")
    return loss, norm


def lesson_weights(targets: list[torch.Tensor], parallel: Parallel) -> list[torch.Tensor]:
    """Where only some targets are lessons (-1 elsewhere: conversations), the weight of each micro-batch's mean
    loss that makes the step's loss the mean over every lesson of the step, in every process: its lessons x
    processes / all the step's lessons (DDP then averages the processes' gradients)."""
    counts = [(y != -1).sum().to(torch.float32) for y in targets]
    total = parallel.mean(torch.stack(counts).sum()) * parallel.world_size
    return [n * parallel.world_size / total for n in counts]


def defers_finite_check(device: torch.device) -> bool:
    """Whether the host learns of non-finite steps only at log rows and evaluations (on CUDA: asking after
    every step would make the host wait for the GPU every step; elsewhere the answer is free)."""
    return device.type == "cuda"


def warm_up(ctx: StepContext) -> Callable[[torch.nn.Module], None]:
    """One forward and backward pass on the first batch, to compile the training graph before the clock runs."""

    def run(model: torch.nn.Module) -> None:
        ctx.loss(model, *ctx.batch("train", batch_generator(ctx.cfg.seed, 0))).backward()
    return run
