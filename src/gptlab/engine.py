"""Autoregressive generation: each prompt through the prompt pass once, then one token at a time from the KV cache.

One cached decoder, over a model made fast to run by the inference wing
(`gptlab.inference.loading.prepare_for_inference`: packed weights, the decode step, the KV cache's precision):

- `RunningBatch` is the decoder: rows join (each prompt put through the prompt pass alone, in fixed chunks that an
  exact prefix cache may serve: gptlab.inference.prefix_cache) and leave between decode steps, each drawn by its own
  `RowSampler` (settings, generator, penalty counts), so a row's tokens do not depend on the rows beside it. The
  server (gptlab.serve), `gptlab sample`, `gptlab chat`, `eval --task`'s generation and `inspect` all run it.
- `generate_batch` / `generate` are its loop over token ids: prompts of different lengths in one batch (each row
  keeps its own position), `num_samples` continuations of each prompt from one prompt pass, yielding ids as they
  come. `generate_uncached` is the reference: no cache, every step recomputes each window from scratch.

Text is textstream.py's: `TextStream` turns these ids into text (UTF-8-safe streaming, the end-of-text token,
stop strings).

Each takes an `InferenceModel` or a plain model, which runs as it is, decoded by the torch step (`as_inference`).

The sliding window. Learned positions cannot be shifted, so when a row's window is full (block_size tokens) and
one more token arrives, the row's window becomes its last `keep` tokens (`window_keep`: 3/4 of block_size) and
its cache row is rebuilt from them through the prompt pass: one rebuild every block_size - keep + 1 new tokens,
every token seeing at least `keep` tokens of context (if the prompt had that many). The reference recomputes the
same window from scratch each step, so under greedy decoding the two give the same ids.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from gptlab.config import SampleConfig
from gptlab.inference.grammar import DeadEnd
from gptlab.inference.prefix_cache import PrefixCache, prompt_pass
from gptlab.inference.prepared import InferenceModel, as_inference
from gptlab.inference.rows import RowSampler, Steer, check_prompts, one_thread, push, row_seed, window_keep
from gptlab.inference.speculate import Lookup, Prediction, Tally, propose, verify_proposals
from gptlab.model import KVCache


_MASKER: ThreadPoolExecutor | None = None  # one worker thread computes grammar masks while the model runs a step
OVERLAP_MASKS = True  # grammar masks computed on a worker thread while the model runs a step (False: between steps)


def overlap_masks() -> bool:
    """Whether grammar masks are computed while the model runs a step (both let go of the GIL), so that a step waits
    only for what is left of them after the model; `gptlab bench structured` measures both ways."""
    return OVERLAP_MASKS


class Reference:
    """The reference decoder's state (`generate_uncached`): each row's window (the tokens the model sees) and its
    RowSampler (sample i of a prompt seeded with `row_seed(cfg.seed, i)`). Rows are prompt-major: row r continues
    prompt r // num_samples."""

    def __init__(self, model: InferenceModel | nn.Module, prompts: Sequence[Sequence[int]], cfg: SampleConfig,
                 num_samples: int, steer: Steer | None = None):
        model = self.model = as_inference(model).model
        check_prompts(model, prompts, num_samples)
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self.block_size = model.config.block_size
        self.keep = window_keep(self.block_size)
        self.windows = [list(p[-self.block_size:]) for p in prompts for _ in range(num_samples)]
        vocab = model.config.vocab_size
        self.samplers = [RowSampler(cfg, row_seed(cfg.seed, r % num_samples), w, vocab, self.device, steer)
                         for r, w in enumerate(self.windows)]

    def tensor(self, ids: Sequence) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def choose(self, logits: torch.Tensor) -> list[int | None]:
        """Next ids (R) from last-position logits (R, V), None for a row whose grammar is complete; appends them to
        the windows, sliding the full ones."""
        with one_thread():
            ids = [None if s.finished else s.choose(logits[r:r + 1]) for r, s in enumerate(self.samplers)]
        for window, i in zip(self.windows, ids):
            if i is not None:
                push(window, i, self.block_size, self.keep)
        return ids


