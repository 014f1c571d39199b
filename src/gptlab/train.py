"""The training loop, top to bottom: batch -> forward -> backward -> clip -> step -> log -> eval -> checkpoint."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gptlab import checkpoint as ck
from gptlab import __version__, rundir
from gptlab import distributed
from gptlab.config import ModelConfig, TrainConfig, from_dict, to_dict
from gptlab.data import Dataset, batch_generator, get_batch, load_dataset
from gptlab.distributed import Parallel
from gptlab.errors import GptlabError
from gptlab.faults import GracefulStop, Interrupted, LossSpike, NonFiniteLoss, SpikeGuard, is_out_of_memory
from gptlab.model import build_model
from gptlab.optim import lr_at, make_optimizer, step_if_finite
from gptlab.plots import plot_loss, read_metrics
from gptlab.tokenizer import load as load_tokenizer
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
    train_seconds: float = 0.0  # `seconds` less evaluations and checkpoints: what tokens_per_second counts


@dataclass
class Progress:
    """Everything about where training stands that a checkpoint must carry to resume exactly."""

    step: int = 0
    tokens_seen: int = 0
    best_val_loss: float = math.inf


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
    (mean loss over all processes, gradient norm before clipping) as tensors. A step whose loss or norm is not
    finite is never applied (decided on the device, see step_if_finite); where the host would wait for the
    device to learn it (CUDA, see defers_finite_check) the loop reads it back later, elsewhere this raises
    NonFiniteLoss at once."""
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


PLAIN_LINE_SECONDS = 10.0  # without a terminal (CI, nohup, | tee): a progress line at most this often
LOCKED_RUN_ENV = "GPTLAB_LOCKED_RUN"  # set by `gptlab train --nproc`, whose launcher holds the run's lock


def check_memory(model_cfg: ModelConfig, cfg: TrainConfig, device: torch.device, processes: int) -> None:
    """Refuse, before allocating anything, what cannot fit the device's memory by a lower bound alone: the
    weights, gradients and AdamW moments (16 bytes a parameter), or one micro-batch's logits and their gradient
    (8 bytes per position and vocabulary entry)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    elif device.type == "cpu" and hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        return
    with torch.device("meta"):
        params = build_model(model_cfg).num_params()
    gib = f"the {total / 2**30:,.0f} GiB of this {device.type}"
    if params * 16 > total:
        raise GptlabError(f"this model has {params:,} parameters: training it needs about {params * 16 / 2**30:,.0f} "
                          f"GiB for its weights, gradients and AdamW state, more than {gib}; choose a smaller "
                          "--n-embd or --n-layer")
    rows = max(1, cfg.batch_size // processes)
    logits = rows * model_cfg.block_size * model_cfg.vocab_size * 8
    if logits > total:
        raise GptlabError(f"a micro-batch of {rows:,} x {model_cfg.block_size} positions needs "
                          f"{logits / 2**30:,.0f} GiB for its logits alone, more than {gib}; use a smaller "
                          "--batch-size with a larger --grad-accum (the same tokens per step)")


def check_new_run(run: Path) -> None:
    """A new run may start in a new or empty folder, or over a run folder without checkpoints; never over
    checkpoints (even damaged ones), a prepared data folder, or another program's files."""
    from gptlab.data import folder_kind

    kind = folder_kind(run)
    if kind == "data":
        raise GptlabError(f"{run} is a prepared data folder; training into it would overwrite its tokenizer, so "
                          "choose another --run")
    if kind == "hf":
        raise GptlabError(f"{run} holds a config.json that is not a gptlab run's; choose another --run")
    if any((run / rundir.CKPTS).glob("step-*")) or any((run / rundir.CKPTS).glob("best-*")):
        raise GptlabError(f"run {run} already has checkpoints; pass --resume to continue it or choose a new --run")


