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
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

import torch

from gptlab import checkpoint as ck
from gptlab import __version__, lora, rundir
from gptlab.config import NATIVE_ENGINES, ModelConfig, TrainConfig, to_dict
from gptlab.data.batches import Dataset, load_dataset
from gptlab.distributed import processes
from gptlab.distributed.processes import Parallel
from gptlab.errors import GptlabError
from gptlab.heads import check_probe, induction_metrics
from gptlab.optim import lr_at, make_optimizer
from gptlab.peak import Speed, cached_speed
from gptlab.plots import plot_loss
from gptlab.runtime import (autocast, compile_model, configure_matmul, resolve_precision, reuse_freed_memory,
                             set_threads)
from gptlab.reference.fast import fast_model, fast_optimizer
from gptlab.reference.naive_training import naive_model, naive_optimizer
from gptlab.training.faults import GracefulStop, Interrupted, LossSpike, NonFiniteLoss, SpikeGuard, is_out_of_memory
from gptlab.training.loggers import Loggers, check_loggers, open_loggers, sample_ids
from gptlab.training.preflight import (check_checkpointing, check_data, check_engine, check_init_weights,
                                       check_memory, check_new_run, check_resume, settings_changed)
from gptlab.training.resume import Progress, keep_metrics_until, resume_state
from gptlab.training.step import StepContext, defers_finite_check, estimate_loss, train_step, warm_up

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger("gptlab")
_T = TypeVar("_T")


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
    start_step: int = 0  # where this session began (a resume's checkpoint): `seconds` timed the steps from here


PLAIN_LINE_SECONDS = 10.0  # without a terminal (CI, nohup, | tee): a progress line at most this often
LOCKED_RUN_ENV = "GPTLAB_LOCKED_RUN"  # set by `gptlab train --nproc`, whose launcher holds the run's lock


def train(data_dir: str | Path, run_dir: str | Path, model_cfg: ModelConfig, cfg: TrainConfig,
          resume: bool = False, quiet: bool = False, extra: dict[str, Any] | None = None,
          init: dict[str, torch.Tensor] | None = None) -> TrainResult:
    """Train `model_cfg` on the prepared data in `data_dir` into `run_dir`, per `cfg`; with resume, continue from
    the run's newest valid checkpoint; with `init` (the weights cfg.init_from names, which runs.start reads),
    start a new run from those weights. Returns the final numbers. Raises GptlabError on bad input, and its
    subclasses Interrupted (a signal: a checkpoint was written), NonFiniteLoss and LossSpike (nothing applied).
    Everything is checked before the run folder is written, and the folder has one writer at a time (RunLock).
    Under torchrun, every process runs this and trains its share of each batch (see distributed/processes.py)."""
    set_threads()
    reuse_freed_memory()
    native = cfg.engine in NATIVE_ENGINES  # a C++ engine (reference, fast): fp32 on the CPU, whatever auto would pick
    parallel = processes.setup("cpu" if native else cfg.device)
    device = parallel.device
    precision = "fp32" if native else resolve_precision(cfg.precision, device)
    check_engine(cfg, model_cfg, parallel.world_size)
    check_checkpointing(cfg, model_cfg)
    check_probe(cfg.probe, model_cfg.arch)
    configure_matmul(device, precision)
    parallel.check_batch(cfg.batch_size)
    dataset = load_dataset(data_dir)
    if model_cfg.vocab_size == 0:
        model_cfg.vocab_size = dataset.tokenizer.vocab_size
    check_init_weights(cfg, resume, init)
    if not resume:  # a resume checks first that the data is the run's (check_resume): what is wrong when it is not
        check_data(dataset, model_cfg)
    check_memory(model_cfg, cfg, device, parallel.world_size, precision)
    run = Path(run_dir)
    check_loggers(cfg.log, run)
    own_lock = parallel.is_main and os.environ.get(LOCKED_RUN_ENV) != str(run.resolve())
    lock = rundir.RunLock(run) if own_lock else contextlib.nullcontext()
    with lock:
        progress = Progress()
        try:
            return _train_locked(dataset, run, model_cfg, cfg, resume, quiet, extra or {}, init, parallel, precision,
                                 progress)
        except GptlabError as exc:
            if own_lock and progress.step == 0 and not isinstance(exc, Interrupted):
                lock.undo()  # refused, or a new run failed before its first step: the folder is as it was
            raise


