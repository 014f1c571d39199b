"""FSDP2 from the inside: building a model whose processes each hold only their slices (initialised exactly as a
whole build would be), writing and reading checkpoints slice by slice, and cutting a process's slice from a whole
tensor. processes.py applies it; sharded.py (beside checkpoint.py) does the file I/O."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gptlab import checkpoint as ck
from gptlab import sharded
from gptlab.errors import GptlabError
from gptlab.model import is_gpt


def load_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    meta: dict[str, Any]) -> None:
    """Load the checkpoint in `folder` (whole tensors, or FSDP shards) into model and optimizer (`meta`: the
    optimizer's JSON part). A whole model reads everything; an FSDP-sharded one reads only its own slices of a
    sharded checkpoint, and cuts them from a whole one. Raises GptlabError when the tensors do not fit."""
    if not any(is_dtensor(p) for p in model.parameters()):
        ck.load_model_tensors(model, ck.read_tensors(folder, "model"), str(folder))
        ck.restore_optimizer(optimizer, ck.read_tensors(folder, "optimizer"), meta)
        return
    whole = None
    if (folder / ck.SHARDS).is_dir():
        listing = sharded.stored_shapes(folder / ck.SHARDS)
    else:
        whole = {f"{part}.{name}": t for part in ("model", "optimizer")
                 for name, t in ck.load_tensors(folder / f"{part}.safetensors").items()}
        listing = {name: (t.shape, t.dtype) for name, t in whole.items()}
    targets = shard_targets(model, optimizer, listing, str(folder))
    if whole is None:
        sharded.read_into(folder / ck.SHARDS, targets)
    else:
        for name, target in targets.items():
            copy_slice(target, whole[name])
    moments = {name.removeprefix("optimizer."): t for name, t in targets.items() if name.startswith("optimizer.")}
    ck.restore_optimizer(optimizer, moments, meta)


def shard_targets(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   listing: dict[str, tuple[torch.Size, torch.dtype]], source: str) -> dict[str, torch.Tensor]:
    """Where each tensor of a checkpoint (`listing`: name -> whole shape and dtype) goes in a sharded model and
    optimizer: the parameters themselves, and new tensors sharded like their parameter for the optimizer's
    moments (plain ones for its step counts)."""
    targets = {f"model.{name}": p for name, p in named_tensors(model)}
    wrong = sorted(n for n, t in targets.items() if n not in listing or listing[n][0] != t.shape)
    if wrong:
        raise GptlabError(f"the weights in {source} do not fit the model described by its config ({wrong[0]})")
    order = [p for group in optimizer.param_groups for p in group["params"]]
    for name, (shape, dtype) in listing.items():
        if name.startswith("optimizer."):
            p = order[int(name.split(".")[1])]
            targets[name] = torch.zeros_like(p) if shape == p.shape else torch.zeros(shape, dtype=dtype)
    return targets


def write_shards(folder: Path, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    """Every process together: write model and optimizer (when given) into `folder`, each process its own
    slices, named as in a whole checkpoint; returns the optimizer's JSON part (or None)."""
    tensors = {f"model.{name}": p.detach() for name, p in named_tensors(model)}
    meta = None
    if optimizer is not None:
        moments, meta = ck.optimizer_tensors(optimizer)
        tensors.update({f"optimizer.{name}": t for name, t in moments.items()})
    sharded.write(folder, tensors)
    return meta


class InitRecorder(TorchFunctionMode):
    """While a model is built on the meta device (where nothing is drawn), notes in order every initialiser
    applied to its tensors: torch.nn.init's functions and Tensor.normal_ / uniform_ / fill_ / zero_, each of
    which overwrites the whole tensor, so replaying them in order reproduces the build."""

    OVERWRITING = {"normal_", "uniform_", "fill_", "zero_"}

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[Callable, torch.Tensor, tuple, dict]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        name = getattr(func, "__name__", "")
        if isinstance(target, torch.Tensor) and target.is_meta and name.endswith("_") and not name.startswith("__"):
            assert getattr(func, "__module__", None) == "torch.nn.init" or name in self.OVERWRITING, \
                f"sharded initialisation cannot replay {name}, which does not overwrite the whole tensor"
            self.calls.append((func, target, args[1:], {k: v for k, v in kwargs.items() if k != "tensor"}))
        return func(*args, **kwargs)


def initialise_shards(model: torch.nn.Module, calls: list[tuple[Callable, torch.Tensor, tuple, dict]],
                       names: dict[int, str], init: dict[str, torch.Tensor]) -> None:
    """Give the sharded, materialised (uninitialised) `model` its initial values: each recorded initialiser is
    run again, in order, on a whole tensor on the CPU, so the global generator draws exactly what a whole build
    draws; this process keeps its slice of each tensor's final value (or of init's, for the names it has). One
    whole tensor at a time is ever in memory."""
    tensors = dict(named_tensors(model))
    last = {id(target): i for i, (_, target, _, _) in enumerate(calls)}
    with torch.no_grad():
        for i, (func, target, args, kwargs) in enumerate(calls):
            whole = torch.empty(target.shape, dtype=target.dtype)
            func(whole, *args, **kwargs)
            name = names.get(id(target))
            if name is not None and last[id(target)] == i and name not in init:
                copy_slice(tensors[name], whole)
        for name, tensor in init.items():
            if name in tensors:
                copy_slice(tensors[name], tensor)
    assert all(key in last or name in init for key, name in names.items()), "a tensor was never initialised"


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (a tied one once) and buffers, by their names in a whole checkpoint."""
    named = [*model.named_parameters(), *model.named_buffers()]
    for prefix in ck.WRAPPER_PREFIXES:
        named = [(name.removeprefix(prefix), t) for name, t in named]
    return named


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: each transformer block is one unit of all-gather / reduce-scatter, the root (embeddings, the tied
    LM head, the final LayerNorm) another."""
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h if is_gpt(model) else []:
        fully_shard(block)
    fully_shard(model)
    return model


def is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this process holds: its slice of a DTensor, else all of it."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def copy_slice(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy into `target` its part of `whole`: this process's slice when `target` is a DTensor, else all."""
    if is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor

        whole = distribute_tensor(whole.to(target.device), target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()  # no communication: each cuts its own slice
    with torch.no_grad():
        local_part(target).copy_(whole)
