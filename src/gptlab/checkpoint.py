"""Run directories and checkpoints, written so that a crash can never leave a half-written checkpoint in use.

A run directory holds config.json (resolved settings), tokenizer.json, metrics.jsonl, loss.png and
checkpoints/. Each checkpoint is a folder: model.safetensors, optimizer.safetensors (or, written by FSDP
processes, shards/ with each one's slices of both: sharded.py), rng.safetensors, state.json (rundir.TrainingState),
and manifest.json with every file's sha256. It is written as a hidden temp folder, each file fsynced, the manifest
last, then renamed into place in one step; old checkpoints are deleted only after the new one is committed. Loaders
accept only a checkpoint whose files match its manifest and fall back to the previous valid one. Nothing is
pickled: tensors go to safetensors, everything else to JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gptlab import chat, lora
from gptlab.config import ModelConfig, from_dict
from gptlab.errors import GptlabError
from gptlab.rundir import (CKPTS, TOKENIZER, RunLock, TrainingState, fsync_dir, read_run_config, umask_mode,
                           write_json)
from gptlab.model import build_model
from gptlab.tokenizer import Tokenizer, load as load_tokenizer

log = logging.getLogger("gptlab")
MANIFEST = "manifest.json"
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DDP wrap the model and prefix its names
SHARDS = "shards"  # an FSDP checkpoint's model and optimizer: every process's slices (see sharded.py)
_WriteShards = Callable[[Path, bool], dict[str, Any] | None]  # (its folder, with_optimizer) -> the optimizer's JSON


def sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


# ---- state <-> tensors -----------------------------------------------------------------------------------------

def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights by GPT-2 name, without wrapper prefixes and with the tied LM head stored once; of a model
    with LoRA adapters, the adapters alone (its base is stored once, in its own run)."""
    state = {}
    for name, tensor in model.state_dict().items():
        for prefix in WRAPPER_PREFIXES:
            name = name.removeprefix(prefix)
        state[name] = tensor.detach().contiguous()
    if any(lora.is_adapter(name) for name in state):
        return {name: t for name, t in state.items() if lora.is_adapter(name)}
    wte = state.get("transformer.wte.weight")
    if wte is not None and "lm_head.weight" in state and state["lm_head.weight"].data_ptr() == wte.data_ptr():
        del state["lm_head.weight"]
    return state


