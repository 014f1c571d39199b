"""The inference wing: a model made fast to generate with, as one object the engine takes.

`load_for_inference(run, device, precision)` loads a run's model and makes it ready (sample, eval, serve);
`prepare_for_inference(model, precision)` returns an `InferenceModel`: the model (eval mode, weights in fp32 or
bf16, packed for oneDNN where it can run them: `weights`), its decoder (the step that turns one new token per row
into next-token logits: the fused native step of `fused` where the CPU and a compiler allow it, else `TorchStep`,
the model's own forward, which stays the reference) and the precision of its KV cache. The engine
(gptlab.engine) takes that object, or a plain model, which `as_inference` wraps with the torch step.

Rooms: `weights` (packed Linears, huge pages), `int8` (weight-only int8 with per-row scales: the torch reference),
`native` (building and loading csrc/decode.cpp, and checking its ABI), `fused` (the ctypes call of one decode
step, fp32, bf16 or int8 weights).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn

from gptlab import config
from gptlab.errors import GptlabError
from gptlab.inference.fused import FusedDecoder, fused_decoder
from gptlab.inference.int8 import BF16_ROWS, Int8Linear, quantize_model
from gptlab.inference.weights import InferenceLinear, can_pack, move_to_huge_pages, pack_linears
from gptlab.model import KVCache
from gptlab.runtime import bf16_supported, resolve_device, resolve_precision

if TYPE_CHECKING:
    from gptlab.checkpoint import Checkpoint
    from gptlab.tokenizer import Tokenizer

log = logging.getLogger("gptlab")
FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the float precisions -> their torch dtype
# what a model is prepared in: the CLI's choices (gptlab.config.INFERENCE_PRECISIONS) once "auto" is resolved
PREPARED_PRECISIONS = tuple(p for p in config.INFERENCE_PRECISIONS if p != "auto")
__all__ = ["FLOAT_DTYPES", "PREPARED_PRECISIONS", "Decoder", "FusedDecoder", "InferenceLinear", "InferenceModel",
           "InferenceRun", "Int8Linear", "TorchStep", "as_inference", "cache_dtype", "can_pack", "load_for_inference",
           "move_to_huge_pages", "prepare_for_inference"]


class Decoder(Protocol):
    """One decode step: the new token of each row -> next-token logits, over a KV cache it advances."""

    def accepts(self, cache: KVCache) -> bool:
        """Whether this step can read and write `cache` (its dtype, layout and device)."""

    def step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (R,) -> logits (R, V); writes each row's key and value at cache.pos and advances cache.pos by one."""


class TorchStep:
    """The reference decode step: the model's own forward over the cache, op by op (any device, any cache)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def accepts(self, cache: KVCache) -> bool:
        return True

    def step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return self.model(ids[:, None], kv_cache=cache, last_only=True)[0][:, -1]  # (R, V)


@dataclass(frozen=True)
class InferenceModel:
    """A model ready to generate with: what the engine runs prompts through, what decodes each new token, and the
    dtype its KV cache holds. Built by `prepare_for_inference` (or `as_inference` for a model used as it is)."""

    model: nn.Module  # its forward contract (prompts and window rebuilds go through it)
    decoder: Decoder  # a FusedDecoder over the model's weights, or TorchStep(model)
    cache_dtype: torch.dtype  # keys and values are stored in this (see `cache_dtype`)
    precision: str | None = None  # "fp32", "bf16" or "int8" as prepared; None for a model used as it is

    @property
    def fused(self) -> bool:
        """Whether new tokens are decoded by the fused native step."""
        return isinstance(self.decoder, FusedDecoder)

    @property
    def config(self):
        return self.model.config

    def new_kv_cache(self, rows: int, max_len: int | None = None) -> KVCache:
        """An empty cache for `rows` rows, in this model's cache dtype, of `max_len` positions (block_size)."""
        return self.model.new_kv_cache(rows, dtype=self.cache_dtype, max_len=max_len)

    def decoder_for(self, cache: KVCache) -> Decoder:
        """The step that decodes over `cache`: this model's decoder where it reads that cache, else the torch step."""
        return self.decoder if self.decoder.accepts(cache) else TorchStep(self.model)


def cache_dtype(device: torch.device, weights: torch.dtype, fused: bool, int8: bool = False) -> torch.dtype:
    """The precision keys and values are stored in, for a model with `weights` of this dtype on `device`: the
    weights' dtype, except fp32 for a bf16 model on a CPU decoded by torch ops (bf16 attention there is several times
    slower, measured in docs/benchmarks.md); the fused step reads a bf16 cache at half the bytes (at batch 8 and a
    few hundred positions, the cache's bytes rival the weights'), and so does the fused int8 step (`int8`, over fp32
    activations: at a few hundred positions an fp32 cache's bytes are several percent of int8 weights')."""
    if device.type == "cpu" and not fused:
        return torch.float32
    return torch.bfloat16 if int8 and fused else weights  # int8 decoded by torch ops (a GPU): its fp32 activations


def as_inference(model: InferenceModel | nn.Module) -> InferenceModel:
    """`model` itself if it is an InferenceModel; a plain model as it is (no packing, no cast), decoded by the
    torch step."""
    if isinstance(model, InferenceModel):
        return model
    weight = next(model.parameters())
    return InferenceModel(model, TorchStep(model), cache_dtype(weight.device, weight.dtype, fused=False))


def bf16_storage_possible(device: torch.device) -> bool:
    """Whether inference on `device` may keep its weights in bf16 without native bf16 products: on a CPU where the
    native decode step can be built (a compiler: gptlab.inference.native.missing), which widens bf16 weights to
    fp32 in registers on any CPU (the bytes read, what decoding waits for, are halved); prompts and eval's forward
    then compute bf16 through torch, correct but slower than fp32 on such a CPU."""
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
    if precision not in PREPARED_PRECISIONS:
        raise GptlabError(f"precision must be one of {', '.join(PREPARED_PRECISIONS)}, not {precision!r}")
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
                    "path dequantizes every weight at every step, slower than fp32; it is the reference")
    return InferenceModel(model, decoder, cache_dtype(device, dtype, native is not None, precision == "int8"),
                          precision)


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
        model = prepare_for_inference(loaded.model, "int8", fused=False, huge_pages=False)
    else:
        model = as_inference(loaded.model)
    return InferenceRun(model, loaded.tokenizer, loaded.checkpoint, precision, parameters)
