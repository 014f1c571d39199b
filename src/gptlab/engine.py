"""Autoregressive generation: prefill the prompts once, then decode one token at a time from the KV cache.

Two layers here, each usable alone, over a model made fast to run by the inference wing
(`gptlab.inference.prepare_for_inference`: packed weights, the decode step, the KV cache's precision):

- `generate_batch` / `generate` see only token ids: prompts of different lengths in one batch (each row keeps its
  own position), `num_samples` continuations of each prompt from one prefill, yielding ids as they come.
- `TextStream` turns those ids into text: UTF-8-safe streaming, the end-of-text token, stop strings.

Each takes an `InferenceModel` or a plain model, which runs as it is, decoded by the torch step (`as_inference`).

The sliding window. Learned positions cannot be shifted, so when a row's window is full (block_size tokens) and
one more token arrives, the row's window becomes its last `keep` tokens (`window_keep`: 3/4 of block_size) and
its cache rows are rebuilt from them: one rebuild every block_size - keep + 1 new tokens, every token seeing at
least `keep` tokens of context (if the prompt had that many). The reference `generate_uncached` recomputes the
same window from scratch each step, so under greedy decoding the two give the same ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gptlab.config import SampleConfig
from gptlab.errors import GptlabError
from gptlab.inference import InferenceModel, TorchStep, as_inference
from gptlab.model import KVCache
from gptlab.sampling import next_token
from gptlab.tokenizer import StreamDecoder, Tokenizer


def window_keep(block_size: int) -> int:
    """How many trailing tokens a row's window keeps when it slides."""
    return max(1, block_size * 3 // 4)


# ---- token ids ---------------------------------------------------------------------------------------------------

class Generation:
    """State shared by the cached and the reference decoder: each row's window (the tokens the model sees), the
    penalty counts (each row's prompt, up to its last block_size tokens, and every token generated since) and the
    generator. Rows are prompt-major: row r continues prompt r // num_samples. `model` is the torch module that
    prompts go through, `prepared` the InferenceModel (its decoder and cache precision) it belongs to."""

    def __init__(self, model: InferenceModel | nn.Module, prompts: Sequence[Sequence[int]], cfg: SampleConfig,
                 num_samples: int):
        if num_samples < 1:
            raise GptlabError(f"num_samples must be >= 1, not {num_samples}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GptlabError("the prompt is empty and this model has no start token; give a --prompt")
        self.prepared = as_inference(model)
        model = self.model = self.prepared.model
        vocab = model.config.vocab_size
        bad = next((i for p in prompts for i in p if not 0 <= i < vocab), None)
        if bad is not None:
            raise GptlabError(f"token id {bad} is outside the model's vocabulary of {vocab}; use the run's tokenizer")
        self.cfg, self.num_samples = cfg, num_samples
        self.device = next(model.parameters()).device
        self.block_size = model.config.block_size
        self.keep = window_keep(self.block_size)
        self.windows = [list(p[-self.block_size:]) for p in prompts for _ in range(num_samples)]
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed)
        self.counts = None
        if cfg.repetition_penalty != 1.0 or cfg.frequency_penalty or cfg.presence_penalty:
            self.counts = torch.zeros(len(self.windows), vocab, dtype=torch.long, device=self.device)
            for row, window in enumerate(self.windows):
                ids = self.tensor(window)
                self.counts[row].index_add_(0, ids, torch.ones_like(ids))

    def tensor(self, ids: Sequence) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Next ids (R,) from last-position logits (R, V); appends them to the windows, sliding the full ones."""
        ids = next_token(logits, self.cfg, self.generator, self.counts)
        if self.counts is not None:
            self.counts[torch.arange(len(ids), device=self.device), ids] += 1
        for window, i in zip(self.windows, ids.tolist()):
            window.append(i)
            if len(window) > self.block_size:
                del window[:-self.keep]
        return ids


def _prefill(model: nn.Module, cache: KVCache, windows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Fill an empty cache with each row's window; returns the next-token logits (R, V). Rows of equal length go in
    one pass; ragged rows are right-padded: all but their last token in one pass, then the last tokens as one step
    at each row's own position (the padding is never attended to)."""
    lengths = [len(w) for w in windows]
    if len(set(lengths)) == 1:
        logits, _ = model(torch.tensor(windows, device=device), kv_cache=cache, last_only=True)
        return logits[:, -1]
    longest = max(lengths) - 1
    padded = [w[:-1] + [0] * (longest - len(w) + 1) for w in windows]  # (R, longest)
    model(torch.tensor(padded, device=device), kv_cache=cache, last_only=True)
    cache.pos.copy_(torch.tensor(lengths, device=device) - 1)
    logits, _ = model(torch.tensor([w[-1:] for w in windows], device=device), kv_cache=cache, last_only=True)
    return logits[:, -1]


def _slide(model: nn.Module, cache: KVCache, state: Generation, filled: list[int]) -> None:
    """Rebuild the cache rows whose window slid (their cache holds as many positions as the window has tokens)
    from all but the window's newest token, which the next decode step then adds like any other row's."""
    rows = [r for r, (n, w) in enumerate(zip(filled, state.windows)) if n >= len(w)]
    if not rows:
        return
    fresh = model.new_kv_cache(len(rows), dtype=cache.k.dtype, max_len=state.keep)
    if state.keep > 1:
        prefix = [state.windows[r][:-1] for r in rows]  # (len(rows), keep - 1): all full windows slide alike
        model(state.tensor(prefix), kv_cache=fresh, last_only=True)
    cache.replace_rows(state.tensor(rows), fresh)
    for r in rows:
        filled[r] = len(state.windows[r]) - 1


def generate_batch(model: InferenceModel | nn.Module, prompts: Sequence[Sequence[int]], cfg: SampleConfig,
                   num_samples: int = 1) -> Iterator[list[int]]:
    """Yield, for each new position, the next token id of every row: len(prompts) * num_samples ids, prompt-major
    (row r continues prompts[r // num_samples]), up to cfg.max_new_tokens positions. Each prompt is prefilled
    once and shared by its samples; prompts may differ in length, and each row gives the ids its prompt would give
    alone (exactly under greedy decoding). A prompt longer than the context keeps its last block_size tokens.
    Raises GptlabError (at the call, not at the first token) for an empty prompt, ids outside the vocabulary, or
    num_samples < 1."""
    return _decode_cached(Generation(model, prompts, cfg, num_samples))


@torch.inference_mode()
def _decode_cached(state: Generation) -> Iterator[list[int]]:
    model, n = state.model, state.num_samples
    firsts = state.windows[::n]
    longest = min(state.block_size, max(len(w) for w in firsts) + state.cfg.max_new_tokens)
    # only as long as this generation can get: zeroing a cache of block_size positions costs time
    cache = state.prepared.new_kv_cache(len(firsts), max_len=longest)
    logits = _prefill(model, cache, firsts, state.device)
    if n > 1:
        cache = cache.repeat_rows(n)
        logits = logits.repeat_interleave(n, dim=0)
    filled = [len(w) for w in state.windows]  # cache positions of each row, tracked here to avoid host syncs
    decoder = state.prepared.decoder
    decoder = decoder if decoder.accepts(cache) else TorchStep(model)
    for step in range(state.cfg.max_new_tokens):
        ids = state.choose(logits)
        yield ids.tolist()
        if step + 1 == state.cfg.max_new_tokens:
            break  # no logits needed after the last token
        _slide(model, cache, state, filled)
        logits = decoder.step(ids, cache)  # (R, V)
        filled = [k + 1 for k in filled]


def generate(model: InferenceModel | nn.Module, prompt: Sequence[int], cfg: SampleConfig,
             num_samples: int = 1) -> Iterator[list[int]]:
    """`generate_batch` for one prompt: yields the `num_samples` next ids of each new position."""
    return generate_batch(model, [prompt], cfg, num_samples)


def generate_uncached(model: InferenceModel | nn.Module, prompts: Sequence[Sequence[int]], cfg: SampleConfig,
                      num_samples: int = 1) -> Iterator[list[int]]:
    """The reference for `generate_batch` (same arguments, rows, window policy and yields): no cache, every step
    recomputes each row's whole window through the model's forward, rows of equal window length together, others
    one by one (an InferenceModel's decoder is not used)."""
    return _decode_uncached(Generation(model, prompts, cfg, num_samples))


@torch.inference_mode()
def _decode_uncached(state: Generation) -> Iterator[list[int]]:
    model = state.model
    for _ in range(state.cfg.max_new_tokens):
        if len({len(w) for w in state.windows}) == 1:
            logits, _ = model(state.tensor(state.windows), last_only=True)
        else:
            logits = torch.cat([model(state.tensor([w]), last_only=True)[0] for w in state.windows])
        yield state.choose(logits[:, -1]).tolist()


# ---- text --------------------------------------------------------------------------------------------------------

@dataclass
class Completion:
    """One row's generated text as it grows. `text` is what has been released (never a stop string, never half a
    character), `ids` the tokens generated before the end (the end-of-text token not included), `finish_reason`
    None while generating, then "stop" (a stop string appeared; it and everything after it is cut), "eot" (the
    end-of-text token) or "length" (max_new_tokens)."""

    tokenizer: Tokenizer = field(repr=False)
    stop: Sequence[str] = ()
    text: str = ""
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self._decoder = StreamDecoder(self.tokenizer)
        self._pending = ""  # decoded but held back: it may be the start of a stop string

    def push(self, token: int) -> str:
        """Take one generated token; return the text that is now safe to show ("" once finished)."""
        if self.finish_reason is not None:
            return ""
        if token == self.tokenizer.eot_id:
            return self.close("eot")
        self.ids.append(token)
        return self._release(self._decoder.push([token]), final=False)

    def close(self, reason: str = "length") -> str:
        """End the row (if it has not ended); return the rest of its text."""
        if self.finish_reason is not None:
            return ""
        out = self._release(self._decoder.flush(), final=True)
        self.finish_reason = self.finish_reason or reason
        return out

    def _release(self, new: str, final: bool) -> str:
        pending = self._pending + new
        hits = [i for i in (pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self._pending, self.finish_reason = pending[:min(hits)], "", "stop"
        else:
            held = 0 if final else _held_back(pending, self.stop)
            out, self._pending = pending[:len(pending) - held], pending[len(pending) - held:]
        self.text += out
        return out


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string (it cannot be shown yet)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class TextStream:
    """Generation as text. Iterating yields, per step, the newly released text of every row ("" when a row has
    nothing new or has finished) and stops once every row has finished; `completions` then holds each row's text,
    ids and finish reason. Rows are as in `generate_batch`."""

    def __init__(self, model: InferenceModel | nn.Module, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                 cfg: SampleConfig, num_samples: int = 1):
        self._ids = generate_batch(model, prompts, cfg, num_samples)
        self.completions = [Completion(tokenizer, cfg.stop) for _ in range(len(prompts) * num_samples)]

    def __iter__(self) -> Iterator[list[str]]:
        for ids in self._ids:
            yield [row.push(i) for row, i in zip(self.completions, ids)]
            if all(row.finish_reason is not None for row in self.completions):
                self._ids.close()
                return
        yield [row.close("length") for row in self.completions]


def complete(model: InferenceModel | nn.Module, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
             cfg: SampleConfig, num_samples: int = 1) -> list[Completion]:
    """Generate to the end and return every row's Completion."""
    stream = TextStream(model, tokenizer, prompts, cfg, num_samples)
    for _ in stream:
        pass
    return stream.completions
