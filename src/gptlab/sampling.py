"""Choosing the next token: pure functions over logits, randomness only from an explicit torch.Generator."""

from __future__ import annotations

import torch

from gptlab.config import SampleConfig


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, repetition: float = 1.0, frequency: float = 0.0,
                    presence: float = 0.0) -> torch.Tensor:
    """Discourage tokens already generated. logits and counts are (B, V); counts[b, v] is how often token v
    occurs in row b's context so far.

    repetition (CTRL-style, as in transformers): a seen token's logit is divided by it when positive and
    multiplied by it when negative. frequency and presence (OpenAI-style): subtract frequency * count and
    presence * [count > 0]. With the defaults (1, 0, 0) the logits come back unchanged."""
    seen = counts > 0
    if repetition != 1.0:
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    if frequency or presence:
        logits = logits - frequency * counts.to(logits.dtype) - presence * seen.to(logits.dtype)
    return logits


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep exactly the k largest logits of each row (ties broken toward the lower token id); the rest -inf."""
    if k <= 0 or k >= logits.size(-1):
        return logits
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, True)
    return logits.masked_fill(~keep, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability mass is >= p (among equal
    logits the lower token id counts as the more likely, as in top_k_filter)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    drop_sorted = mass_before >= p  # the first token always stays: its mass_before is 0 < p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def add_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """OpenAI's logit_bias: `bias[id]` added to that id's logit in every row (-100 all but bans it, 100 all but
    forces it); a new tensor."""
    ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, values.expand(*logits.shape[:-1], -1))


def next_token(logits: torch.Tensor, cfg: SampleConfig, generator: torch.Generator | None = None,
               counts: torch.Tensor | None = None, bias: dict[int, float] | None = None,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Pick one token per row from logits (B, V): `bias` (logit_bias) added, penalties, the mask `allowed` (V,)
    (a grammar's: -inf on the tokens it refuses), then temperature (0 = argmax, the lowest id among equal maxima),
    top-k, top-p, then a draw from the softmax with `generator`: one uniform number per row, placed in the
    cumulative distribution (torch.multinomial draws V exponentials per row, several times slower at GPT-2's
    vocabulary, and the server draws every row of every step). Returns ids (B,)."""
    logits = logits.float()
    if bias:
        logits = add_bias(logits, bias)
    if counts is not None:
        logits = apply_penalties(logits, counts, cfg.repetition_penalty, cfg.frequency_penalty, cfg.presence_penalty)
    if allowed is not None:
        logits = torch.where(allowed, logits, float("-inf"))  # (a third faster than masked_fill here)
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / cfg.temperature
    if cfg.top_k is not None:
        logits = top_k_filter(logits, cfg.top_k)
    logits = top_p_filter(logits, cfg.top_p)
    cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)  # (B, V)
    u = torch.rand(cdf.size(0), 1, generator=generator, device=cdf.device) * cdf[:, -1:]  # (B, 1): in [0, mass)
    # the first token whose cumulative mass passes u: a token of probability 0 (filtered) spans no interval
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.size(-1) - 1)
