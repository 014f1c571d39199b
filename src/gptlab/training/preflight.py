"""What training checks before it writes anything: the data against the model, the memory the model and a
micro-batch need, the folder a new run starts in, and everything a resume must satisfy. Each check raises
GptlabError with the numbers that make it fail; none touches the disk."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from gptlab import checkpoint as ck
from gptlab import lora, rundir
from gptlab.config import NATIVE_ENGINES, ModelConfig, TrainConfig, from_dict, to_dict
from gptlab.data.batches import Dataset
from gptlab.errors import GptlabError
from gptlab.tokenizer import load as load_tokenizer


def check_data(dataset: Dataset, model_cfg: ModelConfig) -> None:
    """Refuse data the model cannot learn from, with the numbers that make it so."""
    need = model_cfg.block_size + 1
    if dataset.chat is not None:  # conversations: rows start at a conversation, so each must fit one
        longest = dataset.meta["chat"]["longest"]
        if longest > need:
            raise GptlabError(f"{dataset.path} holds conversations of up to {longest} tokens, more than a row of "
                              f"block_size + 1 = {need}; prepare them with --context {model_cfg.block_size}")
    for split, tokens in (("training", dataset.train), ("validation", dataset.val)):
        if len(tokens) < need and dataset.chat is None:
            raise GptlabError(f"the {split} split of {dataset.path} has {len(tokens)} tokens, fewer than "
                              f"block_size + 1 = {need}; use a longer corpus or a smaller --block-size")
    if model_cfg.vocab_size < dataset.tokenizer.vocab_size:
        raise GptlabError(f"vocab_size {model_cfg.vocab_size} is smaller than the tokenizer's "
                          f"{dataset.tokenizer.vocab_size}; drop the --vocab-size override")


def check_init_weights(cfg: TrainConfig, resume: bool, init: dict[str, torch.Tensor] | None) -> None:
    """Refuse a run that starts from cfg.init_from's weights without them (`init`, which runs.start reads): a new
    run, or a LoRA run even when it resumes (its base is not in its checkpoints)."""
    if cfg.init_from and (not resume or cfg.lora_rank) and init is None:  # a LoRA run needs its base even to resume
        raise GptlabError(f"init_from {cfg.init_from!r} needs its weights: start the run with gptlab.runs.start")


def check_memory(model_cfg: ModelConfig, cfg: TrainConfig, device: torch.device, processes: int,
                 precision: str = "fp32") -> None:
    """Refuse, before allocating anything, what cannot fit the device's memory by a lower bound alone: the
    weights, gradients and AdamW moments (16 bytes a trained parameter, 4 a frozen one, 2 a frozen block matrix in
    a bf16 run), or one micro-batch's logits and their gradient (8 bytes per position and vocabulary entry; with
    --loss-chunk, one chunk's)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    elif device.type == "cpu" and hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        return
    adapters = lora.settings(cfg)  # LoRA: the base frozen (its weights alone), the adapters trained
    params, added = lora.count_parameters(model_cfg, adapters)
    trained, frozen = (added, params) if adapters else (params, 0)
    halved = 12 * model_cfg.n_layer * model_cfg.n_embd ** 2 if adapters and precision == "bf16" else 0
    need = frozen * 4 - halved * 2 + trained * 16  # a trained weight: 4 bytes, its gradient 4, AdamW's moments 8
    gib = f"the {total / 2**30:,.0f} GiB of this {device.type}"
    if need > total:
        raise GptlabError(f"this model has {params:,} parameters: training it needs about {need / 2**30:,.0f} "
                          f"GiB for its weights, gradients and AdamW state, more than {gib}; choose a smaller "
                          "--n-embd or --n-layer" + (", or train LoRA adapters (--lora-rank 8)"
                                                     if cfg.init_from and not adapters else ""))
    rows = max(1, cfg.batch_size // processes)
    positions = rows * model_cfg.block_size
    logits = min(positions, cfg.loss_chunk or positions) * model_cfg.vocab_size * 8
    if logits > total:
        raise GptlabError(f"a micro-batch of {rows:,} x {model_cfg.block_size} positions needs "
                          f"{logits / 2**30:,.0f} GiB for its logits alone, more than {gib}; use a smaller "
                          "--batch-size with a larger --grad-accum (the same tokens per step), or --loss-chunk")


def check_new_run(run: Path) -> None:
    """A new run may start in a new or empty folder, or over a run folder without checkpoints; never over
    checkpoints (even damaged ones), a prepared data folder, or another program's files."""
    kind = rundir.folder_kind(run)
    if kind == "data":
        raise GptlabError(f"{run} is a prepared data folder; training into it would overwrite its tokenizer, so "
                          "choose another --run")
    if kind == "hf":
        raise GptlabError(f"{run} holds a config.json that is not a gptlab run's; choose another --run")
    if any((run / rundir.CKPTS).glob("step-*")) or any((run / rundir.CKPTS).glob("best-*")):
        raise GptlabError(f"run {run} already has checkpoints; pass --resume to continue it or choose a new --run")


def check_engine(cfg: TrainConfig, model_cfg: ModelConfig, world_size: int) -> None:
    """What the C++ engines (reference, fast) cannot train, refused in one line naming the engine chosen, before
    anything is written (config.py refuses the settings they do not implement)."""
    if cfg.engine not in NATIVE_ENGINES:
        return
    if model_cfg.arch != "gpt":
        raise GptlabError(f"the {cfg.engine} engine implements the GPT, not arch {model_cfg.arch}; use --engine torch")
    if world_size > 1:
        raise GptlabError(f"the {cfg.engine} engine trains in one process, not {world_size}; drop --nproc or use "
                          "--engine torch")


def check_checkpointing(cfg: TrainConfig, model_cfg: ModelConfig) -> None:
    """Activation checkpointing recomputes transformer blocks, a chunked loss the LM head's product: refuse them
    for a model without those."""
    if cfg.activation_checkpointing and model_cfg.arch != "gpt":
        raise GptlabError(f"activation checkpointing recomputes transformer blocks, and arch {model_cfg.arch} has "
                          "none; drop --activation-checkpointing")
    if cfg.loss_chunk and model_cfg.arch != "gpt":
        raise GptlabError(f"--loss-chunk recomputes the LM head's logits, and arch {model_cfg.arch} reads its "
                          "logits from a table; drop --loss-chunk")


def check_resume(run: Path, dataset: Dataset, model_cfg: ModelConfig,
                 cfg: TrainConfig) -> tuple[ck.Checkpoint, rundir.TrainingState]:
    """Everything a resume must satisfy, checked before anything is written: a valid checkpoint, the same model
    shape, optimizer and engine, the same data and tokenizer (then check_data), and steps left to train. Returns the
    checkpoint and its state."""
    rundir.read_run_config(run)
    ckpt = ck.find_checkpoint(run, "step")
    if ckpt is None:
        raise GptlabError(f"run {run} has no checkpoint to resume from; drop --resume to start it")
    state = ck.read_state(ckpt)
    saved = from_dict(ModelConfig, state.model).shape()
    if saved != model_cfg.shape():
        diff = ", ".join(f"{k}={saved[k]} (now {v})" for k, v in model_cfg.shape().items() if saved[k] != v)
        raise GptlabError(f"cannot resume {run}: it was trained with {diff}; drop those overrides or use a new --run")
    was = (state.train or {}).get("optimizer", "adamw")  # written before there was a choice: AdamW's
    if was != cfg.optimizer:  # their states differ in kind: AdamW's moments per tensor, Muon's momentum buffers
        raise GptlabError(f"cannot resume {run} with optimizer {cfg.optimizer}: it was trained with {was}, whose "
                          f"state {cfg.optimizer} cannot take over; drop --optimizer, or start a new --run from its "
                          f"weights with --init-from {run} --data {dataset.path}")
    engine = (state.train or {}).get("engine", "torch")  # written before there was a choice: torch's
    if engine != cfg.engine:
        raise GptlabError(f"cannot resume {run} with engine {cfg.engine}: it was trained with engine {engine} (a "
                          f"resume continues on the engine it started with); drop --engine, or start a new --run "
                          f"from its weights with --init-from {run} --data {dataset.path}")
    if state.data_fingerprint != dataset.fingerprint():
        raise GptlabError(f"cannot resume {run}: it was trained on different data than {dataset.path}; "
                          "drop --data (a run resumes on its own data) or start a new --run")
    if dataset.tokenizer.to_dict() != load_tokenizer(run / rundir.TOKENIZER).to_dict():
        raise GptlabError(f"cannot resume {run}: the tokenizer of {dataset.path} is not the run's")
    check_data(dataset, model_cfg)
    if state.step >= cfg.max_steps:
        raise GptlabError(f"run {run} has already trained {state.step} steps and max_steps is {cfg.max_steps}: "
                          f"nothing to do; pass a larger --max-steps to train further")
    return ckpt, state


def settings_changed(state: rundir.TrainingState, model_cfg: ModelConfig, cfg: TrainConfig) -> dict[str, list[Any]]:
    """The settings a resume changes deliberately ({name: [before, now]}): training ones and the model's
    non-shape ones (dropout, attention path)."""
    now = {**to_dict(model_cfg), **to_dict(cfg)}
    before = {**state.model, **(state.train or {})}
    return {k: [v, now[k]] for k, v in before.items() if k in now and now[k] != v}