def generate_batch(model: InferenceModel | nn.Module, prompts: Sequence[Sequence[int]], cfg: SampleConfig,
                   num_samples: int = 1, prefix_cache: PrefixCache | None = None,
                   steer: Steer | None = None) -> Iterator[list[int | None]]:
    """Yield, for each new position, the next token id of every row: len(prompts) * num_samples ids, prompt-major
    (row r continues prompts[r // num_samples]), up to cfg.max_new_tokens positions; with a grammar (`steer`), None
    for a row whose grammar is complete (it has ended), and the positions stop once every row has ended. Decoded by a `RunningBatch`,
    the server's path: each prompt goes through the prompt pass alone (reusing `prefix_cache`'s blocks) and is
    shared by its samples, so every row gives bitwise what it gives alone or in the server beside any others.
    A prompt longer than the context keeps its last block_size tokens. Raises GptlabError (at the call, not at the
    first token) for an empty prompt, ids outside the vocabulary, or num_samples < 1; a row whose grammar allows no
    token the model has raises DeadEnd (a GptlabError) when it gets there."""
    batch = RunningBatch(model, prefix_cache)
    for prompt in prompts:
        batch.join(prompt, cfg, num_samples, steer=steer)
    return _decode_running(batch, cfg.max_new_tokens)


def _decode_running(batch: RunningBatch, steps: int) -> Iterator[list[int | None]]:
    """Position by position: a row that drew several tokens at once (speculation, a forced run) waits with them for
    the others; a row whose grammar is complete gives None."""
    rows = list(batch.rows)
    ready: dict[Row, deque[int]] = {row: deque() for row in rows}
    for step in range(steps):
        if all(row.finish and not ready[row] for row in rows):
            return
        if not all(ready[row] or row.finish for row in rows):
            if step:  # (no logits are needed after the last token)
                batch.advance()
            for row, token, _ in batch.sample():
                ready[row].append(token)
            failed = next((row.error for row in rows if row.error), None)
            if failed is not None:
                raise DeadEnd(failed)
        yield [ready[row].popleft() if ready[row] else None for row in rows]


def generate(model: InferenceModel | nn.Module, prompt: Sequence[int], cfg: SampleConfig,
             num_samples: int = 1, prefix_cache: PrefixCache | None = None,
             steer: Steer | None = None) -> Iterator[list[int | None]]:
    """`generate_batch` for one prompt: yields the `num_samples` next ids of each new position."""
    return generate_batch(model, [prompt], cfg, num_samples, prefix_cache, steer)


def generate_uncached(model: InferenceModel | nn.Module, prompts: Sequence[Sequence[int]], cfg: SampleConfig,
                      num_samples: int = 1, steer: Steer | None = None) -> Iterator[list[int | None]]:
    """The reference for `generate_batch` (same arguments, rows, window policy and yields): no cache, every step
    recomputes each row's whole window through the model's forward, rows of equal window length together, others
    one by one (an InferenceModel's decoder is not used); a grammar's forced tokens one position at a time."""
    return _decode_uncached(Reference(model, prompts, cfg, num_samples, steer))


@torch.inference_mode()
def _decode_uncached(state: Reference) -> Iterator[list[int | None]]:
    model = state.model
    for _ in range(state.cfg.max_new_tokens):
        if all(s.finished for s in state.samplers):
            return
        if len({len(w) for w in state.windows}) == 1:
            logits, _ = model(state.tensor(state.windows), last_only=True)
        else:
            logits = torch.cat([model(state.tensor([w]), last_only=True)[0] for w in state.windows])
        yield state.choose(logits[:, -1])


# ---- continuous batching -----------------------------------------------------------------------------------------

