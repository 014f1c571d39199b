"""What a training step holds in memory, for `gptlab bench train --activation-checkpointing`: the bytes one forward
keeps for backward, and the peak memory of one step above its level once the model and the optimizer's state
exist, each variant measured in a fresh process so that no variant's peak hides another's."""

from __future__ import annotations

import ctypes
import re
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from gptlab.config import ModelConfig, TrainConfig


def saved_bytes(model: torch.nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct storages that `forward()` (a training forward of `model`) keeps for backward: every
    tensor autograd saves, parameters left out (activation checkpointing saves each block's input this way too)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def note(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()  # the tensor itself would tie a saved output to its own graph node: never freed

    with torch.autograd.graph.saved_tensors_hooks(note, lambda tensor: tensor):
        result = forward()
    del result  # every storage noted was alive until now (held by the graph), so no address was noted twice
    return sum(kept.values())


def measure_in_fresh_process(build: Callable[..., Any], variant: Any, model_cfg: ModelConfig, cfg: TrainConfig,
                             data_dir: Path) -> dict[str, int]:
    """step_memory(...) run in a new Python process (spawned: nothing of this one's memory is shared)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(step_memory, build, variant, model_cfg, cfg, data_dir).result()


def step_memory(build: Callable[..., Any], variant: Any, model_cfg: ModelConfig, cfg: TrainConfig,
                data_dir: Path) -> dict[str, int]:
    """The memory of one training step of `variant` (a bench.train_speed.Variant), built by `build`
    (bench.train_speed's build_contender, passed in: that module imports this one, so neither type can be named
    here) as `gptlab bench train` builds it: {"saved": saved_bytes of one forward, "base": the memory held once the
    model and the optimizer's state exist, "step": the peak of one training step above base, "weights": the
    parameters' bytes, "trained": the bytes of the trained parameters' gradients and AdamW moments}. On a CPU
    memory is the process's resident set (freed blocks of 1 MiB and more go back to the system at once, so the peak
    is the step's own), on CUDA torch's allocated bytes. Meant for a fresh process: the resident peak is the
    process's."""
    from gptlab.data.batches import batch_generator, load_dataset
    from gptlab.runtime import resolve_device, set_threads
    from gptlab.training.step import train_step

    set_threads()
    _return_freed_memory()
    device = resolve_device(cfg.device)
    c = build(variant, model_cfg, cfg, load_dataset(data_dir), device)
    x, y = c.ctx.batch("train", batch_generator(cfg.seed, 0))
    with c.running(device):
        saved = saved_bytes(c.eager, lambda: c.ctx.loss(c.model, x, y))
    _allocate_optimizer_state(c.eager, c.optimizer)
    base = _memory(device)
    _reset_peak(device)
    with c.running(device):
        train_step(c.model, c.optimizer, c.ctx, 0)
    trained = [p for p in c.eager.parameters() if p.requires_grad]
    return {"saved": saved, "base": base, "step": max(0, _peak(device) - base),
            "weights": sum(p.numel() * p.element_size() for p in c.eager.parameters()),
            "trained": sum(p.numel() * p.element_size() * 3 for p in trained)}  # its gradient and AdamW's 2 moments


def _allocate_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer allocate its state (lazily made at its first step): one step of zero gradients at
    learning rate 0, after which the gradients are dropped again."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in model.parameters():
        if p.requires_grad:  # a frozen weight (LoRA's base) has no gradient and no optimizer state
            p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def _return_freed_memory() -> None:
    """glibc: serve every block of 1 MiB or more by its own mapping, returned to the system when freed (the
    opposite of runtime.reuse_freed_memory), so that the resident set follows the memory in use."""
    if sys.platform.startswith("linux"):
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            return
        M_MMAP_THRESHOLD = -3  # glibc's malloc.h; setting it also stops glibc from raising it as blocks are freed
        mallopt(M_MMAP_THRESHOLD, 1 << 20)


def _status(field: str) -> int:
    """A size from /proc/self/status in bytes (Linux); 0 where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            found = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return 0
    return int(found.group(1)) * 1024 if found else 0


def _memory(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else _status("VmRSS")


def _reset_peak(device: torch.device) -> None:
    """Start the peak afresh from the memory held now (on Linux, writing 5 to clear_refs resets VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _status("VmHWM")