def check_resume(run: Path, dataset: Dataset, model_cfg: ModelConfig, cfg: TrainConfig) -> tuple[ck.Checkpoint,
                                                                                                   dict[str, Any]]:
    """Everything a resume must satisfy, checked before anything is written: a valid checkpoint, the same model
    shape, the same data and tokenizer, and steps left to train. Returns the checkpoint and its state."""
    rundir.read_run_config(run)
    ckpt = ck.find_checkpoint(run, "step")
    if ckpt is None:
        raise GptlabError(f"run {run} has no checkpoint to resume from; drop --resume to start it")
    state = ck.read_state(ckpt)
    saved = from_dict(ModelConfig, state["model"]).shape()
    if saved != model_cfg.shape():
        diff = ", ".join(f"{k}={saved[k]} (now {v})" for k, v in model_cfg.shape().items() if saved[k] != v)
        raise GptlabError(f"cannot resume {run}: it was trained with {diff}; drop those overrides or use a new --run")
    if state.get("data_fingerprint") != dataset.fingerprint():
        raise GptlabError(f"cannot resume {run}: it was trained on different data than {dataset.path}; "
                          "drop --data (a run resumes on its own data) or start a new --run")
    if dataset.tokenizer.to_dict() != load_tokenizer(run / rundir.TOKENIZER).to_dict():
        raise GptlabError(f"cannot resume {run}: the tokenizer of {dataset.path} is not the run's")
    if state["step"] >= cfg.max_steps:
        raise GptlabError(f"run {run} has already trained {state['step']} steps and max_steps is {cfg.max_steps}: "
                          f"nothing to do; pass a larger --max-steps to train further")
    return ckpt, state


def resume_state(ckpt: ck.Checkpoint, state: dict[str, Any], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, progress: Progress) -> None:
    """Load a checkpoint (already checked by check_resume) into model, optimizer and the random generators, and
    set `progress` to where training stands."""
    distributed.load_checkpoint(ckpt.path, model, optimizer, state["optimizer"])  # whole or sharded, either way
    ck.restore_rng(ck.load_tensors(ckpt.path / "rng.safetensors"))
    progress.step, progress.tokens_seen, progress.best_val_loss = state["step"], state["tokens_seen"], \
        state["best_val_loss"]


def settings_changed(state: dict[str, Any], model_cfg: ModelConfig, cfg: TrainConfig) -> dict[str, list[Any]]:
    """The settings a resume changes deliberately ({name: [before, now]}): training ones and the model's
    non-shape ones (dropout, attention path)."""
    now = {**to_dict(model_cfg), **to_dict(cfg)}
    before = {**state["model"], **state["train"]}
    return {k: [v, now[k]] for k, v in before.items() if k in now and now[k] != v}


def _keep_metrics_until(path: Path, step: int) -> None:
    """After a resume, drop what a crashed run logged past its checkpoint, so the log reads as one run."""
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    rundir.write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def train(data_dir: str | Path, run_dir: str | Path, model_cfg: ModelConfig, cfg: TrainConfig,
          resume: bool = False, quiet: bool = False, extra: dict[str, Any] | None = None,
          init: dict[str, torch.Tensor] | None = None) -> TrainResult:
    """Train `model_cfg` on the prepared data in `data_dir` into `run_dir`, per `cfg`; with resume, continue from
    the run's newest valid checkpoint; with `init` (the weights cfg.init_from names, which runs.start reads),
    start a new run from those weights. Returns the final numbers. Raises GptlabError on bad input, and its
    subclasses Interrupted (a signal: a checkpoint was written), NonFiniteLoss and LossSpike (nothing applied).
    Everything is checked before the run folder is written, and the folder has one writer at a time (RunLock).
    Under torchrun, every process runs this and trains its share of each batch (see distributed.py)."""
    set_threads()
    dist = distributed.setup(cfg.device)
    device = dist.device
    precision = resolve_precision(cfg.precision, device)
    configure_matmul(device, precision)
    dist.check_batch(cfg.batch_size)
    dataset = load_dataset(data_dir)
    if model_cfg.vocab_size == 0:
        model_cfg.vocab_size = dataset.tokenizer.vocab_size
    if cfg.init_from and not resume and init is None:
        raise GptlabError(f"init_from {cfg.init_from!r} needs its weights: start the run with gptlab.runs.start")
    check_data(dataset, model_cfg)
    check_memory(model_cfg, cfg, device, dist.world_size)
    run = Path(run_dir)
    own_lock = dist.is_main and os.environ.get(LOCKED_RUN_ENV) != str(run.resolve())
    lock = rundir.RunLock(run) if own_lock else contextlib.nullcontext()
    with lock:
        progress = Progress()
        try:
            return _train_locked(dataset, run, model_cfg, cfg, resume, quiet, extra or {}, init, dist, precision,
                                 progress)
        except GptlabError as exc:
            if own_lock and progress.step == 0 and not isinstance(exc, Interrupted):
                lock.undo()  # refused, or a new run failed before its first step: the folder is as it was
            raise


