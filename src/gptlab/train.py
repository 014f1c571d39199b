"""The training loop, top to bottom: batch -> forward -> backward -> clip -> step -> log -> eval -> checkpoint."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gptlab import checkpoint as ck
from gptlab import distributed
from gptlab.config import ModelConfig, TrainConfig, from_dict, to_dict
from gptlab.data import Dataset, batch_generator, get_batch, load_dataset
from gptlab.distributed import Parallel
from gptlab.errors import GptlabError
from gptlab.model import build_model
from gptlab.optim import lr_at, make_optimizer, step_if_finite
from gptlab.plots import plot_loss, read_metrics
from gptlab.runtime import (Speed, autocast, cached_speed, compile_model, configure_matmul, resolve_precision,
                            set_threads, to_device)

log = logging.getLogger("gptlab")


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    val_loss: float
    best_val_loss: float
    seconds: float
    tokens_per_second: float
    history: list[dict[str, Any]] = field(default_factory=list)
    rank: int = 0


@dataclass
class Progress:
    """Everything about where training stands that a checkpoint must carry to resume exactly."""

    step: int = 0
    tokens_seen: int = 0
    best_val_loss: float = math.inf


class NonFiniteLoss(GptlabError):
    pass


def check_data(dataset: Dataset, model_cfg: ModelConfig) -> None:
    """Refuse data the model cannot learn from, with the numbers that make it so."""
    need = model_cfg.block_size + 1
    for split, tokens in (("training", dataset.train), ("validation", dataset.val)):
        if len(tokens) < need:
            raise GptlabError(f"the {split} split of {dataset.path} has {len(tokens)} tokens, fewer than "
                              f"block_size + 1 = {need}; use a longer corpus or a smaller --block-size")
    if model_cfg.vocab_size < dataset.tokenizer.vocab_size:
        raise GptlabError(f"vocab_size {model_cfg.vocab_size} is smaller than the tokenizer's "
                          f"{dataset.tokenizer.vocab_size}; drop the --vocab-size override")


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
    (mean loss over all processes, gradient norm before clipping) as tensors, so nothing waits for the device
    here. A step whose loss or norm is not finite is not applied (decided on the device; see step_if_finite)."""
    dist = dist or Parallel(device)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
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
    step_if_finite(optimizer, loss, norm)
    optimizer.zero_grad(set_to_none=True)
    return loss, norm


def resume_state(run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 dataset: Dataset, model_cfg: ModelConfig) -> Progress:
    """Load the newest valid checkpoint of `run_dir` into model and optimizer; returns where training stands."""
    ckpt = ck.find_checkpoint(run_dir, "step")
    if ckpt is None:
        raise GptlabError(f"run {run_dir} has no checkpoint to resume from; drop --resume to start it")
    state = ck.read_state(ckpt)
    saved = from_dict(ModelConfig, state["model"]).shape()
    if saved != model_cfg.shape():
        diff = ", ".join(f"{k}={saved[k]} (now {v})" for k, v in model_cfg.shape().items() if saved[k] != v)
        raise GptlabError(f"cannot resume {run_dir}: it was trained with {diff}; drop those overrides or use a new --run")
    if state.get("data_fingerprint") != dataset.fingerprint():
        raise GptlabError(f"cannot resume {run_dir}: it was trained on different data than {dataset.path}; "
                          "use the same --data or start a new --run")
    ck.load_model_tensors(model, ck.load_tensors(ckpt.path / "model.safetensors"), str(ckpt.path))
    ck.restore_optimizer(optimizer, ck.load_tensors(ckpt.path / "optimizer.safetensors"), state["optimizer"])
    ck.restore_rng(ck.load_tensors(ckpt.path / "rng.safetensors"))
    return Progress(state["step"], state["tokens_seen"], state["best_val_loss"])


def _keep_metrics_until(path: Path, step: int) -> None:
    """After a resume, drop what a crashed run logged past its checkpoint, so the log reads as one run."""
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    ck.write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def train(data_dir: str | Path, run_dir: str | Path, model_cfg: ModelConfig, cfg: TrainConfig,
          resume: bool = False, quiet: bool = False, extra: dict[str, Any] | None = None) -> TrainResult:
    """Train `model_cfg` on the prepared data in `data_dir` into `run_dir`, per `cfg`; with resume, continue from
    the run's newest valid checkpoint. Under torchrun, every process runs this and trains its share of each
    batch (see distributed.py). Returns the final numbers; raises GptlabError on bad input."""
    set_threads()
    dist = distributed.setup(cfg.device)
    device = dist.device
    precision = resolve_precision(cfg.precision, device)
    configure_matmul(device, precision)
    dist.check_batch(cfg.batch_size)
    dataset = load_dataset(data_dir)
    if model_cfg.vocab_size == 0:
        model_cfg.vocab_size = dataset.tokenizer.vocab_size
    check_data(dataset, model_cfg)
    run = Path(run_dir)
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg).to(device)
    speed = cached_speed(device, precision, cfg.batch_size * model_cfg.block_size * cfg.grad_accum,
                         model.flops_per_token(), dist.world_size)
    optimizer = make_optimizer(model, cfg)
    progress = resume_state(run, model, optimizer, dataset, model_cfg) if resume else Progress()
    model, optimizer = dist.wrap(model, optimizer, cfg.fsdp)
    dist.reseed(cfg.seed, progress.step)
    if cfg.compile:
        model = compile_model(model, warm_up(dataset, cfg, model_cfg.block_size, device, precision, dist))
    if dist.is_main:
        ck.init_run(run, model_cfg, cfg, dataset.tokenizer, {"data": str(Path(data_dir)), "precision": precision,
                    "device": str(device), "processes": dist.world_size, **(extra or {})})
        metrics = run / ck.METRICS
        if resume:
            _keep_metrics_until(metrics, progress.step)
        elif metrics.exists():
            metrics.unlink()
    result = _loop(model, optimizer, dataset, model_cfg, cfg, run, progress, device, precision, quiet, speed, dist)
    dist.barrier()  # no process leaves while rank 0 may still be writing
    return result


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


