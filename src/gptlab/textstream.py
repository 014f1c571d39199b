"""Generated ids as text: each row's `Completion` (UTF-8-safe streaming, the end-of-text token, stop strings held
back until they can be ruled out), and `TextStream` / `complete` over `engine.generate_batch`. The server
(gptlab.serve) keeps one Completion per row of its running batch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch.nn as nn

from gptlab.config import SampleConfig
from gptlab.engine import generate_batch
from gptlab.inference.prefix_cache import PrefixCache
from gptlab.inference.prepared import InferenceModel
from gptlab.inference.rows import Steer
from gptlab.tokenizer import StreamDecoder, Tokenizer


@dataclass
class Completion:
    """One row's generated text as it grows. `text` is what has been released (never a stop string, never half a
    character), `ids` the tokens generated before the end (the end-of-text token not included), `finish_reason`
    None while generating, then "stop" (a stop string appeared; it and everything after it is cut), "eot" (the
    end-of-text token, or a chat tokenizer's end of turn) or "length" (max_new_tokens)."""

    tokenizer: Tokenizer = field(repr=False)
    stop: Sequence[str] = ()
    text: str = ""
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self._decoder = StreamDecoder(self.tokenizer)
        self._pending = ""  # decoded but held back: it may be the start of a stop string
        self._ends = self.tokenizer.end_ids

    def push(self, token: int) -> str:
        """Take one generated token; return the text that is now safe to show ("" once finished)."""
        if self.finish_reason is not None:
            return ""
        if token in self._ends:  # end-of-text, or a chat turn's end
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
    ids and finish reason. Rows (and `prefix_cache`, `steer`: logit_bias and a grammar) are as in `generate_batch`."""

    def __init__(self, model: InferenceModel | nn.Module, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                 cfg: SampleConfig, num_samples: int = 1, prefix_cache: PrefixCache | None = None,
                 steer: Steer | None = None):
        self._ids = generate_batch(model, prompts, cfg, num_samples, prefix_cache, steer)
        self.completions = [Completion(tokenizer, cfg.stop) for _ in range(len(prompts) * num_samples)]

    def __iter__(self) -> Iterator[list[str]]:
        for ids in self._ids:
            # None: the row's grammar is complete (it ends there, as a stop string ends a row)
            yield [row.push(i) if i is not None else row.close("stop") for row, i in zip(self.completions, ids)]
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
