"""Training with the naive engine: a GPT turned into a NaiveGPT (the same parameters, its forward and backward
the engine's) and the engine's AdamW over the torch path's groups (optim.param_groups)."""

from __future__ import annotations

from gptlab.config import TrainConfig
from gptlab.model import GPT, is_gpt
from gptlab.optim import param_groups
from gptlab.reference.library import load_library
from gptlab.reference.naive_adamw import NaiveAdamW
from gptlab.reference.naive_gpt import NaiveGPT


def naive_model(model: GPT) -> NaiveGPT:
    """`model` itself, computed by the engine from now on (its class becomes NaiveGPT: no state changes); the
    library is built first, so a machine without a compiler is told before anything is written."""
    load_library()
    if not is_gpt(model):
        raise TypeError(f"the reference engine computes a GPT, not a {type(model).__name__}")
    model.__class__ = NaiveGPT
    return model


def naive_optimizer(model: GPT, cfg: TrainConfig) -> NaiveAdamW:
    """The engine's AdamW with cfg's learning rate and betas over the torch path's groups: the matrices
    (embeddings, linear weights) decay by cfg.weight_decay, biases and LayerNorm gains do not."""
    return NaiveAdamW(param_groups(model.parameters(), cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
