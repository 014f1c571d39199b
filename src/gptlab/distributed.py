"""Data-parallel training across processes; the only module that imports torch.distributed.

torchrun starts the processes and tells each its RANK, LOCAL_RANK and WORLD_SIZE; `setup` joins them into one
group (gloo on CPUs, NCCL on CUDA GPUs) and `Parallel` is everything the training loop asks of it. In a single
process (no torchrun), every method is a cheap no-op, so the loop has one code path.

The global batch does not depend on the number of processes N: each optimizer step sees batch_size x grad_accum
sequences, the same ones as a single process would. Each micro-step's batch_size rows are drawn from
(seed, step, micro-step) and split by rows: process r trains on rows [r * b, (r + 1) * b), b = batch_size / N, so
batch_size must be a multiple of N. Gradients are averaged across processes on the last micro-step only
(`no_sync` on the others), which makes N processes compute the same mean gradient as one.

Parallelism is applied to the model from outside: DDP (a full copy per process, gradients all-reduced) by
default, or FSDP2 (`fully_shard`: parameters, gradients and optimizer state sharded, for models that do not fit
one device). Checkpoints always hold full, unsharded tensors, written by rank 0, so they load on any number of
processes, or in `gptlab sample`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from gptlab.errors import GptlabError
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

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             fsdp: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The model wrapped for data parallelism (DDP, or FSDP2 with `fsdp`) and the optimizer that steps it
        (with FSDP, the same one, moved onto the sharded parameters)."""
        if not self.active:
            if fsdp:
                log.warning("fsdp shards across processes; in a single process it changes nothing")
            return model, optimizer
        if fsdp:
            return self._shard(model, optimizer)
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=ids)
        return self.ddp, optimizer

    def _shard(self, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """FSDP2: each transformer block is one unit of all-gather / reduce-scatter, the root (embeddings, the
        tied LM head, the final LayerNorm) another. fully_shard replaces the parameters, so the optimizer is
        pointed at the new ones and any state it holds (from a resumed checkpoint) is cut into the same shards."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import distribute_tensor

        names = {id(p): name for name, p in model.named_parameters()}
        for block in getattr(getattr(model, "transformer", None), "h", []):
            fully_shard(block)
        fully_shard(model)
        new = dict(model.named_parameters())
        state = {}
        for old, entry in optimizer.state.items():
            p = new[names[id(old)]]
            state[p] = {k: distribute_tensor(v.to(self.device), p.device_mesh, p.placements)
                        if torch.is_tensor(v) and v.shape == old.shape else v for k, v in entry.items()}
        for group in optimizer.param_groups:
            group["params"] = [new[names[id(p)]] for p in group["params"]]
        optimizer.state.clear()
        optimizer.state.update(state)
        self.sharded = model
        return model, optimizer

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

    def full_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[object, object]:
        """The model and optimizer as checkpoint.py saves them (objects with a state_dict()), holding full
        tensors. With FSDP every process must call this (the shards are gathered together); otherwise rank 0's
        copies are complete already and are returned as they are."""
        if self.sharded is None:
            return model, optimizer
        gathered: dict[int, torch.Tensor] = {}

        def full(tensor: object) -> object:
            if not hasattr(tensor, "full_tensor"):
                return tensor
            key = tensor.to_local().data_ptr()  # tied weights share storage: gather (and store) them once
            if key not in gathered:
                gathered[key] = tensor.full_tensor().cpu()
            return gathered[key]

        weights = {name: full(t) for name, t in self.sharded.state_dict().items()}
        sd = optimizer.state_dict()
        moments = {pid: {k: full(v) for k, v in entry.items()} for pid, entry in sd["state"].items()}
        return _Saved(weights), _Saved({**sd, "state": moments})



class _Saved:
    """A gathered state dict, handed to checkpoint.py where a module or an optimizer is expected."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


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
        atexit.register(dist.destroy_process_group)
    return Parallel(device, rank, world_size, local_rank)


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


def launch(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run `gptlab ARGV` as nproc processes on this machine through torchrun; returns its exit code. Each
    process gets an equal share of the cores unless OMP_NUM_THREADS says otherwise."""
    if nproc < 1:
        raise GptlabError(f"--nproc must be at least 1, not {nproc}")
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--max_restarts={max_restarts}", "-m", "gptlab", "--", *argv]  # "--": torchrun must not read ARGV
    return subprocess.run(command, env=env).returncode