def load_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy `tensors` into `model`, insisting that names and shapes match exactly (the tied head may be absent); a
    model with LoRA adapters takes its adapters alone."""
    own = model.state_dict()
    if any(lora.is_adapter(name) for name in own):
        own = {name: t for name, t in own.items() if lora.is_adapter(name)}
    missing = sorted(set(own) - set(tensors) - {"lm_head.weight"})
    unexpected = sorted(set(tensors) - set(own))
    wrong = [f"{k} {tuple(tensors[k].shape)} vs {tuple(own[k].shape)}" for k in own
             if k in tensors and tensors[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        detail = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected
                  else f"shape mismatch {wrong[0]}")
        raise GptlabError(f"the weights in {source} do not fit the model described by its config ({detail})")
    model.load_state_dict(tensors, strict=False)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's state split into tensors (for safetensors) and JSON-safe metadata."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, entry in sd["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().contiguous()
            else:
                scalars[f"{pid}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                      meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in list(tensors.items()) + list(meta["scalars"].items()):
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def rng_tensors() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda_{i}"] = s
    return state


def restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


# ---- checkpoints ------------------------------------------------------------------------------------------------

@dataclass
class Checkpoint:
    path: Path
    kind: str  # "step" (the last ones, for resuming) or "best" (lowest validation loss, weights only)
    step: int


def list_checkpoints(run_dir: Path, kind: str) -> list[Checkpoint]:
    found = []
    for p in (run_dir / CKPTS).glob(f"{kind}-*"):
        if not p.is_dir():  # a stray file named like one (verifying it would raise NotADirectoryError)
            continue
        try:
            found.append(Checkpoint(p, kind, int(p.name.split("-", 1)[1])))
        except ValueError:
            continue
    return sorted(found, key=lambda c: c.step, reverse=True)


def verify(path: Path) -> str | None:
    """None when every file of the checkpoint at `path` matches its manifest, else what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (it was never finished)"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "damaged manifest"
    for name, want in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != want["bytes"]:
            return f"{name} is truncated ({file.stat().st_size} of {want['bytes']} bytes)"
        if sha256_file(file) != want["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def find_checkpoint(run_dir: str | Path, kind: str = "step") -> Checkpoint | None:
    """The newest checkpoint of `kind` that passes verification; skipped damaged ones are logged as warnings."""
    found = list_checkpoints(Path(run_dir), kind)
    for i, ckpt in enumerate(found):
        problem = verify_cached(ckpt.path)
        if problem is None:
            return ckpt
        log.warning("checkpoint %s is unusable (%s); %s", ckpt.path, problem,
                    "falling back to an older one" if i + 1 < len(found) else f"no older {kind} checkpoint is left")
    return None


_VERIFIED: dict[tuple, str | None] = {}


def verify_cached(path: Path) -> str | None:
    """verify(path), remembered while no file of the checkpoint changes (same inodes, sizes and modification
    times), so that pruning after every save does not hash every kept checkpoint again."""
    try:
        key = (str(path), *sorted((str(f), st.st_ino, st.st_size, st.st_mtime_ns)  # shards/ too, file by file
                                  for f in path.rglob("*") for st in [f.stat()]))
    except OSError:
        return verify(path)
    if key not in _VERIFIED:
        _VERIFIED[key] = verify(path)
    return _VERIFIED[key]


def save_checkpoint(run_dir: str | Path, kind: str, step: int, model: torch.nn.Module, state: TrainingState,
                    optimizer: torch.optim.Optimizer | None = None, keep: int = 2,
                    extra_files: dict[str, bytes] | None = None, shards: _WriteShards | None = None) -> Path:
    """Write a checkpoint atomically (with `extra_files`, e.g. the tokenizer, inside it) and then prune all but
    the newest `keep` of its kind; its state.json is `state` with the step, the time and (with `optimizer`) the
    optimizer's JSON part stamped in. Returns its path; raises GptlabError when the disk refuses the write. With
    `shards` (FSDP, see distributed/processes.py), every process writes its own slices of model and optimizer into
    the checkpoint's shards/ through shards(folder, with_optimizer), which returns the optimizer's JSON part."""
    ckpts = Path(run_dir) / CKPTS
    final = ckpts / f"{kind}-{step:08d}"
    tmp = ckpts / f".tmp-{kind}-{step:08d}-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        files = {}
        if shards is not None:  # FSDP: every process writes its own slices
            optimizer_meta = shards(tmp / SHARDS, optimizer is not None)
        else:
            files["model.safetensors"] = model_tensors(model)
            if optimizer is not None:
                files["optimizer.safetensors"], optimizer_meta = optimizer_tensors(optimizer)
        files["rng.safetensors"] = rng_tensors()
        for name, tensors in files.items():
            save_file(tensors, tmp / name)
        dataclasses.replace(state, step=step, time=time.time(),
                            optimizer=optimizer_meta if optimizer is not None else state.optimizer).write(tmp)
        for name, blob in (extra_files or {}).items():
            (tmp / name).write_bytes(blob)
        manifest, mode = {"step": step, "kind": kind, "files": {}}, umask_mode()
        for file in sorted(f for f in tmp.rglob("*") if f.is_file()):
            os.chmod(file, mode)  # safetensors writes its files 0600 whatever the umask
            with open(file, "rb+") as f:
                os.fsync(f.fileno())
            manifest["files"][file.relative_to(tmp).as_posix()] = {"bytes": file.stat().st_size,
                                                                   "sha256": sha256_file(file)}
        write_json(tmp / MANIFEST, manifest)
        for folder in (tmp / SHARDS, tmp):
            if folder.is_dir():
                fsync_dir(folder)
        if final.exists():
            _discard(final)
        os.replace(tmp, final)
        fsync_dir(ckpts)
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip()
        raise GptlabError(f"cannot write a checkpoint in {ckpts}: {reason}; free some space or fix the "
                          "permissions (the previous checkpoint is intact)") from None
    prune(Path(run_dir), kind, keep, final)
    return final


def prune(run_dir: Path, kind: str, keep: int, newest: Path) -> None:
    """Keep the newest `keep` valid checkpoints of `kind` (`newest`, just written, is one) and delete those
    older than them. Damaged ones never count: after a resume that fell back past a damaged checkpoint, the
    valid one it fell back to is kept."""
    valid = 0
    for ckpt in list_checkpoints(run_dir, kind):
        if valid >= keep:
            _discard(ckpt.path)
        elif ckpt.path == newest or verify_cached(ckpt.path) is None:
            valid += 1


def clean_stale(run_dir: str | Path) -> None:
    """Remove temp and half-deleted checkpoint folders left by a process that was killed (never a real one)."""
    for leftover in list((Path(run_dir) / CKPTS).glob(".tmp-*")) + list((Path(run_dir) / CKPTS).glob(".trash-*")):
        shutil.rmtree(leftover, ignore_errors=True)


def _discard(path: Path) -> None:
    """Delete a checkpoint folder: rename it out of sight first, so no one ever reads a half-deleted one."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def read_state(ckpt: Checkpoint) -> TrainingState:
    """The checkpoint's state.json (see rundir.TrainingState); GptlabError when it is damaged."""
    return TrainingState.read(ckpt.path)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        raise GptlabError(f"{path} cannot be read ({exc}); the checkpoint is damaged") from None


def read_tensors(path: Path, part: str) -> dict[str, torch.Tensor]:
    """A checkpoint's "model" or "optimizer" tensors, whole: from its safetensors file, or (a checkpoint of FSDP
    processes) gathered in this one process from the shards they wrote."""
    if (path / SHARDS).is_dir():
        from gptlab import sharded

        return sharded.read_whole(path / SHARDS, part + ".")
    return load_tensors(path / f"{part}.safetensors")


# ---- loading a trained model -----------------------------------------------------------------------------------

@dataclass
class LoadedRun:
    model: torch.nn.Module
    tokenizer: Tokenizer
    model_cfg: ModelConfig
    state: TrainingState
    checkpoint: Checkpoint


def load_run(run_dir: str | Path, which: str = "best", device: torch.device | str = "cpu",
             merge: bool = True) -> LoadedRun:
    """The model of a run (its best checkpoint, else its latest) in eval mode, with its tokenizer; safe while the
    run is being trained (a checkpoint pruned while it is read is replaced by the newer one). A LoRA run's model is
    its base with the adapters merged in (with `merge` False: adapted, the adapters apart).
    Raises GptlabError when the run is missing, not a run, has no usable checkpoint, or its parts do not fit."""
    read_run_config(run_dir)
    for attempt in range(3):
        ckpt = (find_checkpoint(run_dir, "best") if which == "best" else None) or find_checkpoint(run_dir, "step")
        if ckpt is None:
            found = list_checkpoints(Path(run_dir), "step") + list_checkpoints(Path(run_dir), "best")
            if found:
                raise GptlabError(f"run {run_dir} has no usable checkpoint: the newest, {found[0].path.name}, is "
                                  f"damaged ({verify(found[0].path)})")
            if RunLock.held(run_dir):
                raise GptlabError(f"run {run_dir} is being trained and has no checkpoint yet; wait for its first "
                                  "evaluation (one every --eval-interval steps) or pass --run")
            raise GptlabError(f"run {run_dir} has no checkpoint yet; train it with `gptlab train --run {run_dir}`")
        try:
            return _load_checkpoint(Path(run_dir), ckpt, device, merge)
        except (GptlabError, FileNotFoundError):
            if ckpt.path.exists() or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _load_checkpoint(run_dir: Path, ckpt: Checkpoint, device: torch.device | str, merge: bool) -> LoadedRun:
    state = read_state(ckpt)
    model_cfg = from_dict(ModelConfig, state.model)
    run_tokenizer = run_dir / TOKENIZER
    if (ckpt.path / TOKENIZER).is_file() and (ckpt.path / TOKENIZER).read_bytes() != run_tokenizer.read_bytes():
        raise GptlabError(f"{run_tokenizer} is not the tokenizer the weights in {ckpt.path} were trained with; "
                          f"restore it from {ckpt.path / TOKENIZER}")
    tokenizer = load_tokenizer(run_tokenizer)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise GptlabError(f"the tokenizer of {run_dir} has {tokenizer.vocab_size} tokens but the weights only "
                          f"{model_cfg.vocab_size}: they do not belong together")
    model = build_model(model_cfg)
    adapters = lora.settings(state.train)
    tensors = read_tensors(ckpt.path, "model")
    if adapters is not None:
        load_model_tensors(model, base_tensors(run_dir, state, model_cfg), str(ckpt.path))
        tokens = tensors.get("transformer.wte.token_ids")  # the rows of added tokens, trained whole
        lora.apply_lora(model, adapters, None if tokens is None else tokens.tolist())
    load_model_tensors(model, tensors, str(ckpt.path))
    if adapters is not None and merge:
        lora.merge_lora(model)
    return LoadedRun(model.to(device).eval(), tokenizer, model_cfg, state, ckpt)


def base_tensors(run_dir: Path, state: TrainingState, model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights a LoRA run's adapters were trained on: its base run's, cut to the run's block_size, checked
    against the sha256 the run recorded. GptlabError when the base is gone, moved or has changed."""
    base = state.base or {}
    if not base.get("run") or not base.get("sha256"):
        raise GptlabError(f"{run_dir} holds LoRA adapters but does not name its base run; the checkpoint is damaged")
    if not Path(base["run"]).is_dir():
        raise GptlabError(f"the base of LoRA run {run_dir}, {base['run']}, is gone (moved or deleted); put it back "
                          "there to use the adapters")
    loaded = load_run(base["run"])
    tensors = crop_positions(model_tensors(loaded.model), model_cfg.block_size)
    if chat.rows_added(loaded.tokenizer, load_tokenizer(run_dir / TOKENIZER)):
        tensors = chat.grow_vocab(tensors, loaded.tokenizer.vocab_size, model_cfg.vocab_size)
    if lora.tensors_sha256(tensors) != base["sha256"]:
        raise GptlabError(f"the base of LoRA run {run_dir}, {base['run']}, has changed since the adapters were "
                          "trained on it (its weights' sha256 differs); restore its checkpoint or fine-tune again")
    return tensors


def crop_positions(tensors: dict[str, torch.Tensor], block_size: int) -> dict[str, torch.Tensor]:
    """`tensors` (a model's, by name) with the position embeddings cut to the first `block_size`, as a model
    fine-tuned at a shorter context keeps them (a bigram has none); in place, returned."""
    if "transformer.wpe.weight" in tensors:
        tensors["transformer.wpe.weight"] = tensors["transformer.wpe.weight"][:block_size].clone()
    return tensors