def _train_locked(dataset: Dataset, run: Path, model_cfg: ModelConfig, cfg: TrainConfig, resume: bool, quiet: bool,
                  extra: dict[str, Any], init: dict[str, torch.Tensor] | None, dist: Parallel, precision: str,
                  progress: Progress) -> TrainResult:
    """train(), once this process may write the run: check, then write, then train."""
    device = dist.device
    dist.check_shared_folder(run)  # several machines: each must see the folder rank 0 writes
    ckpt, state = check_resume(run, dataset, model_cfg, cfg) if resume else (None, None)
    if not resume:
        check_new_run(run)
    dist.check_same_start(resume, ckpt.step if ckpt else None)
    torch.manual_seed(cfg.seed)
    model = dist.build(model_cfg, cfg.fsdp, init, cfg.init_from)  # with FSDP: only this process's slices
    speed = cached_speed(device, precision, cfg.batch_size * model_cfg.block_size * cfg.grad_accum,
                         model.flops_per_token(), dist.world_size)
    optimizer = make_optimizer(model, cfg)
    if ckpt is not None:
        resume_state(ckpt, state, model, optimizer, progress)
    if dist.is_main:  # every check has passed: now the run folder may change
        where = {"data": str(dataset.path.resolve()), "precision": precision, "device": str(device),
                 "processes": dist.world_size}
        if resume:
            changes = settings_changed(state, model_cfg, cfg)
            if changes:
                log.warning("resuming %s at step %d with changed settings: %s", run, state["step"],
                            ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items()))
            rundir.update_run_config(run, model_cfg, cfg, {**where, **extra},
                                 {"step": state["step"], "changes": changes, "time": time.time()})
        else:
            rundir.init_run(run, model_cfg, cfg, dataset.tokenizer, {**where, **extra})
    model, optimizer = dist.wrap(model, optimizer, cfg.fsdp)
    dist.reseed(cfg.seed, progress.step)
    if cfg.compile:
        model = compile_model(model, warm_up(dataset, cfg, model_cfg.block_size, device, precision, dist))
    if dist.is_main:
        ck.clean_stale(run)
        metrics = run / rundir.METRICS
        if resume:
            _keep_metrics_until(metrics, progress.step)
        elif metrics.exists():
            metrics.unlink()
    trainer = Trainer(model, optimizer, dataset, model_cfg, cfg, run, progress, device, precision, speed, dist)
    result = trainer.loop(quiet)
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


