"""Sharded checkpoints: with FSDP, every process writes its own slices of the tensors, and any number of
processes, or one process on its own, reads them back.

torch.distributed.checkpoint (DCP) does the planning (who writes which slice, who reads which) through its
safetensors storage (the Hugging Face layout): process r writes `shard-0000{r+1}-model-00001-of-00001.safetensors`,
and each file's header holds the offsets of its slices in the whole tensors, so there is no separate (pickled)
metadata file and nothing here is pickled. The tensors are named as in a whole checkpoint, with the file's name
in front: `model.transformer.h.0.attn.c_attn.weight`, `optimizer.0.exp_avg`. checkpoint.py keeps the atomic
folder scheme around this: the shards sit in the checkpoint folder's `shards/`, listed in its manifest.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter


def write(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every process together: write `tensors` (DTensors: each process its own slices; plain tensors: the same
    in every process, written once) into `folder`."""
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=dist.is_initialized()))


def read_into(folder: Path, targets: dict[str, torch.Tensor]) -> None:
    """Fill `targets` in place from the shards in `folder`, whatever number of processes wrote them: a DTensor
    gets this process's slices only, a plain tensor the whole of it. Every process together, or one without a
    process group."""
    with warnings.catch_warnings():  # one process without a group: DCP warns that it assumes exactly that
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(folder)))


def stored_shapes(folder: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The whole shape and dtype of every tensor in the shards in `folder` (read from the files' headers)."""
    metadata = HuggingFaceStorageReader(str(folder)).read_metadata()
    return {name: (m.size, m.properties.dtype) for name, m in metadata.state_dict_metadata.items()}


def read_whole(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors in `folder` whose names start with `prefix`, whole, by name without it: what one process (no
    process group needed) uses to sample, export or resume from a sharded checkpoint."""
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in stored_shapes(folder).items()
               if name.startswith(prefix)}
    read_into(folder, tensors)
    return {name.removeprefix(prefix): t for name, t in tensors.items()}
