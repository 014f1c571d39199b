"""Data-parallel training across processes: init/teardown, rank helpers, the start-up checks, DDP/FSDP wrapping,
every process's part of a checkpoint save, launching torchrun. fsdp.py beside it builds and initialises the shards;
the sharded checkpoints' file I/O is gptlab.sharded's (beside checkpoint.py, which calls it).

torchrun starts the processes and tells each its RANK, LOCAL_RANK and WORLD_SIZE; `setup` joins them into one
group (gloo on CPUs, NCCL on CUDA GPUs) and `Parallel` is everything the training loop asks of it. In a single
process (no torchrun), every method is a cheap no-op, so the loop has one code path. At start-up every process
checks that it sees the same run folder as rank 0 (several machines must share it) and the same checkpoint to
resume from, and refuses to start otherwise.

The global batch does not depend on the number of processes N: each optimizer step sees batch_size x grad_accum
sequences, the same ones as a single process would. Each micro-step's batch_size rows are drawn from
(seed, step, micro-step) and split by rows: process r trains on rows [r * b, (r + 1) * b), b = batch_size / N, so
batch_size must be a multiple of N. Gradients are averaged across processes on the last micro-step only
(`no_sync` on the others), which makes N processes compute the same mean gradient as one.

Parallelism is applied to the model from outside: DDP (a full copy per process, gradients all-reduced) by
default, or FSDP2 (`fully_shard`: parameters, gradients and optimizer state sharded, each process holding about
1/N of them). With FSDP no process ever holds the whole model: it is built on the meta device, sharded, and each
process draws the initial values one whole parameter at a time, in the order and from the generator a whole
build uses, keeping only its slice, so the initial weights are bit for bit those of one process. Checkpoints
are written by every process, each its own slices, and read back the same way on any number of processes
(gptlab.sharded, through torch.distributed.checkpoint); one process on its own reads them whole to sample, export
or resume. DDP's checkpoints hold whole tensors, written by rank 0, and FSDP processes resume from those too.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptlab import checkpoint as ck
from gptlab import rundir
from gptlab.config import ModelConfig
from gptlab.distributed.fsdp import (InitRecorder, initialise_shards, local_part, named_tensors, shard_model,
                                     write_shards)
from gptlab.errors import GptlabError
from gptlab.machine import usable_cores
from gptlab.model import build_model
from gptlab.runtime import resolve_device

log = logging.getLogger("gptlab")


class Parallel:
    """This process's place among `world_size` training processes, and the collectives the loop needs."""

    def __init__(self, device: torch.device, rank: int = 0, world_size: int = 1, local_rank: int = 0):
        self.device, self.rank, self.world_size, self.local_rank = device, rank, world_size, local_rank
        self.ddp: torch.nn.Module | None = None  # the DistributedDataParallel wrapper, once wrapped
        self.sharded: torch.nn.Module | None = None  # the fully_shard-ed model, with FSDP

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs and writes files."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def check_batch(self, batch_size: int) -> None:
        """Raise GptlabError unless batch_size splits evenly across the processes."""
        if batch_size % self.world_size:
            raise GptlabError(f"batch_size {batch_size} does not split across {self.world_size} processes: each "
                              f"micro-step's rows are shared out, so use a multiple of {self.world_size}")

    def check_shared_folder(self, folder: Path) -> None:
        """Raise GptlabError (in every process) unless every process sees the same `folder` as rank 0: rank 0
        writes a random token into it, every process reads it back, and they compare notes. Rank 0 must already
        have created the folder; the token is removed again."""
        if not self.active:
            return
        probe, token = folder / ".gptlab-same-folder", [secrets.token_hex(16)]
        if self.is_main:
            rundir.write_atomic(probe, token[0].encode())
        dist.broadcast_object_list(token, src=0)
        try:
            seen = probe.read_text() == token[0]
        except OSError:
            seen = False
        missing = self.any(not seen)  # also makes rank 0 wait until every process has read the token
        if self.is_main:
            probe.unlink(missing_ok=True)
        if missing:
            raise GptlabError(f"not every process sees the run folder {folder.resolve()} that rank 0 writes "
                              "(node-local storage, or a relative --run from different folders?); put --run on "
                              "storage every machine shares, with the same absolute path")

    def check_same_start(self, resume: bool, step: int | None) -> None:
        """Raise GptlabError (in every process) unless all processes resume, or all start afresh, and from the
        same checkpoint step."""
        if not self.active:
            return
        mine = torch.tensor([float(resume), -1.0 if step is None else float(step)], device=self.device)
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            raise GptlabError("the processes disagree on where to start (resume or not, and from which checkpoint "
                              "step); every machine must see the same --run folder and get the same --resume")

    def build(self, model_cfg: ModelConfig, fsdp: bool = False, init: dict[str, torch.Tensor] | None = None,
              source: str = "") -> torch.nn.Module:
        """The model on this process's device, initialised from the global generator (seeded by the caller), or
        with `init`'s weights (`source` names them in errors). With FSDP across processes it is built on the
        meta device and sharded, and then only this process's slices are made: see initialise_shards."""
        if not (fsdp and self.active):
            model = build_model(model_cfg).to(self.device)
            if init is not None:
                ck.load_model_tensors(model, init, source)
            return model
        with torch.device("meta"), InitRecorder() as recorder:
            model = build_model(model_cfg)
        if init is not None:
            with warnings.catch_warnings():  # copying into meta tensors does nothing: this only checks names
                warnings.filterwarnings("ignore", message=".*meta parameter.*")
                ck.load_model_tensors(model, init, source)
        names = {id(t): name for name, t in named_tensors(model)}
        self.sharded = shard_model(model)
        model.to_empty(device=self.device)
        initialise_shards(model, recorder.calls, names, init or {})
        return model

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             fsdp: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The model wrapped for data parallelism (DDP; with FSDP `build` has sharded it already) and the
        optimizer that steps it."""
        if not self.active:
            if fsdp:
                log.warning("fsdp shards across processes; in a single process it changes nothing")
            return model, optimizer
        if fsdp:
            assert self.sharded is model, "with FSDP, build the model with Parallel.build"
            return model, optimizer
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=ids)
        return self.ddp, optimizer

    def reseed(self, seed: int, step: int) -> None:
        """Give each process its own dropout stream, a function of (seed, step, rank) so a resumed run redraws
        it; a single process keeps the stream its checkpoint restored."""
        if self.active:
            torch.manual_seed(hash((seed, step, self.rank)) & 0x7FFF_FFFF_FFFF_FFFF)

    def local_rows(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This process's share of a global batch: rows [rank * b, (rank + 1) * b), b = rows / world_size."""
        if not self.active:
            return tensors
        return tuple(t.chunk(self.world_size)[self.rank] for t in tensors)

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a micro-step's forward and backward: gradients are averaged across processes only on the last
        micro-step of an optimizer step; the others just accumulate locally."""
        if self.ddp is not None and not last:
            return self.ddp.no_sync()
        if self.sharded is not None:
            self.sharded.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a tensor over all processes (itself in one process); stays on the device, no waiting."""
        if not self.active:
            return value
        total = value.detach().clone()
        dist.all_reduce(total)  # gloo has no AVG: sum, then divide
        return total / self.world_size

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true in any process (all processes must ask together); `flag` itself in one."""
        if not self.active:
            return flag
        value = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to max_norm; returns the norm before clipping as a plain tensor (with
        FSDP, the norm over every shard)."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def held_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[int]]:
        """The bytes of parameters and of optimizer state that each process holds (with FSDP, its slices), one
        entry per rank; all processes must ask together."""
        params = sum(local_part(p).nbytes for p in model.parameters())
        state = sum(local_part(v).nbytes for entry in optimizer.state.values() for v in entry.values()
                    if torch.is_tensor(v))
        mine = torch.tensor([params, state], dtype=torch.int64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        if self.active:
            dist.all_gather(every, mine)
        else:
            every = [mine]
        return {"param_bytes": [int(t[0]) for t in every], "optimizer_bytes": [int(t[1]) for t in every]}

    def shard_writer(self, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer) -> Callable[[Path, bool], dict[str, Any] | None] | None:
        """With FSDP, what rank 0 hands checkpoint.save_checkpoint as `shards`: called with the new checkpoint's
        folder, it tells every other process where it is (they wait in `join_saves`) and all write their slices
        there together; returns the optimizer's JSON part. None without FSDP (rank 0 writes whole tensors)."""
        if self.sharded is None:
            return None

        def write(folder: Path, with_optimizer: bool) -> dict[str, Any] | None:
            dist.broadcast_object_list([str(folder), with_optimizer], src=0)
            return write_shards(folder, model, optimizer if with_optimizer else None)
        return write

    def join_saves(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, count: int) -> None:
        """With FSDP, on every rank but 0: write this process's slices into each of the next `count` checkpoints
        that rank 0 opens (see shard_writer). Nothing without FSDP."""
        for _ in range(count if self.sharded is not None and not self.is_main else 0):
            where = [None, None]
            dist.broadcast_object_list(where, src=0)
            write_shards(Path(where[0]), model, optimizer if where[1] else None)


