"""Making a model fast to generate with, and a run loaded ready: `prepare_for_inference(model, precision)` returns
an `InferenceModel` (gptlab.inference.prepared): the model in eval mode, its weights in fp32, bf16 or int8, packed for
oneDNN where it can run them, with the fused native step as its decoder where the CPU and a compiler allow it;
`load_for_inference(run, device, precision)` loads a run's checkpoint and does that (sample, eval, serve)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from gptlab import config
from gptlab.errors import GptlabError
from gptlab.inference.fused import fused_decoder
from gptlab.inference.int8 import BF16_ROWS, quantize_model
from gptlab.inference.prepared import InferenceModel, TorchStep, as_inference, cache_dtype
from gptlab.inference.weights import move_to_huge_pages, pack_linears
from gptlab.runtime import bf16_supported, resolve_device, resolve_precision

if TYPE_CHECKING:
    from gptlab.checkpoint import Checkpoint
    from gptlab.tokenizer import Tokenizer

log = logging.getLogger("gptlab")
FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the float precisions -> their torch dtype


def bf16_storage_possible(device: torch.device) -> bool:
    """Whether inference on `device` may keep its weights in bf16 without native bf16 products: on a CPU where the
    native decode step can be built (a compiler: gptlab.inference.native.missing), which widens bf16 weights to
    fp32 in registers on any CPU (the bytes read, what decoding waits for, are halved); prompts multiply through fp32
    packed copies of the weights there (gptlab.inference.weights.pack_linears), eval's forward in bf16 through
    torch, correct but slower than fp32 on such a CPU."""
    from gptlab.inference import native

    return device.type == "cpu" and native.missing() is None


@torch.no_grad()
def prepare_for_inference(model: nn.Module, precision: str = "fp32", fused: bool = True,
                          huge_pages: bool = True) -> InferenceModel:
    """Make `model` fast to generate with and return it as an InferenceModel. `model` is changed in place, for
    inference only (no training, no checkpoint): eval mode, weights in `precision` ("fp32", the reference,
    "bf16", or "int8": every matrix, the LM head included, weight-only int8 with per-row scales over fp32
    activations, gptlab.inference.int8), dropout removed, each float nn.Linear replaced by an InferenceLinear
    where oneDNN supports it. Its decoder is the fused native step (gptlab.inference.fused) where the CPU and a
    compiler allow it and `fused` is true (the weights moved into 2 MB pages first unless `huge_pages` is false),
    else the torch step. Raises GptlabError for an unknown precision or bf16 on a device without it."""
    config.check_prepared(precision)
    dtype = FLOAT_DTYPES.get(precision, torch.float32)  # int8's activations and vectors are fp32
    device = next(model.parameters()).device
    if dtype == torch.bfloat16 and device.type == "cpu" and not bf16_supported(device) and not (
            fused and bf16_storage_possible(device)):
        raise GptlabError("this CPU has no native bf16 support and no g++ for the native decode step that stores "
                          "bf16 on any CPU; use --precision fp32")
    model.eval().to(dtype)
    if precision == "int8":  # prompts multiply in bf16 where the CPU computes it natively (int8.BF16_ROWS)
        quantize_model(model, BF16_ROWS if bf16_supported(device) else None)
    # the fused step decodes from the plain weights (it holds them); prompts and window rebuilds, many rows at a
    # time, go through the packed copies: faster prefills (docs/benchmarks.md), for twice the weights' memory
    if fused and huge_pages:
        move_to_huge_pages(model)  # before the decoder takes its pointers
    native = fused_decoder(model, huge_pages) if fused else None
    pack_linears(model)
    decoder = native if native is not None else TorchStep(model)
    if precision == "int8" and native is None and fused:
        log.warning("int8 without the fused decode step (it needs g++): the torch "
                    "path widens every weight at every step, slower than fp32; it is the reference")
    kept = cache_dtype(device, dtype, native is not None, precision == "int8")
    # a bf16 model's prompts attend over its bf16 cache in bf16 where the CPU multiplies bf16 natively (faster
    # than fp32 copies of the keys and values: `gptlab bench serve --scenario shared-prefix`), else in fp32
    attend = torch.bfloat16 if device.type == "cpu" and kept == dtype == torch.bfloat16 and bf16_supported(device) \
        else None
    return InferenceModel(model, decoder, kept, precision, attend)


@dataclass(frozen=True)
class InferenceRun:
    """A run loaded for inference (`load_for_inference`): its model made ready, its tokenizer, the checkpoint the
    weights came from, the precision they are in, and the model's parameter count (before any packing)."""

    model: InferenceModel
    tokenizer: Tokenizer
    checkpoint: Checkpoint
    precision: str  # "fp32", "bf16" or "int8": "auto" resolved
    parameters: int


def load_for_inference(run: str | Path, device: torch.device | str = "cpu", precision: str = "fp32",
                       decode: bool = True, check: Callable[[Tokenizer], object] | None = None) -> InferenceRun:
    """A run's best (else latest) checkpoint on `device` ("auto" picks it), in `precision` ("auto": bf16 where the
    hardware computes it natively or, with `decode`, where the native step stores it; else fp32). With `decode`
    (sample, serve) the model is made fast to generate with (`prepare_for_inference`); without it (eval, which
    scores through the model's forward) it keeps its fp32 weights, bf16 being autocast by the caller, and int8
    weights run through the torch reference path. Raises
    GptlabError, before loading anything, for a precision or device this machine lacks, and for a folder that is
    not a run or has no usable checkpoint. `check`, given the run's tokenizer once the run is loaded and before the
    model is prepared, is where a caller refuses what it reads with it (sample's prompt) before that work."""
    from gptlab.checkpoint import load_run  # loading a run is the checkpoint module's; only this entry point needs it

    device = resolve_device(device) if isinstance(device, str) else device
    storage = bf16_storage_possible(device)
    if precision == "auto" and not decode:  # scoring alone runs torch's forward, where bf16 without native
        storage = False                     # products is slower than fp32: its "auto" is bf16 only where native
    precision = resolve_precision(precision, device, storage)
    loaded = load_run(run, device=device)
    if check is not None:
        check(loaded.tokenizer)
    parameters = loaded.model.num_params()
    if decode:
        model = prepare_for_inference(loaded.model, precision)
    elif precision == "int8":  # the weights sample --precision int8 decodes with, through the torch reference path
        model = prepare_for_inference(loaded.model, "int8", fused=False)  # no fused step: no huge pages either
    else:
        model = as_inference(loaded.model)
    return InferenceRun(model, loaded.tokenizer, loaded.checkpoint, precision, parameters)
