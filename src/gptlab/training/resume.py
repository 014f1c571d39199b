"""Picking a run up where a checkpoint left it: the progress a checkpoint carries (`Progress`), a checkpoint loaded
back into the model, the optimizer and the random generators (`resume_state`), and the metrics log cut back to its
step (`keep_metrics_until`), so that a resumed run reads as one run."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab import checkpoint as ck
from gptlab import rundir
from gptlab.distributed.fsdp import load_checkpoint
from gptlab.plots import read_metrics


@dataclass
class Progress:
    """Everything about where training stands that a checkpoint must carry to resume exactly."""

    step: int = 0
    tokens_seen: int = 0
    best_val_loss: float = math.inf


def resume_state(ckpt: ck.Checkpoint, state: rundir.TrainingState, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, progress: Progress) -> None:
    """Load a checkpoint (already checked by check_resume) into model, optimizer and the random generators, and
    set `progress` to where training stands."""
    load_checkpoint(ckpt.path, model, optimizer, state.optimizer)  # whole or sharded, either way
    ck.restore_rng(ck.load_tensors(ckpt.path / "rng.safetensors"))
    progress.step, progress.tokens_seen = state.step, state.tokens_seen or 0
    progress.best_val_loss = math.inf if state.best_val_loss is None else state.best_val_loss


def keep_metrics_until(path: Path, step: int) -> None:
    """After a resume, drop what a crashed run logged past its checkpoint, so the log reads as one run."""
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    rundir.write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows).encode())
