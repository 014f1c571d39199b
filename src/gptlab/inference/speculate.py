"""Prompt-lookup speculation: a row proposes the tokens that followed the last earlier occurrence of its newest
n-gram (in its prompt and its output so far, no draft model), the fused step checks them all in one call
(`FusedDecoder.verify`: each position's logits have the bits a one-token step would give), and the row keeps the
proposals its own sampler draws, then the token it draws after them. Output is therefore exactly the output
without speculation, greedy or seeded: each draw is the row's next draw from its own generator over the same logits.

What a row proposes adapts to how it fares (`Lookup.update`): the proposal grows (to DRAFT_MAX) while every
proposed token is kept, shrinks to one past what was kept otherwise, and a row whose proposals are all refused
OFF_AFTER times in a row stops proposing. A proposal costs one more row of the step (its products and attention),
nearly free at batch 1, where the step's time is the weights' reading.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gptlab.model import KVCache

NGRAM_MAX = 3  # the longest n-gram a row looks up (then shorter ones, down to NGRAM_MIN)
NGRAM_MIN = 2  # single tokens repeat too often in open text to be worth checking
DRAFT_START = 4  # tokens a row proposes at first
DRAFT_MAX = 16  # the most it proposes at a time
OFF_AFTER = 8  # proposals refused outright this many times in a row: the row stops proposing


@dataclass
class Tally:
    """Tokens proposed and, of those, kept (drawn), over a batch's rows."""

    proposed: int = 0
    kept: int = 0


class Prediction:
    """A client's predicted output (OpenAI's `prediction`) as a row's proposals: its tokens from where the output
    stands in it; after the output leaves it, from where the output's newest n-gram next occurs in it. `accepted`
    and `rejected` count its tokens proposed and kept, and proposed and refused."""

    def __init__(self, ids: Sequence[int]):
        self.ids = list(ids)
        self.at: int | None = 0  # the output so far ends before ids[at]; None: it left the prediction
        self.floor = 0  # where the output last stood in it: it is looked up again from there on
        self.index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions after its occurrences
        for n in range(NGRAM_MIN, NGRAM_MAX + 1):
            for end in range(n, len(self.ids) + 1):
                self.index.setdefault(tuple(self.ids[end - n:end]), []).append(end)
        self.accepted = self.rejected = 0

    def follow(self, token: int) -> None:
        """The output's next token."""
        if self.at is not None and self.at < len(self.ids) and self.ids[self.at] == token:
            self.at = self.floor = self.at + 1
        else:
            self.at = None

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        if self.at is None:
            for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
                later = [p for p in self.index.get(tuple(tokens[-n:]), ()) if p >= self.floor]
                if len(tokens) >= n and later:
                    self.at = later[0]
                    break
        return [] if self.at is None else self.ids[self.at:self.at + count]


class Lookup:
    """One row's proposals: the `prediction` where the request gave one, else (or where it has none to give) an
    index of the n-grams of its tokens so far (prompt and output) to where each last occurred; how many tokens it
    proposes now; what it proposes and keeps is also counted in `tally`."""

    def __init__(self, tokens: Iterable[int] = (), tally: Tally | None = None, prediction: Prediction | None = None):
        self.tally = tally if tally is not None else Tally()
        self.prediction = prediction
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its last occurrence
        self.draft = DRAFT_START
        self.refused = 0  # proposals refused outright in a row
        self.on = True
        self.proposed = self.kept = 0  # over the row's life
        self.predicted = False  # whether the last proposal came from the prediction
        for token in tokens:
            self._add(token)

    def _add(self, token: int) -> None:
        """Append a token; the n-grams ending before it are indexed (the newest one's is the query)."""
        self.tokens.append(token)
        end = len(self.tokens) - 1  # index the n-grams ending at the token before this one
        for n in range(NGRAM_MIN, NGRAM_MAX + 1):
            if end >= n:
                self.index[tuple(self.tokens[end - n:end])] = end

    def extend(self, tokens: Iterable[int]) -> None:
        """The row's output tokens, in order."""
        for token in tokens:
            self._add(token)
            if self.prediction is not None:
                self.prediction.follow(token)

    def propose(self, limit: int) -> list[int]:
        """min(the current draft, limit) tokens: those that followed the last earlier occurrence of the longest
        n-gram the tokens end with, the text taken to repeat from there on (an occurrence p tokens back proposes
        a period of p: a run of one token proposes that token again and again); [] where none occurred or the row
        stopped proposing."""
        self.predicted = False
        if not self.on or limit <= 0:
            return []
        tokens, count = self.tokens, min(self.draft, limit)
        if self.prediction is not None:
            proposal = self.prediction.propose(tokens, count)
            if proposal:
                self.predicted = True
                return proposal
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            after = self.index.get(tuple(tokens[-n:])) if len(tokens) >= n else None
            if after is not None:
                period = len(tokens) - after
                return [tokens[after + i % period] for i in range(count)]
        return []

    def update(self, proposed: int, kept: int) -> None:
        """After a check of `proposed` tokens of which the first `kept` were drawn."""
        if not proposed:
            return
        self.proposed += proposed
        self.kept += kept
        self.tally.proposed += proposed
        self.tally.kept += kept
        if self.predicted:
            self.prediction.accepted += kept
            self.prediction.rejected += proposed - kept
        self.draft = min(2 * self.draft, DRAFT_MAX) if kept == proposed else max(1, kept + 1)
        self.refused = self.refused + 1 if kept == 0 else 0
        if self.refused >= OFF_AFTER:
            self.on = False


def propose(rows: Sequence[Any], cache: KVCache, draft: Callable[[Any, int], list[int]]) -> bool:
    """Each row's proposal (`row.drafts`: `draft(row, limit)`, at most row.left - 1 tokens, each at a position the
    cache holds: the window cannot slide before the last token drawn), cache row i of rows[i] set to the positions
    it fills (`row.filled`: kept proposals moved it on); whether any row proposes."""
    cache.pos.copy_(torch.tensor([row.filled for row in rows]))
    for row in rows:
        row.drafts = draft(row, min(row.left - 1, cache.max_len - 1 - row.filled))
    return any(row.drafts for row in rows)


def verify_proposals(decoder: Any, rows: Sequence[Any], cache: KVCache) -> None:
    """One step (a FusedDecoder's verify) of every row's newest token and its proposed ones: each row's logits
    (1, V) after its newest token, `draft_logits` after each proposed one; its newest token is filled."""
    ids, pos, slot = [], [], []
    for i, row in enumerate(rows):
        ids += [row.window[-1], *row.drafts]
        pos += range(row.filled, row.filled + 1 + len(row.drafts))
        slot += [i] * (1 + len(row.drafts))
    device = cache.k.device
    logits = decoder.verify(*(torch.tensor(x, dtype=torch.long, device=device) for x in (ids, pos, slot)),
                            cache).clone()  # the decoder's buffer is reused by its next step
    start = 0
    for row in rows:
        row.logits, row.draft_logits = logits[start:start + 1], logits[start + 1:start + 1 + len(row.drafts)]
        row.filled += 1
        start += 1 + len(row.drafts)
