"""The char-small-shaped model generating past its context (its window slides), with the KV cache and without,
for `gptlab bench generate`."""

from __future__ import annotations

import torch

from gptlab.bench.engines import GEN_MODELS, run_gptlab
from gptlab.config import ModelConfig, build
from gptlab.inference.loading import prepare_for_inference
from gptlab.model import GPT


def char_model_speedup(device: torch.device, new_tokens: int, prompt_tokens: int) -> tuple[float, float]:
    """Seconds to generate `new_tokens` with the char-small-shaped model (context 256, so the window slides), with
    the KV cache and without."""
    torch.manual_seed(0)
    config = build(ModelConfig, GEN_MODELS["char-small"], {})
    model = prepare_for_inference(GPT(config).to(device), "fp32")
    prompt = [torch.randint(0, config.vocab_size, (prompt_tokens,)).tolist()]
    run_gptlab(model, prompt, 2)
    return run_gptlab(model, prompt, new_tokens).seconds, run_gptlab(model, prompt, new_tokens, cached=False).seconds
