"""A model as the engine takes it: an `InferenceModel` (the model, the step that decodes each new token, the dtype
its KV cache holds), the `Decoder` protocol every such step follows, `TorchStep` (the model's own forward over the
cache, op by op: the reference), the precision a cache is kept in (`cache_dtype`), and `as_inference`, which takes a
plain model as it is with the torch step. Making a model or a run ready is gptlab.inference.loading's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

from gptlab.config import ModelConfig
from gptlab.inference.fused import FusedDecoder
from gptlab.model import KVCache


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
    attend: torch.dtype | None = None  # the precision attention over its caches computes in (KVCache.attend)

    @property
    def fused(self) -> bool:
        """Whether new tokens are decoded by the fused native step."""
        return isinstance(self.decoder, FusedDecoder)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def new_kv_cache(self, rows: int, max_len: int | None = None) -> KVCache:
        """An empty cache for `rows` rows, in this model's cache dtype, of `max_len` positions (block_size)."""
        cache = self.model.new_kv_cache(rows, dtype=self.cache_dtype, max_len=max_len)
        cache.attend = self.attend
        return cache

    def decoder_for(self, cache: KVCache) -> Decoder:
        """The step that decodes over `cache`: this model's decoder where it reads that cache, else the torch step."""
        return self.decoder if self.decoder.accepts(cache) else TorchStep(self.model)


def cache_dtype(device: torch.device, weights: torch.dtype, fused: bool, int8: bool) -> torch.dtype:
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
    return InferenceModel(model, TorchStep(model), cache_dtype(weight.device, weight.dtype, fused=False, int8=False))
