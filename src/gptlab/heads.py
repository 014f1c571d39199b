"""Head detectors: which attention heads of a GPT look at the previous token, at an earlier copy of the current
token, or at the token that followed that copy (an induction head), read from the model's own attention patterns.

The probe is the standard one: `half` random tokens (distinct where the vocabulary allows), then the same tokens
again. In the second half every token has been seen before, exactly `half` positions back, so three diagonals of a
head's pattern (B, H, T_query, T_key) say what it does:

- previous-token score: the mean attention from each query i >= 1 to key i - 1;
- duplicate-token score: the mean attention from each second-half query i to key i - half (its token's earlier
  occurrence);
- induction score: the mean attention from each second-half query i to key i - half + 1 (the token after the
  earlier occurrence: the one an induction head copies, to predict it comes next again).

Each is a mean over the batch and over those queries, one number per head: [n_layer, n_head] tensors. A score of 1
is a head that puts all its attention there. Chance level: a head that spreads its attention uniformly over the keys
it may see gives query i a weight of 1 / (i + 1) on each, so the chance score is the mean of 1 / (i + 1) over the
queries scored: (H(T) - 1) / (T - 1) for the previous token (H the harmonic numbers, T = 2 * half) and
(H(2 half) - H(half)) / half, about ln 2 / half, for the other two (`HeadScores.chance`).

The patterns are captured with the forward's `tap` (model.py): no copy of the forward, the very model that trains.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gptlab.errors import GptlabError
from gptlab.model import GPT, is_gpt

INDUCTION_PREFIX = "induction/"  # train --probe induction's keys in metrics.jsonl: induction/L{layer}H{head}
SCORE_KINDS = ("previous_token", "duplicate_token", "induction")


@dataclass(frozen=True)
class HeadScores:
    """Each head's three scores, [n_layer, n_head] each, on a probe of `half` tokens repeated once."""

    previous_token: torch.Tensor
    duplicate_token: torch.Tensor
    induction: torch.Tensor
    half: int

    def chance(self) -> dict[str, float]:
        """Each score of a head whose attention is uniform over the keys it may see (see the module's docstring)."""
        return chance_levels(self.half)

    def best(self, kind: str = "induction") -> tuple[int, int, float]:
        """(layer, head, score) of the head with the highest score of `kind` (one of SCORE_KINDS)."""
        if kind not in SCORE_KINDS:
            raise GptlabError(f"unknown head score {kind!r}; choose one of {', '.join(SCORE_KINDS)}")
        scores = getattr(self, kind)
        flat = int(scores.argmax())
        layer, head = divmod(flat, scores.size(1))
        return layer, head, float(scores[layer, head])


def chance_levels(half: int) -> dict[str, float]:
    """The scores of a uniform causal pattern on a probe of `half` tokens repeated: the mean of 1 / (i + 1) over the
    queries each score reads (i = 1 .. 2 half - 1 for the previous token, i = half .. 2 half - 1 for the others)."""
    previous = sum(1 / (i + 1) for i in range(1, 2 * half)) / (2 * half - 1)
    second = sum(1 / (i + 1) for i in range(half, 2 * half)) / half
    return {"previous_token": previous, "duplicate_token": second, "induction": second}


def repeated_tokens(vocab_size: int, half: int, batch: int, seed: int, exclude: Iterable[int] = ()) -> torch.Tensor:
    """(batch, 2 * half) token ids: `half` tokens drawn at random from the vocabulary (less `exclude`, e.g. special
    tokens) by a generator seeded with `seed`, then the same tokens again. A row's tokens are distinct where the
    vocabulary has `half` of them (so that each token of the second half has one earlier copy, even in a small
    vocabulary), drawn with replacement where it has fewer."""
    if half < 2 or batch < 1:
        raise GptlabError(f"a repeated-token probe needs half >= 2 and batch >= 1, not half {half}, batch {batch}")
    left_out = set(exclude)
    allowed = torch.tensor([i for i in range(vocab_size) if i not in left_out], dtype=torch.long)
    if len(allowed) == 0:
        raise GptlabError(f"no token left to draw: the vocabulary has {vocab_size} and all are excluded")
    generator = torch.Generator().manual_seed(seed)
    if len(allowed) >= half:  # each row's tokens distinct: every token's earlier copy is one position
        picks = torch.rand(batch, len(allowed), generator=generator).argsort(dim=1)[:, :half]
    else:
        picks = torch.randint(len(allowed), (batch, half), generator=generator)
    first = allowed[picks]
    return torch.cat([first, first], dim=1)