def _train_locked(dataset: Dataset, run: Path, model_cfg: ModelConfig, cfg: TrainConfig, resume: bool, quiet: bool,
                  extra: dict[str, Any], init: dict[str, torch.Tensor] | None, parallel: Parallel, precision: str,
                  progress: Progress) -> TrainResult:
    """train(), once this process may write the run: check, then write, then train."""
    device = parallel.device
    parallel.check_shared_folder(run)  # several machines: each must see the folder rank 0 writes
    ckpt, state = check_resume(run, dataset, model_cfg, cfg) if resume else (None, None)
    if not resume:
        check_new_run(run)
    parallel.check_same_start(resume, ckpt.step if ckpt else None)
    torch.manual_seed(cfg.seed)
    model = parallel.build(model_cfg, cfg.fsdp, init, cfg.init_from)  # with FSDP: only this process's slices
    base = lora.adapt(model, cfg, init, state and (state.train, state.base), dataset.tokenizer, precision)
    model.checkpoint_blocks, model.loss_chunk = cfg.activation_checkpointing, cfg.loss_chunk  # kept when wrapped
    speed = cached_speed(device, precision, cfg.batch_size * model_cfg.block_size * cfg.grad_accum,
                         model.flops_per_token(), parallel.world_size)
    model, optimizer = on_engine(model, cfg)
    if ckpt is not None:
        resume_state(ckpt, state, model, optimizer, progress)
    if parallel.is_main:  # every check has passed: now the run folder may change
        where = {"data": str(dataset.path.resolve()), "precision": precision, "device": str(device),
                 "processes": parallel.world_size, **({"base": base} if base else {})}  # LoRA's base, named
        if resume:
            changes = settings_changed(state, model_cfg, cfg)
            if changes:
                log.warning("resuming %s at step %d with changed settings: %s", run, state.step,
                            ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items()))
            rundir.update_run_config(run, model_cfg, cfg, {**where, **extra},
                                 {"step": state.step, "changes": changes, "time": time.time()})
        else:
            rundir.init_run(run, model_cfg, cfg, dataset.tokenizer, {**where, **extra})
    model, optimizer = parallel.wrap(model, optimizer, cfg.fsdp)
    parallel.reseed(cfg.seed, progress.step)
    ctx = StepContext(dataset, cfg, model_cfg.block_size, device, precision, parallel)
    if cfg.compile:
        model = compile_model(model, warm_up(ctx))
    if parallel.is_main:
        ck.clean_stale(run)
        metrics = run / rundir.METRICS
        if resume:
            keep_metrics_until(metrics, progress.step)
        elif metrics.exists():
            metrics.unlink()
    with open_loggers(cfg.log if parallel.is_main else [], run, progress.step) as loggers:
        result = Trainer(model, optimizer, ctx, model_cfg, run, progress, speed, base, loggers=loggers).loop(quiet)
    parallel.barrier()  # no process leaves while rank 0 may still be writing
    return result


def on_engine(model: torch.nn.Module,
              cfg: TrainConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer cfg.engine trains with: torch's, or the model itself computed by a C++ engine (its
    class changed, no state) with that engine's AdamW and clipping."""
    if cfg.engine == "reference":
        return naive_model(model), naive_optimizer(model, cfg)
    if cfg.engine == "fast":
        return fast_model(model), fast_optimizer(model, cfg)
    return model, make_optimizer(model, cfg)


@dataclass
class LoopClock:
    """The loop's time (perf_counter seconds): when this session began and at which step, where the current speed
    interval began (evaluations and checkpoints are left out of it), the seconds spent in training steps alone, and
    when the last plain progress line was printed."""

    start: float
    start_step: int
    tick: float = 0.0
    tick_step: int = 0
    train_seconds: float = 0.0
    last_line: float = 0.0

    def __post_init__(self) -> None:
        self.tick, self.tick_step, self.last_line = self.start, self.start_step, self.start


