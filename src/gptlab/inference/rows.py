"""One row of generation: how its seed is made, how its window slides, and how its next token is chosen
(`RowSampler`: its own generator, penalty counts, logit_bias and grammar constraint). The decoders that run rows
are engine.py's."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from gptlab.config import SEED_LIMIT, SampleConfig
from gptlab.errors import GptlabError
from gptlab.inference.grammar import Grammar
from gptlab.sampling import next_token


def window_keep(block_size: int) -> int:
    """How many trailing tokens a row's window keeps when it slides."""
    return max(1, block_size * 3 // 4)


def row_seed(seed: int, sample: int) -> int:
    """The seed of sample `sample` (0, 1, ...) of a prompt drawn with `seed`: seed + sample, wrapped into [0, 2**63).
    So sample i of n is exactly what one sample with seed + i gives, in `gptlab sample` and in the server alike."""
    return (seed + sample) % SEED_LIMIT


@contextmanager
def one_thread() -> Iterator[None]:
    """Draw tokens on one thread: a row's vector of V numbers gains nothing from a second, and where another
    process keeps a core busy each parallel region waits for a descheduled thread (many times slower than one
    thread at GPT-2's vocabulary)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class RowSampler:
    """One row's sampling state: its settings, its own generator (seeded with `seed`), its logit_bias, its
    grammar's `Constraint` (gptlab.inference.grammar) and, when a penalty is set, its token counts (1, V), started
    from the row's window. Every row is drawn alone, from its own (1, V) logits, so what a row draws never depends on
    which rows are beside it (the server's continuous batching). A token its grammar forces is taken, not drawn."""

    def __init__(self, cfg: SampleConfig, seed: int, window: Sequence[int], vocab_size: int, device: torch.device,
                 steer: Steer | None = None):
        self.cfg = cfg
        self.generator = torch.Generator(device).manual_seed(seed)
        self.bias = steer.logit_bias if steer is not None else None
        self.constraint = steer.grammar.start(steer.fast_forward) if steer and steer.grammar else None
        self.counts = None
        if cfg.repetition_penalty != 1.0 or cfg.frequency_penalty or cfg.presence_penalty:
            self.counts = torch.zeros(1, vocab_size, dtype=torch.long, device=device)
            ids = torch.tensor(window, dtype=torch.long, device=device)
            self.counts[0].index_add_(0, ids, torch.ones_like(ids))

    def choose(self, logits: torch.Tensor) -> int:
        """The next id from this row's next-token logits (1, V); counted for the penalties. DeadEnd (a GptlabError)
        where its grammar allows no token."""
        c = self.constraint
        i = c.forced() if c is not None else None
        if i is None:
            i = int(next_token(logits, self.cfg, self.generator, self.counts, self.bias,
                               _widened(c.allowed(), logits.size(-1)) if c is not None else None))
        if c is not None:
            c.consume(i)
        if self.counts is not None:
            self.counts[0, i] += 1
        return i

    @property
    def finished(self) -> bool:
        """Whether its grammar is complete (the row ends: nothing more may follow)."""
        return self.constraint is not None and self.constraint.finished


def _widened(allowed: torch.Tensor, width: int) -> torch.Tensor:
    """A grammar's mask (the tokenizer's ids) over a model's logits: ids past the tokenizer's (a model whose
    vocabulary has unused rows) are refused."""
    return allowed if allowed.numel() >= width else torch.nn.functional.pad(allowed, (0, width - allowed.numel()))


@dataclass(frozen=True)
class Steer:
    """What a row's tokens must obey beyond its SampleConfig: OpenAI's logit_bias (id -> bias), a grammar, and
    whether the grammar's forced runs are taken (fast_forward; off, every token is drawn under the mask)."""

    logit_bias: dict[int, float] | None = None
    grammar: Grammar | None = None
    fast_forward: bool = True


def check_prompts(model: nn.Module, prompts: Sequence[Sequence[int]], num_samples: int = 1) -> None:
    """GptlabError for no prompt, an empty one, an id outside the model's vocabulary, or num_samples < 1."""
    if num_samples < 1:
        raise GptlabError(f"num_samples must be >= 1, not {num_samples}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GptlabError("the prompt is empty and this model has no start token; give a --prompt")
    vocab = model.config.vocab_size
    bad = next((i for p in prompts for i in p if not 0 <= i < vocab), None)
    if bad is not None:
        raise GptlabError(f"token id {bad} is outside the model's vocabulary of {vocab}; use the run's tokenizer")


def push(window: list[int], token: int, block_size: int, keep: int) -> None:
    """Append a new token to a row's window; a window past block_size slides to its last `keep` tokens."""
    window.append(token)
    if len(window) > block_size:
        del window[:-keep]