def _gpt(model: torch.nn.Module) -> GPT:
    """The GPT inside `model` (a DDP wrapper holds it as .module); GptlabError for a model without attention."""
    inner = getattr(model, "module", model)
    if not is_gpt(inner):
        raise GptlabError(f"head scores read attention patterns, and {type(inner).__name__} has no attention; "
                          "train a GPT (arch gpt)")
    return inner


def patterns(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """The attention pattern of every layer on `ids` (B, T), [(B, H, T, T)] in fp32, on the model's device: captured
    at each blocks.{i}.attn.hook_pattern in eval mode (no dropout) with no gradient; the model's mode is restored."""
    gpt = _gpt(model)
    if ids.size(1) > gpt.config.block_size:
        raise GptlabError(f"a probe of {ids.size(1)} tokens is longer than the context ({gpt.config.block_size})")
    captured: dict[int, torch.Tensor] = {}

    def tap(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("attn.hook_pattern"):
            captured[int(name.split(".")[1])] = tensor.detach().float()
        return tensor

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(ids.to(gpt.transformer.wte.weight.device), tap=tap)
    finally:
        model.train(was_training)
    return [captured[layer] for layer in range(len(captured))]


def _diagonal_mean(stack: torch.Tensor, back: int, first_query: int) -> torch.Tensor:
    """(L, H): the mean over batch and queries i >= first_query of stack[l, b, h, i, i - back]."""
    diagonal = torch.diagonal(stack, offset=-back, dim1=-2, dim2=-1)  # (L, B, H, T - back), entry k: query k + back
    return diagonal[..., first_query - back:].mean(dim=(1, 3))


def scores_from_patterns(patterns: list[torch.Tensor], half: int) -> HeadScores:
    """The three scores of each head from patterns [(B, H, T, T) per layer] of a probe of `half` tokens repeated
    (T = 2 * half); patterns made by hand work too."""
    stack = torch.stack([p.float().cpu() for p in patterns])  # (L, B, H, T, T)
    if half < 2 or stack.size(-1) != 2 * half or stack.size(-2) != 2 * half:
        raise GptlabError(f"patterns of {tuple(stack.shape[-2:])} positions are no probe of half {half} "
                          f"(2 * half positions, half >= 2)")
    return HeadScores(previous_token=_diagonal_mean(stack, 1, 1), duplicate_token=_diagonal_mean(stack, half, half),
                      induction=_diagonal_mean(stack, half - 1, half), half=half)


def head_scores(model: torch.nn.Module, vocab_size: int | None = None, half: int | None = None, batch: int = 8,
                seed: int = 0, exclude: Iterable[int] = ()) -> HeadScores:
    """Every head's previous-token, duplicate-token and induction scores on `batch` rows of `half` random tokens
    (from the model's vocabulary unless `vocab_size` says fewer) repeated once. `half` None: half the context, at
    most 32 tokens and at most the tokens there are to draw (so that a row's first half holds no token twice)."""
    config = _gpt(model).config
    vocab, left_out = vocab_size or config.vocab_size, set(exclude)
    drawable = sum(1 for i in range(vocab) if i not in left_out)
    half = max(2, min(config.block_size // 2, 32, drawable)) if half is None else half
    ids = repeated_tokens(vocab, half, batch, seed, left_out)
    return scores_from_patterns(patterns(model, ids), half)


def induction_scores(model: torch.nn.Module, vocab_size: int | None = None, half: int | None = None,
                     batch: int = 8, seed: int = 0) -> torch.Tensor:
    """Every head's induction score, [n_layer, n_head] (see head_scores)."""
    return head_scores(model, vocab_size, half, batch, seed).induction


def induction_metrics(model: torch.nn.Module, seed: int = 0) -> dict[str, float]:
    """train --probe induction's entries of an evaluation row: induction/L{layer}H{head} for every head, and
    induction/chance, the score of a uniform pattern on the same probe."""
    scores = head_scores(model, seed=seed)
    out = {f"{INDUCTION_PREFIX}L{layer}H{head}": float(value) for (layer, head), value in
           ((divmod(i, scores.induction.size(1)), v) for i, v in enumerate(scores.induction.flatten().tolist()))}
    return {**out, f"{INDUCTION_PREFIX}chance": scores.chance()["induction"]}


def check_probe(probe: str, arch: str) -> None:
    """A probe of attention heads needs heads: refuse --probe induction for a model without attention."""
    if probe != "none" and arch != "gpt":
        raise GptlabError(f"--probe {probe} reads attention heads, and arch {arch} has none; drop --probe")