@dataclass(eq=False)
class Row:
    """One sequence of a RunningBatch: its window, its sampler, how many tokens it may still generate, the logits
    (1, V) its next token will be drawn from, and how many cache positions hold its window."""

    window: list[int]
    sampler: RowSampler
    left: int
    logits: torch.Tensor
    filled: int
    need: int  # cache positions this row can ever use
    cached: int = 0  # of its prompt's tokens, how many the prefix cache served
    prompt_logits: torch.Tensor | None = None  # (T, V), where join was asked for them
    lookup: Lookup | None = None  # its proposals, where the batch speculates
    drafts: list[int] = field(default_factory=list)  # the tokens proposed after its newest, checked by the last step
    draft_logits: torch.Tensor | None = None  # (len(drafts), V): the logits after each of them
    forced_run: bool = False  # its drafts are its grammar's forced run (not a speculative proposal)
    finish: str | None = None  # "stop" once its grammar is complete (it has ended, tokens left or not)
    error: str | None = None  # why it ended where its grammar allowed no token the model has


class RunningBatch:
    """Rows that join and leave between decode steps (the server's continuous batching), over one KV cache.

    `join` puts a prompt through the prompt pass alone (gptlab.inference.prefix_cache: fixed chunks, reusing the
    `prefix_cache`'s blocks) and adds its samples; `sample` draws every row's next token (each with its own settings
    and generator); `leave` drops rows (finished, cancelled); `advance` runs one decode step for the rest, first
    laying the cache out afresh if rows joined or left (once per step, however many did: the fused step reads a
    contiguous cache of exactly its rows, so each new layout copies every row's keys and values).
    A row's logits do not depend on the rows beside it: it is prefilled alone, slides alone, is drawn alone, and
    the fused step computes each row's products in the same order at any batch size, one row included
    (tests/test_serve_batching.py). The torch step gives no such guarantee (its products' rounding varies with the
    batch size)."""

    def __init__(self, model: InferenceModel | nn.Module, prefix_cache: PrefixCache | None = None):
        self.prepared = as_inference(model)
        self.model = self.prepared.model
        self.device = next(self.model.parameters()).device
        self.block_size = self.model.config.block_size
        self.keep = window_keep(self.block_size)
        if prefix_cache is not None:
            prefix_cache.check(self.model, self.prepared.cache_dtype)
        self.prefix_cache = prefix_cache
        self.rows: list[Row] = []
        self.cache: KVCache | None = None
        self._slots: dict[Row, int] = {}  # row -> its row in self.cache (a Row hashes by identity)
        self._joining: dict[Row, KVCache] = {}  # row -> its one-row prefill, not laid out yet
        self._moved = False  # rows left since the last layout
        self._spare: KVCache | None = None  # a one-row cache for the next prompt pass (`_one_row`)
        self.tally = Tally()  # tokens its rows proposed and kept (speculation)
        self.forced_in_one_step = True  # a grammar's forced run fed in one step (False: one token a step)
        self.mask_waits: deque[float] = deque(maxlen=1 << 14)  # seconds the last steps waited for grammar masks

    @torch.inference_mode()
    def join(self, prompt: Sequence[int], cfg: SampleConfig, num_samples: int = 1, prompt_logits: bool = False,
             prediction: Sequence[int] | None = None, steer: Steer | None = None) -> list[Row]:
        """Put `prompt` (its last block_size tokens) through the prompt pass and add `num_samples` rows continuing
        it, sample i drawn with `row_seed(cfg.seed, i)`; they take part from the next `sample`. `prompt_logits`:
        every position's logits are computed (no block reused) and kept in the first row's `prompt_logits` (T, V).
        `prediction`: the ids a client predicts the output to be, proposed first (speculation: the same output).
        `steer`: each row's logit_bias and grammar (each row its own Constraint). Raises GptlabError for an empty prompt, ids outside the vocabulary or num_samples < 1."""
        check_prompts(self.model, [prompt], num_samples)
        window = list(prompt[-self.block_size:])
        need = min(self.block_size, len(window) + cfg.max_new_tokens)
        cache = self._one_row()
        logits, hit = prompt_pass(self.model, cache, window, self.prefix_cache, "all" if prompt_logits else "last")
        last = logits[-1:].clone()  # (1, V)
        vocab = self.model.config.vocab_size
        rows = [Row(list(window), RowSampler(cfg, row_seed(cfg.seed, i), window, vocab, self.device, steer),
                    cfg.max_new_tokens, last, len(window), need, hit, lookup=self._lookup(cfg, window, prediction))
                for i in range(num_samples)]
        if prompt_logits and rows:
            rows[0].prompt_logits = logits
        self.rows += rows
        self._joining.update((row, cache) for row in rows)
        return rows

    def _lookup(self, cfg: SampleConfig, window: list[int], prediction: Sequence[int] | None) -> Lookup | None:
        """A row's proposals where it speculates (cfg.speculate "auto", or a prediction) on the fused step (whose
        verify is exact)."""
        if not self.prepared.fused or (cfg.speculate != "auto" and prediction is None):
            return None
        return Lookup(window, self.tally, Prediction(prediction) if prediction is not None else None)

    @torch.inference_mode()
    def prompt_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Every position's logits (T, V) of `prompt` (at most block_size tokens) through the prompt pass, as `join`
        computes them with prompt_logits, without adding a row."""
        check_prompts(self.model, [prompt])
        cache = self._one_row()
        logits = prompt_pass(self.model, cache, list(prompt), self.prefix_cache, "all")[0]
        self._spare = cache
        return logits

    def _one_row(self) -> KVCache:
        """A one-row cache of block_size positions for a prompt pass: the one kept from the last layout (its old
        keys and values are never read: the prompt pass reads only what it wrote or copied), else a new one.
        Reusing it spares a prompt the allocation, as long as a few prompt chunks' products on a CPU."""
        cache, self._spare = self._spare, None
        return cache if cache is not None else self.prepared.new_kv_cache(1)

    @torch.inference_mode()
    def sample(self) -> list[tuple[Row, int, torch.Tensor]]:
        """Draw every row's next token: (row, token id, the logits (1, V) it was drawn from), in row order; a row
        whose proposed tokens the last step checked draws on through them while it draws what was proposed, so it
        may give several tokens, in order, each drawn as it would have been one step at a time."""
        out = []
        with one_thread():
            for row in self.rows:
                out += self._draw(row)
        return out

    def _draw(self, row: Row) -> list[tuple[Row, int, torch.Tensor]]:
        logits, out, kept = row.logits, [], 0
        while row.left > 0:
            try:
                token = row.sampler.choose(logits)
            except DeadEnd as exc:
                row.error, row.left = str(exc), 0
                break
            out.append((row, token, logits))
            row.left -= 1
            push(row.window, token, self.block_size, self.keep)
            if row.sampler.finished:
                row.finish, row.left = "stop", 0
            if kept == len(row.drafts) or token != row.drafts[kept] or row.left <= 0:
                break
            logits = row.draft_logits[kept:kept + 1]  # the proposal was drawn: its key and value are kept
            kept += 1
        if row.lookup is not None:
            row.lookup.update(0 if row.forced_run else len(row.drafts), kept)
            row.lookup.extend(token for _, token, _ in out)
        row.filled += kept
        row.drafts, row.draft_logits = [], None
        return out

    def _prefetch_masks(self) -> Future | None:
        """The constrained rows' next masks, computed on a worker thread while the model runs the step."""
        constraints = [row.sampler.constraint for row in self.rows if row.sampler.constraint is not None]
        if not constraints or not overlap_masks():
            return None
        global _MASKER
        if _MASKER is None:
            _MASKER = ThreadPoolExecutor(1, thread_name_prefix="gptlab-masks")
        return _MASKER.submit(lambda: [c.prefetch() for c in constraints])

    def _wait(self, masks: Future | None) -> None:
        """Wait for the masks computed while the step ran; the seconds waited after the step are kept in
        `mask_waits` (what the masks add to a step: `gptlab bench structured`)."""
        if masks is not None:
            start = time.perf_counter()
            masks.result()
            self.mask_waits.append(time.perf_counter() - start)

    def _proposal(self, row: Row, limit: int) -> list[int]:
        """What a row proposes after its newest token: the rest of its grammar's forced run (fed in this one step
        where `forced_in_one_step`), else its lookup's proposal, cut where its grammar would refuse it."""
        c = row.sampler.constraint
        row.forced_run = bool(c is not None and c.queue and self.forced_in_one_step and limit > 0)
        if row.forced_run:
            return list(c.queue)[:limit]
        proposal = row.lookup.propose(limit) if row.lookup is not None else []
        return proposal[:c.valid_prefix(proposal)] if c is not None else proposal

    def leave(self, rows: Sequence[Row]) -> None:
        """Drop `rows`; their cache rows are freed at the next `advance`."""
        gone = set(rows)
        if any(r in gone for r in self.rows):
            self.rows = [r for r in self.rows if r not in gone]
            for row in gone:
                self._joining.pop(row, None)
            self._moved = True

    @torch.inference_mode()
    def advance(self) -> None:
        """Drop the rows with no tokens left, then run one decode step for the others (each row's newest token)."""
        self.leave([r for r in self.rows if r.left <= 0])
        if self._moved or self._joining:
            self._relayout()
        if not self.rows:
            return
        for i, row in enumerate(self.rows):
            if row.filled >= len(row.window):
                row.filled = self._rebuild_row(i, row.window)
        if self.prepared.fused and any(row.lookup is not None or row.sampler.constraint is not None
                                       for row in self.rows) and propose(self.rows, self.cache, self._proposal):
            masks = self._prefetch_masks()
            verify_proposals(self.prepared.decoder, self.rows, self.cache)
            return self._wait(masks)
        ids = [row.window[-1] for row in self.rows]
        decoder = self.prepared.decoder_for(self.cache)
        masks = self._prefetch_masks()
        # one copy of all rows' logits: the fused step's buffer is reused by the next step
        logits = decoder.step(torch.tensor(ids, dtype=torch.long, device=self.device), self.cache).clone()
        self._wait(masks)
        for i, row in enumerate(self.rows):
            row.logits = logits[i:i + 1]
            row.filled += 1

    def _relayout(self) -> None:
        """Make the cache hold exactly self.rows in order: each row's filled positions copied from the old cache
        or from its one-row prompt pass."""
        rows, cache = self.rows, None
        if rows:
            cache = self.prepared.new_kv_cache(len(rows), max_len=max(r.need for r in rows))
            for i, row in enumerate(rows):
                source, j = (self._joining[row], 0) if row in self._joining else (self.cache, self._slots[row])
                n = row.filled
                cache.k[:, i, :, :n] = source.k[:, j, :, :n]
                cache.v[:, i, :, :n] = source.v[:, j, :, :n]
                cache.pos[i] = n
        self.cache = cache
        self._slots = {row: i for i, row in enumerate(rows)}
        if self._joining:
            self._spare = next(iter(self._joining.values()))  # copied out now: the next prompt pass may reuse it
        self._joining, self._moved = {}, False

    def _rebuild_row(self, row: int, window: list[int]) -> int:
        """Refill cache row `row` from all but the newest token of its slid window, through the prompt pass (alone,
        so a row's rebuild is the same whichever rows slide beside it); returns its filled positions."""
        fresh = self.prepared.new_kv_cache(1, max_len=self.keep)
        if self.keep > 1:
            prompt_pass(self.model, fresh, window[:-1], self.prefix_cache, "none")
        self.cache.replace_rows(torch.tensor([row], device=self.device), fresh)
        return len(window) - 1