@dataclass
class Trainer:
    """One training run in progress: what the loop needs, and the small steps it is made of."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dataset: Dataset
    model_cfg: ModelConfig
    cfg: TrainConfig
    run: Path
    progress: Progress
    device: torch.device
    precision: str
    speed: Speed
    dist: Parallel
    history: list[dict[str, Any]] = field(default_factory=list)
    last_checkpoint: Path | None = None
    val_loss: float = math.nan
    held_reported: bool = False  # the first train row says what each process holds (held_bytes)

    def loop(self, quiet: bool) -> TrainResult:
        """Steps until max_steps: train step, log, evaluate and checkpoint at intervals, stop cleanly on a signal."""
        from tqdm import tqdm

        cfg, progress = self.cfg, self.progress
        found = ck.find_checkpoint(self.run, "step")
        self.last_checkpoint = found.path if found else None
        bar = tqdm(total=cfg.max_steps, initial=progress.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=True if quiet or not self.dist.is_main else None)
        spikes = SpikeGuard(cfg.spike_factor, cfg.spike_patience)
        self.start, self.start_step = time.perf_counter(), progress.step
        self.tick, self.tick_step = self.start, progress.step  # the speed interval: evaluations and saves left out
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=self.device)  # steps skipped, when deferred
        self.eager = getattr(self.model, "_orig_mod", self.model)  # evaluating compiled costs a second compilation
        self.model.train()
        metrics = self.run / rundir.METRICS if self.dist.is_main else os.devnull
        self.train_seconds, self.last_line = 0.0, self.start
        self.plain = not quiet and self.dist.is_main and bar.disable  # no terminal: a plain line now and then
        with GracefulStop() as stop, open(metrics, "a") as self.metrics:
            while progress.step < cfg.max_steps:
                began = time.perf_counter()
                loss, norm = self.step()
                if cfg.spike_factor > 0:
                    self.check_finite()  # the guard reads the loss every step anyway
                    self.guard(spikes.check, progress.step, loss.item())
                done = progress.step == cfg.max_steps
                log_row = progress.step % cfg.log_interval == 0 or done
                if log_row:
                    self.check_finite()
                    self.log(loss, norm, bar)
                bar.update(1)
                self.train_seconds += time.perf_counter() - began
                if progress.step % cfg.eval_interval == 0 or done:
                    self.check_finite()
                    self.evaluate(bar)
                if self.stopping(stop, log_row) and not done:
                    self.interrupted(stop.signum or signal.SIGTERM, bar)
        bar.close()
        seconds = time.perf_counter() - self.start
        if self.dist.is_main:
            plot_loss(self.run / rundir.METRICS, self.run / "loss.png", title=self.run.name)
        rate = (progress.step - self.start_step) * self.tokens_per_step / max(self.train_seconds, 1e-9)
        return TrainResult(self.run, progress.step, self.val_loss, progress.best_val_loss, seconds, rate,
                           self.history, self.dist.rank, self.train_seconds)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.model_cfg.block_size * self.cfg.grad_accum

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        loss, norm = self.guard(train_step, self.model, self.optimizer, self.dataset, self.cfg,
                                self.model_cfg.block_size, self.progress.step, self.device, self.precision,
                                self.dist)
        if defers_finite_check(self.device):
            self.nonfinite += ~(loss.isfinite() & norm.isfinite())
        self.progress.step += 1
        self.progress.tokens_seen += self.tokens_per_step
        return loss, norm

    def check_finite(self) -> None:
        """Where the check is deferred: stop if any step so far was skipped for a non-finite loss or norm."""
        skipped = int(self.nonfinite.item()) if defers_finite_check(self.device) else 0
        if skipped:
            message = (f"{skipped} step(s) up to step {self.progress.step} had a non-finite loss or gradient norm, "
                       "so they were not applied")
            self.guard(_raise, NonFiniteLoss(message))

    def stopping(self, stop: GracefulStop, log_row: bool) -> bool:
        """Whether to stop for a signal now: after this step in one process; at a log row, agreed by all, in
        several (each must stop at the same step)."""
        if not self.dist.active:
            return stop.signum is not None
        return log_row and self.dist.any(stop.signum is not None)

    def guard(self, fn: Any, *args: Any) -> Any:
        """Run fn; turn a non-finite loss, a spike or running out of memory into one message that says where the
        last good checkpoint is and what to try."""
        last = f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint else \
            "no checkpoint was written yet"
        try:
            return fn(*args)
        except (NonFiniteLoss, LossSpike) as exc:
            raise type(exc)(f"{exc}; {last}. Try a lower --lr, more --warmup-steps or --precision fp32") from None
        except (MemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            B, accum = self.cfg.batch_size, self.cfg.grad_accum
            raise GptlabError(f"out of memory on {self.device} at batch_size {B} x block_size "
                              f"{self.model_cfg.block_size}; try --batch-size {max(1, B // 2)} --grad-accum "
                              f"{accum * 2} (the same tokens per step); {last}") from None

    def record(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()

    def log(self, loss: torch.Tensor, norm: torch.Tensor, bar: Any) -> None:
        """A train row: loss, norm, lr, and the speed since the last row (tokens/s; MFU once the peak is cached)."""
        now = time.perf_counter()
        rates = self.speed.report(self.progress.step - self.tick_step, now - self.tick)
        self.tick, self.tick_step = now, self.progress.step
        shown = loss.item()
        held = {} if self.held_reported else self.dist.held_bytes(self.model, self.optimizer)  # per process, once
        self.held_reported = True
        self.record({"kind": "train", "step": self.progress.step, "loss": shown, "grad_norm": norm.item(),
                     "lr": lr_at(self.progress.step - 1, self.cfg), "tokens": self.progress.tokens_seen, **rates,
                     "elapsed_s": round(now - self.start, 3), **held})
        mfu = {"mfu": f"{rates['mfu']:.0%}"} if "mfu" in rates else {}
        bar.set_postfix(loss=f"{shown:.4f}", tok_s=f"{rates['tokens_per_s']:,.0f}", **mfu, refresh=False)
        if self.plain and (now - self.last_line >= PLAIN_LINE_SECONDS or self.progress.step == self.cfg.max_steps):
            self.last_line = now
            print(f"step {self.progress.step}/{self.cfg.max_steps}: loss {shown:.4f}, "
                  f"{rates['tokens_per_s']:,.0f} tokens/s" + (f", mfu {mfu['mfu']}" if mfu else "") +
                  f", {now - self.start:,.0f} s", file=sys.stderr, flush=True)

    def evaluate(self, bar: Any) -> None:
        losses = estimate_loss(self.eager, self.dataset, self.cfg, self.model_cfg.block_size, self.device,
                               self.precision, self.dist)
        self.val_loss = losses["val"]
        self.record({"kind": "eval", "step": self.progress.step, "train_loss": losses["train"],
                     "val_loss": self.val_loss, "elapsed_s": round(time.perf_counter() - self.start, 3)})
        if self.dist.is_main:
            bar.write(f"step {self.progress.step}: train loss {losses['train']:.4f}, val loss {self.val_loss:.4f}")
        self.save(best=self.val_loss < self.progress.best_val_loss)
        self.tick, self.tick_step = time.perf_counter(), self.progress.step

    def interrupted(self, signum: int, bar: Any) -> None:
        """Write a checkpoint of the step just finished (unless evaluation just did) and stop."""
        if self.last_checkpoint is None or not self.last_checkpoint.name.endswith(f"{self.progress.step:08d}"):
            self.save(best=False)
        bar.close()
        name = signal.Signals(signum).name
        raise Interrupted(f"stopped by {name} at step {self.progress.step}; checkpoint {self.last_checkpoint}; "
                          f"resume with: gptlab train --run {self.run} --resume", signum)

    def save(self, best: bool) -> None:
        """A resumable checkpoint now, and a "best" one when the validation loss is the lowest so far; written by
        rank 0 once every process has come this far (with FSDP, every process writes its slices of the tensors)."""
        progress = self.progress
        if best:
            progress.best_val_loss = self.val_loss
        state = {"tokens_seen": progress.tokens_seen, "best_val_loss": progress.best_val_loss,
                 "val_loss": self.val_loss, "data_fingerprint": self.dataset.fingerprint(),
                 "sampler": {"seed": self.cfg.seed, "next_step": progress.step},
                 "model": to_dict(self.model_cfg), "train": to_dict(self.cfg),
                 "gptlab_version": __version__, "git_commit": rundir.git_commit()}
        self.dist.barrier()
        model, optimizer, shards = self.model, self.optimizer, self.dist.shard_writer(self.model, self.optimizer)
        if not self.dist.is_main:
            self.dist.join_saves(model, optimizer, 2 if best else 1)
            self.last_checkpoint = self.run / rundir.CKPTS / f"step-{progress.step:08d}"  # where rank 0 writes it
            return
        extra = {rundir.TOKENIZER: (self.run / rundir.TOKENIZER).read_bytes()}
        self.last_checkpoint = ck.save_checkpoint(self.run, "step", progress.step, model, state, optimizer,
                                                  keep=self.cfg.keep_last, extra_files=extra, shards=shards)
        if best:
            ck.save_checkpoint(self.run, "best", progress.step, model, state, keep=1, extra_files=extra,
                               shards=shards)


def _raise(exc: Exception) -> None:
    raise exc
