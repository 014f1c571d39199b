"""Autoregressive generation: prefill the prompt once, then decode one token at a time from the KV cache.

The engine sees only token ids. Past the model's context (block_size), learned positions cannot be shifted, so
the window slides by rebuilding the cache from the last `keep` tokens (default 3/4 of block_size): one prefill
every block_size - keep new tokens, each token still seeing at least `keep` tokens of context.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from gptlab.config import SampleConfig
from gptlab.errors import GptlabError
from gptlab.sampling import next_token


def window_keep(block_size: int) -> int:
    """How many trailing tokens the cache is rebuilt from when the context is full."""
    return max(1, block_size * 3 // 4)


class Generation:
    """State shared by the cached and the reference decoder: contexts, penalty counts and the generator."""

    def __init__(self, model: torch.nn.Module, prompt: Sequence[int], cfg: SampleConfig, num_samples: int):
        if not prompt:
            raise GptlabError("the prompt is empty and this model has no start token; give a --prompt")
        self.model, self.cfg = model, cfg
        self.device = next(model.parameters()).device
        self.block_size = model.config.block_size
        self.contexts = [list(prompt[-self.block_size:]) for _ in range(num_samples)]
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed)
        self.counts = None
        if cfg.repetition_penalty != 1.0 or cfg.frequency_penalty or cfg.presence_penalty:
            vocab = model.config.vocab_size
            self.counts = torch.zeros(num_samples, vocab, dtype=torch.long, device=self.device)
            for row, ctx in enumerate(self.contexts):
                self.counts[row].index_add_(0, torch.tensor(ctx, device=self.device),
                                            torch.ones(len(ctx), dtype=torch.long, device=self.device))

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Next ids (B,) from last-position logits (B, V); updates contexts and counts."""
        ids = next_token(logits, self.cfg, self.generator, self.counts)
        if self.counts is not None:
            self.counts[torch.arange(len(ids), device=self.device), ids] += 1
        for ctx, i in zip(self.contexts, ids.tolist()):
            ctx.append(i)
        return ids


@torch.inference_mode()
def generate(model: torch.nn.Module, prompt: Sequence[int], cfg: SampleConfig,
             num_samples: int = 1) -> Iterator[list[int]]:
    """Yield, for each new position, the list of `num_samples` next token ids (one per sample), up to
    cfg.max_new_tokens. The prompt is prefilled once and shared by all samples; a prompt longer than the context
    keeps its last block_size tokens."""
    state = Generation(model, prompt, cfg, num_samples)
    cache = model.new_kv_cache(1)
    logits, _ = model(torch.tensor([state.contexts[0]], device=state.device), kv_cache=cache, last_only=True)
    cache = cache.repeat_rows(num_samples)
    logits = logits[:, -1].expand(num_samples, -1)  # (N, V)
    keep = window_keep(state.block_size)
    for _ in range(cfg.max_new_tokens):
        ids = state.choose(logits)
        yield ids.tolist()
        if int(cache.pos[0]) >= state.block_size:  # context full: rebuild from the last `keep` tokens
            cache = model.new_kv_cache(num_samples)
            x = torch.tensor([ctx[-keep:] for ctx in state.contexts], device=state.device)
        else:
            x = ids[:, None]  # (N, 1)
        logits, _ = model(x, kv_cache=cache, last_only=True)
        logits = logits[:, -1]


@torch.inference_mode()
def generate_uncached(model: torch.nn.Module, prompt: Sequence[int], cfg: SampleConfig,
                      num_samples: int = 1) -> Iterator[list[int]]:
    """The reference decoder: recompute the whole window every step, no cache. It follows the same window
    policy as `generate`, so the two give identical ids under greedy decoding."""
    state = Generation(model, prompt, cfg, num_samples)
    keep = window_keep(state.block_size)
    start = 0  # index in the context where the current window begins
    for _ in range(cfg.max_new_tokens):
        window = [ctx[start:] for ctx in state.contexts]
        logits, _ = model(torch.tensor(window, device=state.device), last_only=True)
        ids = state.choose(logits[:, -1])
        yield ids.tolist()
        if len(window[0]) >= state.block_size:
            start = len(state.contexts[0]) - keep
