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

from gptlab.config import check_prepared
from gptlab.errors import GptlabError
from gptlab.runtime import autocast
from gptlab.tokenizer import Tokenizer

POSITIONS = 1024  # continuation positions per forward: bounds the logits' memory (positions x vocabulary floats)


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


def check_pairs(block_size: int, pairs: Sequence[tuple[list[int], list[int]]]) -> None:
    """GptlabError for a pair that cannot be scored: an empty context or continuation, or a continuation longer than
    the model's context."""
    for context, continuation in pairs:
        if not continuation:
            raise GptlabError("a continuation encodes to no tokens; every option needs text to score")
        if len(continuation) > block_size:  # one context token, then block - 1 more positions: block predictions
            raise GptlabError(f"a continuation of {len(continuation)} tokens is longer than the model's context of "
                              f"{block_size} tokens")
        if not context:
            raise GptlabError("a context encodes to no tokens; every option needs a context")


@torch.no_grad()
def score_pairs(model: torch.nn.Module, pairs: Sequence[tuple[list[int], list[int]]], precision: str = "fp32",
                positions: int = POSITIONS) -> list[Scored]:
    """A Scored per (context ids, continuation ids) pair (check_pairs' GptlabError first). Pairs that keep the same
    context (after cropping) share one prefill: the contexts run once each, batched, their caches are copied to
    one row per continuation, and the continuations run together, about `positions` continuation positions per
    forward. `precision`: one of config.PREPARED_PRECISIONS (bf16 is autocast; fp32 and int8 run in the weights' own)."""
    check_prepared(precision)
    check_pairs(model.config.block_size, pairs)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (context, continuation) in enumerate(pairs):
        keep = model.config.block_size + 1 - len(continuation)  # the harness's window: the last block + 1 tokens
        groups.setdefault(tuple(context[-keep:]), []).append(i)
    out: list[Scored | None] = [None] * len(pairs)

    def run(batch: list[tuple[int, ...]]) -> None:
        results = iter(_score_groups(model, [list(c) for c in batch], [[pairs[i][1] for i in groups[c]]
                                                                       for c in batch], precision))
        for context in batch:
            for i in groups[context]:
                loglikelihood, greedy = next(results)
                out[i] = Scored(loglikelihood, len(pairs[i][1]), greedy, len(context) < len(pairs[i][0]))

    # a batch's rows all run `width` positions after the longest context: together they must fit the model
    batch, rows, width, prefix = [], 0, 0, 0
    for context, members in groups.items():
        longest = max(len(pairs[i][1]) for i in members)
        wider, deeper = max(width, longest), max(prefix, len(context) - 1)
        if batch and ((rows + len(members)) * wider > positions or deeper + wider > model.config.block_size):
            run(batch)
            batch, rows, wider, deeper = [], 0, longest, len(context) - 1
        batch, rows, width, prefix = [*batch, context], rows + len(members), wider, deeper
    if batch:
        run(batch)
    return out  # type: ignore[return-value]


def _score_groups(model: torch.nn.Module, contexts: list[list[int]], continuations: list[list[list[int]]],
                  precision: str) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of every continuation, group by group (continuations[g] follow contexts[g]), in
    two forwards: every context but its last token, right-padded (the prefill: its logits are not needed); then one
    row per continuation on a copy of its context's cache, fed the context's last token and the continuation but its
    last, so that position j predicts continuation token j."""
    device = next(model.parameters()).device
    rows = torch.tensor([g for g, conts in enumerate(continuations) for _ in conts], device=device)
    flat = [c for conts in continuations for c in conts]
    width = max(len(c) for c in flat)
    cache = model.new_kv_cache(len(contexts), max_len=max(len(c) for c in contexts) - 1 + width)
    lengths = torch.tensor([len(c) - 1 for c in contexts], device=device)
    if int(lengths.max()) > 0:
        x = torch.zeros(len(contexts), int(lengths.max()), dtype=torch.long)
        for g, context in enumerate(contexts):
            x[g, :len(context) - 1] = torch.tensor(context[:-1])
        with autocast(device, precision):
            model(x.to(device), kv_cache=cache, last_only=True)
    cache.pos = lengths  # right-padded rows: each goes on from its own length
    x = torch.zeros(len(flat), width, dtype=torch.long)
    for r, (g, continuation) in enumerate(zip(rows.tolist(), flat)):
        x[r, 0] = contexts[g][-1]
        x[r, 1:len(continuation)] = torch.tensor(continuation[:-1])
    with autocast(device, precision):
        logits, _ = model(x.to(device), kv_cache=cache.select_rows(rows))  # (rows, width, V)
    logits = logits.float()
    targets = torch.zeros(len(flat), width, dtype=torch.long)
    for r, continuation in enumerate(flat):
        targets[r, :len(continuation)] = torch.tensor(continuation)
    targets = targets.to(device)
    picked = logits.gather(2, targets[..., None])[..., 0] - logits.logsumexp(-1)  # (rows, width): log p(target)
    hit = logits.argmax(-1) == targets
    return [(picked[r, :len(c)].double().sum().item(), bool(hit[r, :len(c)].all())) for r, c in enumerate(flat)]