def _loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Dataset, model_cfg: ModelConfig,
          cfg: TrainConfig, run: Path, progress: Progress, device: torch.device, precision: str,
          quiet: bool, speed: Speed, dist: Parallel) -> TrainResult:
    from tqdm import tqdm

    fingerprint = dataset.fingerprint()
    bar = tqdm(total=cfg.max_steps, initial=progress.step, desc="train", unit="step", dynamic_ncols=True,
               disable=True if quiet or not dist.is_main else None)
    model.train()
    eager = getattr(model, "_orig_mod", model)  # evaluate uncompiled: a second compiled graph costs more than it saves
    start, start_step, val_loss, history = time.perf_counter(), progress.step, math.nan, []
    tick, tick_step = start, progress.step  # the current speed interval, which leaves out evaluations and saves
    nonfinite = torch.zeros((), dtype=torch.int64, device=device)  # steps not applied; read (and fatal) at log rows
    with open(run / ck.METRICS if dist.is_main else os.devnull, "a") as metrics:
        def record(row: dict[str, Any]) -> None:
            history.append(row)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

        while progress.step < cfg.max_steps:
            loss, norm = train_step(model, optimizer, dataset, cfg, model_cfg.block_size, progress.step, device,
                                    precision, dist)
            nonfinite += ~(loss.isfinite() & norm.isfinite())
            progress.step += 1
            progress.tokens_seen += speed.tokens_per_step
            done = progress.step == cfg.max_steps
            if progress.step % cfg.log_interval == 0 or done:
                _check_finite(int(nonfinite.item()), progress.step)
                now = time.perf_counter()
                rates = speed.report(progress.step - tick_step, now - tick)
                tick, tick_step = now, progress.step
                shown = loss.item()
                record({"kind": "train", "step": progress.step, "loss": shown, "grad_norm": norm.item(),
                        "lr": lr_at(progress.step - 1, cfg), "tokens": progress.tokens_seen, **rates,
                        "elapsed_s": round(now - start, 3)})
                bar.set_postfix(loss=f"{shown:.4f}", tok_s=f"{rates['tokens_per_s']:,.0f}",
                                **({"mfu": f"{rates['mfu']:.0%}"} if "mfu" in rates else {}), refresh=False)
            bar.update(1)
            if progress.step % cfg.eval_interval == 0 or done:
                losses = estimate_loss(eager, dataset, cfg, model_cfg.block_size, device, precision, dist)
                val_loss = losses["val"]
                record({"kind": "eval", "step": progress.step, "train_loss": losses["train"],
                        "val_loss": val_loss, "elapsed_s": round(time.perf_counter() - start, 3)})
                if dist.is_main:
                    bar.write(f"step {progress.step}: train loss {losses['train']:.4f}, val loss {val_loss:.4f}")
                _save(run, model, optimizer, model_cfg, cfg, progress, fingerprint, val_loss, dist)
                tick, tick_step = time.perf_counter(), progress.step
    bar.close()
    seconds = time.perf_counter() - start
    if dist.is_main:
        plot_loss(run / ck.METRICS, run / "loss.png", title=f"{run.name}")
    rate = (progress.step - start_step) * speed.tokens_per_step / max(seconds, 1e-9)
    return TrainResult(run, progress.step, val_loss, progress.best_val_loss, seconds, rate, history, dist.rank)


def _check_finite(skipped: int, step: int) -> None:
    """Raise NonFiniteLoss when steps were skipped for a non-finite loss or gradient norm (counted on the device,
    read back only at log rows, where the host waits for the device anyway)."""
    if skipped:
        raise NonFiniteLoss(f"{skipped} step(s) up to step {step} had a non-finite loss or gradient norm and were "
                            "not applied; try a lower --lr or --precision fp32")


def _save(run: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_cfg: ModelConfig,
          cfg: TrainConfig, progress: Progress, fingerprint: str, val_loss: float, dist: Parallel) -> None:
    """A resumable checkpoint now, and a "best" one when the validation loss is the lowest so far; written by
    rank 0 once every process has reached this point, with full (unsharded) tensors."""
    improved = val_loss < progress.best_val_loss
    if improved:
        progress.best_val_loss = val_loss
    state = {"tokens_seen": progress.tokens_seen, "best_val_loss": progress.best_val_loss, "val_loss": val_loss,
             "data_fingerprint": fingerprint, "model": to_dict(model_cfg), "train": to_dict(cfg),
             "gptlab_version": ck.__version__, "git_commit": ck.git_commit()}
    dist.barrier()
    model, optimizer = dist.full_state(model, optimizer)
    if not dist.is_main:
        return
    ck.save_checkpoint(run, "step", progress.step, model, state, optimizer, keep=cfg.keep_last)
    if improved:
        ck.save_checkpoint(run, "best", progress.step, model, state, keep=1)