def setup(device_name: str = "auto") -> Parallel:
    """Join the process group when started by torchrun (WORLD_SIZE > 1): gloo on CPU, NCCL on CUDA, one GPU per
    local rank; the process leaves it when it exits. Otherwise a single process on `device_name`. Raises
    GptlabError for a device that cannot run distributed."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device_name)
    if world_size == 1:
        return Parallel(device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise GptlabError(f"distributed training runs on CPUs (gloo) or CUDA GPUs (NCCL), not {device.type}; "
                          "pass --device cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
        atexit.register(_leave)
    return Parallel(device, rank, world_size, local_rank)


def _leave() -> None:
    """At exit: leave the process group, then wait a moment with the GIL released. Gloo's worker threads may
    still be dropping finished work that holds Python objects (work issued during backward keeps them); that
    needs the GIL, and a thread that asks for it once the interpreter is shutting down aborts the process
    ("terminate called without an active exception": 7 exits in 30 of a 2-process FSDP run on a busy machine
    before this pause, none in 30 after it)."""
    dist.destroy_process_group()
    time.sleep(0.1)


def launched() -> bool:
    """Whether torchrun started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ


def elastic_resume(resume: str | None, run: str | None) -> str | None:
    """The --resume setting for this process: "auto" when torchrun restarted the workers after a failure (they
    continue from the newest checkpoint), else `resume` as given. Raises GptlabError when torchrun may restart
    the workers (--max-restarts > 0) but no --run names the folder every restart must find again."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and not run:
        raise GptlabError("torchrun may restart these processes (--max-restarts), so pass --run: every restart "
                          "must find the same run folder")
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and resume is None:
        return "auto"
    return resume


def launch(nproc: int, argv: list[str], max_restarts: int = 0, extra_env: dict[str, str] | None = None) -> int:
    """Run `gptlab ARGV` as nproc processes on this machine through torchrun (with `extra_env` added to their
    environment); returns its exit code. Each process gets an equal share of the cores unless OMP_NUM_THREADS
    says otherwise."""
    if nproc < 1:
        raise GptlabError(f"--nproc must be at least 1, not {nproc}")
    env = {**os.environ, **(extra_env or {})}
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, usable_cores() // nproc))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--max_restarts={max_restarts}", "-m", "gptlab", "--", *argv]  # "--": torchrun must not read ARGV
    return subprocess.run(command, env=env).returncode
