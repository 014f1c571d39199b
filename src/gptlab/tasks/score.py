"""Log-likelihoods of continuations, as lm-evaluation-harness computes them for a causal model, through the KV cache:
a context shared by several continuations is run once.

The harness's rules, kept here so that its numbers and ours are the same on the same items: spaces at the end of a
context move to the front of its continuation; the continuation's ids are those of the whole text after the
context's own ids (so a merge across the boundary belongs to the continuation); where context and continuation
exceed the model's context, the context loses tokens at its start (each option keeps as many as fit); the
log-likelihood is the sum over the continuation's tokens, and "greedy" says whether each one was the most likely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gptlab.errors import GptlabError
from gptlab.runtime import autocast
from gptlab.tokenizer import Tokenizer


@dataclass(frozen=True)
class Scored:
    loglikelihood: float  # sum of log p over the continuation's tokens
    tokens: int  # how many tokens the continuation has
    greedy: bool  # every continuation token was the model's most likely next token
    cropped: bool  # the context lost tokens at its start to fit the model's context


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) by the harness's rule: trailing spaces of the context go to the continuation,
    and the continuation's ids are the whole text's ids after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, allow_special=True)  # as Hugging Face's tokenizers encode
    context_ids = tokenizer.encode(context, allow_special=True)
    return context_ids, whole[len(context_ids):]


@torch.no_grad()
def score_pairs(model: torch.nn.Module, pairs: Sequence[tuple[list[int], list[int]]],
                precision: str = "fp32") -> list[Scored]:
    """A Scored per (context ids, continuation ids) pair. Pairs that keep the same context (after cropping) share
    one prefill: the context runs once, its cache is copied to one row per continuation, and the continuations run
    together. GptlabError for an empty continuation or context, or a continuation longer than the model's context."""
    block = model.config.block_size
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (context, continuation) in enumerate(pairs):
        if not continuation:
            raise GptlabError("a continuation encodes to no tokens; every option needs text to score")
        if len(continuation) > block:  # one context token, then block - 1 more positions: block predictions
            raise GptlabError(f"a continuation of {len(continuation)} tokens is longer than the model's context of "
                              f"{block} tokens")
        if not context:
            raise GptlabError("a context encodes to no tokens; every option needs a context")
        keep = block + 1 - len(continuation)  # the harness's window: (context + continuation)[-(block + 1):]
        groups.setdefault(tuple(context[-keep:]), []).append(i)
    out: list[Scored | None] = [None] * len(pairs)
    for context, members in groups.items():
        cropped = len(context) < len(pairs[members[0]][0])
        results = _score_group(model, list(context), [pairs[i][1] for i in members], precision)
        for i, (loglikelihood, greedy) in zip(members, results):
            out[i] = Scored(loglikelihood, len(pairs[i][1]), greedy, cropped)
    return out  # type: ignore[return-value]


def _score_group(model: torch.nn.Module, context: list[int], continuations: list[list[int]],
                 precision: str) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of each continuation after one shared context: the context's last position predicts
    every continuation's first token; the continuations (but their last tokens), right-padded, run on copies of the
    context's cache and predict the rest."""
    device = next(model.parameters()).device
    n, longest = len(continuations), max(len(c) for c in continuations)
    cache = model.new_kv_cache(1, max_len=len(context) + longest - 1)
    with autocast(device, precision):
        first, _ = model(torch.tensor([context], device=device), kv_cache=cache, last_only=True)  # (1, 1, V)
    logprobs = [first[0, 0].float().log_softmax(-1).expand(n, -1)]  # (n, V): each continuation's first token
    if longest > 1:
        x = torch.zeros(n, longest - 1, dtype=torch.long)
        for row, continuation in enumerate(continuations):
            x[row, :len(continuation) - 1] = torch.tensor(continuation[:-1])
        with autocast(device, precision):
            rest, _ = model(x.to(device), kv_cache=cache.repeat_rows(n))  # (n, longest - 1, V)
        logprobs += list(rest.float().log_softmax(-1).unbind(1))
    table = torch.stack(logprobs, 1)  # (n, longest, V): position j predicts continuation token j
    out = []
    for row, continuation in enumerate(continuations):
        targets = torch.tensor(continuation, device=table.device)
        picked = table[row, :len(continuation)]  # (len, V)
        loglikelihood = picked.gather(1, targets[:, None]).sum().item()
        out.append((loglikelihood, bool((picked.argmax(-1) == targets).all())))
    return out