@dataclass
class Trainer:
    """One training run in progress: what the loop is given, what it carries from step to step (declared here, each
    with its starting value), and the small steps the loop is made of."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ctx: StepContext  # the data, settings, context length, device, precision and processes every step shares
    model_cfg: ModelConfig
    run: Path
    progress: Progress
    speed: Speed
    base: dict[str, str] | None = None  # a LoRA run's base (path and weights' sha256), named in every checkpoint
    history: list[dict[str, Any]] = field(default_factory=list)  # every row written to metrics.jsonl
    last_checkpoint: Path | None = None  # the newest step checkpoint: named when the run stops on a fault
    val_loss: float = math.nan  # of the last evaluation
    held_reported: bool = False  # the first train row says what each process holds (held_bytes)
    clock: LoopClock = field(init=False)
    nonfinite: torch.Tensor = field(init=False)  # steps skipped for a non-finite loss or norm, where deferred
    eager: torch.nn.Module = field(init=False)  # the model uncompiled: evaluating compiled costs a compilation
    plain: bool = False  # no terminal (CI, nohup, | tee): a plain progress line now and then instead of a bar
    metrics: TextIO | None = None  # metrics.jsonl (os.devnull off rank 0), open while the loop runs
    loggers: Loggers = field(default_factory=Loggers)  # --log's, each row's other readers (rank 0's; none elsewhere)

    def __post_init__(self) -> None:
        found = ck.find_checkpoint(self.run, "step")
        self.last_checkpoint = found.path if found else None
        self.clock = LoopClock(time.perf_counter(), self.progress.step)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=self.ctx.device)
        self.eager = getattr(self.model, "_orig_mod", self.model)

    @property
    def cfg(self) -> TrainConfig:
        return self.ctx.cfg

    @property
    def parallel(self) -> Parallel:
        return self.ctx.parallel

    def loop(self, quiet: bool) -> TrainResult:
        """Steps until max_steps: train step, log, evaluate and checkpoint at intervals, stop cleanly on a signal."""
        from tqdm import tqdm

        cfg, progress, clock = self.cfg, self.progress, self.clock
        bar = tqdm(total=cfg.max_steps, initial=progress.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=True if quiet or not self.parallel.is_main else None)
        spikes = SpikeGuard(cfg.spike_factor, cfg.spike_patience)
        self.model.train()
        metrics = self.run / rundir.METRICS if self.parallel.is_main else os.devnull
        self.plain = not quiet and self.parallel.is_main and bar.disable
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
                clock.train_seconds += time.perf_counter() - began
                if progress.step % cfg.eval_interval == 0 or done:
                    self.check_finite()
                    self.evaluate(bar)
                if self.stopping(stop, log_row) and not done:
                    self.interrupted(stop.signum or signal.SIGTERM, bar)
        bar.close()
        seconds = time.perf_counter() - clock.start
        if self.parallel.is_main:
            plot_loss(self.run / rundir.METRICS, self.run / "loss.png", title=self.run.name)
            self.loggers.media(self.run / "loss.png", self.sample, progress.step)
        rate = (progress.step - clock.start_step) * self.tokens_per_step / max(clock.train_seconds, 1e-9)
        return TrainResult(self.run, progress.step, self.val_loss, progress.best_val_loss, seconds, rate,
                           self.history, self.parallel.rank, clock.train_seconds, clock.start_step)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.model_cfg.block_size * self.cfg.grad_accum

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        loss, norm = self.guard(train_step, self.model, self.optimizer, self.ctx, self.progress.step)
        if defers_finite_check(self.ctx.device):
            self.nonfinite += ~(loss.isfinite() & norm.isfinite())
        self.progress.step += 1
        self.progress.tokens_seen += self.tokens_per_step
        return loss, norm

    def check_finite(self) -> None:
        """Where the check is deferred: stop if any step so far was skipped for a non-finite loss or norm."""
        skipped = int(self.nonfinite.item()) if defers_finite_check(self.ctx.device) else 0
        if skipped:
            message = (f"{skipped} step(s) up to step {self.progress.step} had a non-finite loss or gradient norm, "
                       "so they were not applied")
            self.guard(_raise, NonFiniteLoss(message))

    def stopping(self, stop: GracefulStop, log_row: bool) -> bool:
        """Whether to stop for a signal now: after this step in one process; at a log row, agreed by all, in
        several (each must stop at the same step)."""
        if not self.parallel.active:
            return stop.signum is not None
        return log_row and self.parallel.any(stop.signum is not None)

    def guard(self, fn: Callable[..., _T], *args: object) -> _T:
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
            raise GptlabError(f"out of memory on {self.ctx.device} at batch_size {B} x block_size "
                              f"{self.model_cfg.block_size}; try --batch-size {max(1, B // 2)} --grad-accum "
                              f"{accum * 2} (the same tokens per step); {last}") from None

    def record(self, row: dict[str, Any]) -> None:
        assert self.metrics is not None, "rows are recorded while the loop runs"
        self.history.append(row)
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        self.loggers.log(row)

    def sample(self) -> str | None:
        """A short sample for the loggers' end (None with several processes: each would have to take part)."""
        if self.parallel.active:
            return None
        with autocast(self.ctx.device, self.ctx.precision):  # the run's precision (LoRA's base may be in bf16)
            ids = sample_ids(self.eager, int(self.ctx.dataset.val[0]), self.model_cfg.block_size, self.ctx.device)
        return self.ctx.dataset.tokenizer.decode(ids)

    def log(self, loss: torch.Tensor, norm: torch.Tensor, bar: tqdm) -> None:
        """A train row: loss, norm, lr, and the speed since the last row (tokens/s; MFU once the peak is cached)."""
        clock, now = self.clock, time.perf_counter()
        rates = self.speed.report(self.progress.step - clock.tick_step, now - clock.tick)
        clock.tick, clock.tick_step = now, self.progress.step
        shown = loss.item()
        held = {} if self.held_reported else self.parallel.held_bytes(self.model, self.optimizer)  # per process, once
        self.held_reported = True
        self.record({"kind": "train", "step": self.progress.step, "loss": shown, "grad_norm": norm.item(),
                     "lr": lr_at(self.progress.step - 1, self.cfg), "tokens": self.progress.tokens_seen, **rates,
                     "elapsed_s": round(now - clock.start, 3), **held})
        mfu = {"mfu": f"{rates['mfu']:.0%}"} if "mfu" in rates else {}
        bar.set_postfix(loss=f"{shown:.4f}", tok_s=f"{rates['tokens_per_s']:,.0f}", **mfu, refresh=False)
        if self.plain and (now - clock.last_line >= PLAIN_LINE_SECONDS or self.progress.step == self.cfg.max_steps):
            clock.last_line = now
            print(f"step {self.progress.step}/{self.cfg.max_steps}: loss {shown:.4f}, "
                  f"{rates['tokens_per_s']:,.0f} tokens/s" + (f", mfu {mfu['mfu']}" if mfu else "") +
                  f", {now - clock.start:,.0f} s", file=sys.stderr, flush=True)

    def evaluate(self, bar: tqdm) -> None:
        losses = estimate_loss(self.eager, self.ctx)
        self.val_loss = losses["val"]
        self.record({"kind": "eval", "step": self.progress.step, "train_loss": losses["train"],
                     "val_loss": self.val_loss, "elapsed_s": round(time.perf_counter() - self.clock.start, 3),
                     "train_s": round(self.clock.train_seconds, 3),  # training steps alone, this session
                     **self.probe()})
        if self.parallel.is_main:
            bar.write(f"step {self.progress.step}: train loss {losses['train']:.4f}, val loss {self.val_loss:.4f}")
        self.save(best=self.val_loss < self.progress.best_val_loss)
        self.clock.tick, self.clock.tick_step = time.perf_counter(), self.progress.step

    def probe(self) -> dict[str, float]:
        """--probe induction: every head's induction score (heads.py), in the run's precision; none without it."""
        if self.cfg.probe != "induction":
            return {}
        with autocast(self.ctx.device, self.ctx.precision):
            return induction_metrics(self.eager, self.cfg.seed)

    def interrupted(self, signum: int, bar: tqdm) -> None:
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
        state = rundir.TrainingState(
            model=to_dict(self.model_cfg), train=to_dict(self.cfg), tokens_seen=progress.tokens_seen,
            best_val_loss=progress.best_val_loss, val_loss=self.val_loss,
            data_fingerprint=self.ctx.dataset.fingerprint(),
            sampler={"seed": self.cfg.seed, "next_step": progress.step}, gptlab_version=__version__,
            git_commit=rundir.git_commit(), base=self.base)
        self.parallel.barrier()
        model, optimizer, shards = self.model, self.optimizer, self.parallel.shard_writer(self.model, self.optimizer)
        if not self.parallel.is_main:
            self.parallel.join_saves(model, optimizer, 2 if best else 1)
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
