"""A model's scores on a task file: each item's options scored (tasks/score.py), then the references' measures, each
with a bootstrap confidence interval.

- multiple choice: `acc` (the option of highest log-likelihood), `acc_norm` as lm-evaluation-harness computes it
  (log-likelihood divided by the option's own length in characters, the delimiter not counted) and
  `acc_token_mean`, llm.c's measure (the log-likelihood divided by the option's number of tokens). On HellaSwag's
  records it is llm.c's HellaSwag evaluation item for item: llm.c's own rendering, the record's `ctx` (no activity
  label, no cleaning) and each raw ending after a space, encoded apart; elsewhere the options as scored for `acc`;
- schema: `acc` and `acc_token_mean` (the continuation is the same text for every context, so the harness's
  character norm changes nothing);
- language modelling: `acc` (greedy decoding reproduces every continuation token).
Ties go to the first option, as numpy's argmax does.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gptlab.errors import GptlabError
from gptlab.tasks.items import LANGUAGE_MODELLING, MULTIPLE_CHOICE, Item
from gptlab.tasks.score import Scored, check_pairs, encode_pair, score_pairs
from gptlab.tokenizer import Tokenizer

FEWSHOT_DELIMITER = "\n\n"  # between worked examples, and before the item (the harness's default)
RESAMPLES = 1000  # bootstrap resamples of the items for each interval
ITEMS_PER_CALL = 32  # items whose options are scored in one call (score_pairs batches them by its position budget)


@dataclass(frozen=True)
class Measure:
    value: float  # the mean over items
    low: float  # the bootstrap interval: 2.5th to 97.5th percentile of the resampled means
    high: float


@dataclass
class TaskScores:
    kind: str
    items: int
    measures: dict[str, Measure]
    cropped: int  # items whose context lost tokens at its start to fit the model
    seconds: float
    per_item: list[dict[str, float | int | bool | list[float]]] = field(default_factory=list)


def fewshot_prefix(items: Sequence[Item], index: int, k: int, seed: int) -> str:
    """K worked examples for item `index` of the whole file: `random.Random(seed * 1_000_003 + index)` samples k
    of the other items' indices (never `index` itself), each item's worked example followed by the delimiter; so
    an item gets the same examples whatever --limit and whichever batch it is scored in; "" for k = 0."""
    if k >= len(items):
        raise GptlabError(f"--num-fewshot {k} needs at least {k + 1} items in the file, which has {len(items)}")
    others = [j for j in range(len(items)) if j != index]
    drawn = random.Random(seed * 1_000_003 + index).sample(others, k)
    return "".join(items[j].worked_example() + FEWSHOT_DELIMITER for j in drawn)


def item_pairs(tokenizer: Tokenizer, item: Item, prefix: str, where: str) -> list[tuple[list[int], list[int]]]:
    """Each option's (context ids, continuation ids), the few-shot prefix before its context; then, for a HellaSwag
    record, each ending as llm.c renders it: the ids of its `ctx` (after the prefix), and those of " " + ending."""
    try:
        pairs = [encode_pair(tokenizer, prefix + context, continuation) for context, continuation in item.options]
        if item.llmc is not None:
            ctx, endings = item.llmc
            ctx_ids = tokenizer.encode(prefix + ctx, allow_special=True)
            pairs += [(ctx_ids, tokenizer.encode(" " + ending, allow_special=True)) for ending in endings]
        return pairs
    except GptlabError as exc:  # a char vocabulary meeting characters it has never seen: which ones, and where
        raise GptlabError(f"{where}: {exc}") from None


def judge(item: Item, scored: list[Scored]) -> dict[str, float | int | bool | list[float]]:
    """The item's measures from its options' scores (1.0 right, 0.0 wrong; item_pairs' order: a HellaSwag record's
    llm.c renderings after its options), with the log-likelihoods and the per-token means acc_token_mean compares."""
    lls = np.array([s.loglikelihood for s in scored[:len(item.options)]])
    out: dict[str, float | int | bool | list[float]] = {"line": item.line, "label": item.label,
                                                        "loglikelihoods": lls.tolist()}
    if item.kind == LANGUAGE_MODELLING:
        out["acc"] = float(scored[0].greedy)
        return out
    out["acc"] = float(int(np.argmax(lls)) == item.label)
    if item.kind == MULTIPLE_CHOICE:
        chars = np.array([float(len(t)) for t in item.option_texts])
        out["acc_norm"] = float(int(np.argmax(lls / chars)) == item.label)
    per_token = scored[len(item.options):] or scored  # llm.c's rendering of a HellaSwag record, or the options
    means = np.array([s.loglikelihood / s.tokens for s in per_token])
    out["token_means"] = means.tolist()
    out["acc_token_mean"] = float(int(np.argmax(means)) == item.label)
    return out


def bootstrap(values: Sequence[float], seed: int = 0, resamples: int = RESAMPLES) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the mean over `resamples` resamples of `values` with replacement."""
    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(len(x), size=(resamples, len(x)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def evaluate_items(model: torch.nn.Module, tokenizer: Tokenizer, items: Sequence[Item], name: str = "task",
                   precision: str = "fp32", num_fewshot: int = 0, seed: int = 1234, limit: int | None = None,
                   progress: Callable[[int], None] | None = None) -> TaskScores:
    """The model's TaskScores on `items` (the first `limit` of them), `num_fewshot` worked examples before each;
    `progress(n)` is called after each item. GptlabError, naming `name` and the item's line, for text the
    tokenizer cannot encode or a continuation too long for the model."""
    chosen = list(items[:limit])  # limit None: every item
    start, per_item, cropped = time.perf_counter(), [], 0
    for first in range(0, len(chosen), ITEMS_PER_CALL):  # several items' options scored together: bigger products
        batch, pairs = chosen[first:first + ITEMS_PER_CALL], []
        for index, item in enumerate(batch, first):
            where = f"{name}:{item.line}"
            option_pairs = item_pairs(tokenizer, item, fewshot_prefix(items, index, num_fewshot, seed), where)
            try:
                check_pairs(model.config.block_size, option_pairs)
            except GptlabError as exc:
                raise GptlabError(f"{where}: {exc}") from None
            pairs.append(option_pairs)
        scored = iter(score_pairs(model, [p for option_pairs in pairs for p in option_pairs], precision))
        for item, option_pairs in zip(batch, pairs):
            item_scores = [next(scored) for _ in option_pairs]
            cropped += any(s.cropped for s in item_scores)
            per_item.append(judge(item, item_scores))
            if progress is not None:
                progress(1)
    names = [k for k in ("acc", "acc_norm", "acc_token_mean") if k in per_item[0]]
    measures = {}
    for k in names:
        values = [float(row[k]) for row in per_item]  # type: ignore[arg-type]
        measures[k] = Measure(float(np.mean(values)), *bootstrap(values))
    return TaskScores(chosen[0].kind, len(chosen), measures, cropped, time.perf_counter() - start, per_item)
