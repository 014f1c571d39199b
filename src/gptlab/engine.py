"""Autoregressive generation: prefill the prompts once, then decode one token at a time from the KV cache.

Three layers, each usable alone:

- `prepare_for_inference` makes a model fast to run: weights in fp32 or bf16; on a CPU with AVX-512, a fused
  native decode step (gptlab.fastdecode: one call per token for the whole model, since decoding reads every
  weight once per token and how fast those reads go is the speed of generation); on a CPU with oneDNN, every
  Linear pre-packed in oneDNN's blocked layout for the prompts and for steps the fused kernel does not take.
- `generate_batch` / `generate` see only token ids: prompts of different lengths in one batch (each row keeps its
  own position), `num_samples` continuations of each prompt from one prefill, yielding ids as they come.
- `TextStream` turns those ids into text: UTF-8-safe streaming, the end-of-text token, stop strings.

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
import torch.nn.functional as F

from gptlab.config import SampleConfig
from gptlab.errors import GptlabError
from gptlab.fastdecode import fused_decoder, move_to_huge_pages
from gptlab.model import KVCache
from gptlab.runtime import bf16_supported
from gptlab.sampling import next_token
from gptlab.tokenizer import StreamDecoder, Tokenizer

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def window_keep(block_size: int) -> int:
    """How many trailing tokens a row's window keeps when it slides."""
    return max(1, block_size * 3 // 4)


# ---- fast weights ------------------------------------------------------------------------------------------------

class InferenceLinear(nn.Module):
    """y = x W^T + b, like the nn.Linear it replaces, with W pre-packed in oneDNN's blocked layout for this CPU.

    Used for prompts and window rebuilds, and for decoding where the fused step (gptlab.fastdecode) is not
    available: decoding reads every weight once per token, so these reads are its time. On a 2-core AMD EPYC
    (`gptlab bench generate`, docs/benchmarks.md) packed products of one row take less time than F.linear
    in fp32 and in bf16, and several rows (batches, prompts) gain more. W is packed for MIN_ROWS rows, the layout
    that suits batches; a single row is padded to MIN_ROWS, which measured faster than giving that layout one row.
    Inference only: the packed weight is not a parameter."""

    MIN_ROWS = 4

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), self.MIN_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows >= self.MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        padded = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, self.MIN_ROWS - rows))  # (MIN_ROWS, in)
        y = torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")
        return y[:rows].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can run packed Linears of `dtype` on `device` (a CPU with torch's oneDNN build)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):  # oneDNN's packed Linear, as torch.compile uses it
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_supported(device))


@torch.no_grad()
def prepare_for_inference(model: nn.Module, precision: str = "fp32", fused: bool = True,
                          huge_pages: bool = True) -> nn.Module:
    """Make `model` fast to generate with, in place, and return it: eval mode, weights in `precision` ("fp32",
    the reference, or "bf16"), dropout removed, each nn.Linear replaced by an InferenceLinear where oneDNN
    supports it, and a `fused_decoder` (gptlab.fastdecode: the whole decode step in one native call) where the CPU
    and a compiler allow it and `fused` is true (its weights moved into 2 MB pages unless `huge_pages` is false).
    The result still has the model's forward contract but is for inference only: no training, no checkpoint.
    Raises GptlabError for an unknown precision or bf16 on a device without it."""
    if precision not in PRECISIONS:
        raise GptlabError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    dtype = PRECISIONS[precision]
    device = next(model.parameters()).device
    if dtype == torch.bfloat16 and device.type == "cpu" and not bf16_supported(device):
        raise GptlabError("this CPU has no native bf16 support; use --precision fp32")
    model.eval().to(dtype)
    # the fused step decodes from the plain weights (it holds them); prompts and window rebuilds, many rows at a
    # time, go through the packed copies: faster prefills (docs/benchmarks.md), for twice the weights' memory
    if fused and huge_pages:
        move_to_huge_pages(model)  # before the decoder takes its pointers
    model.fused_decoder = fused_decoder(model) if fused else None
    pack = can_pack(device, dtype)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Dropout):
                setattr(module, name, nn.Identity())  # a no-op in eval mode, but a call per use all the same
            elif pack and isinstance(child, nn.Linear):
                setattr(module, name, InferenceLinear(child))  # the tied LM head gets its own packed copy
    return model


def cache_dtype(model: nn.Module) -> torch.dtype:
    """The precision keys and values are stored in: the weights' dtype, except fp32 for a bf16 model on a CPU
    decoded by torch ops (bf16 attention there is several times slower, measured in docs/benchmarks.md); the
    fused step reads a bf16 cache at half the bytes (at batch 8 and a few hundred positions, the cache's bytes
    rival the weights')."""
    weight = next(model.parameters())
    if weight.device.type == "cpu" and getattr(model, "fused_decoder", None) is None:
        return torch.float32
    return weight.dtype


# ---- token ids ---------------------------------------------------------------------------------------------------

class Generation:
    """State shared by the cached and the reference decoder: each row's window (the tokens the model sees), the
    penalty counts (each row's prompt, up to its last block_size tokens, and every token generated since) and the
    generator. Rows are prompt-major: row r continues prompt r // num_samples."""

    def __init__(self, model: nn.Module, prompts: Sequence[Sequence[int]], cfg: SampleConfig, num_samples: int):
        if num_samples < 1:
            raise GptlabError(f"num_samples must be >= 1, not {num_samples}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GptlabError("the prompt is empty and this model has no start token; give a --prompt")
        vocab = model.config.vocab_size
        bad = next((i for p in prompts for i in p if not 0 <= i < vocab), None)
        if bad is not None:
            raise GptlabError(f"token id {bad} is outside the model's vocabulary of {vocab}; use the run's tokenizer")
        self.model, self.cfg, self.num_samples = model, cfg, num_samples
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


def generate_batch(model: nn.Module, prompts: Sequence[Sequence[int]], cfg: SampleConfig,
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
    cache = model.new_kv_cache(len(firsts), dtype=cache_dtype(model), max_len=longest)
    logits = _prefill(model, cache, firsts, state.device)
    if n > 1:
        cache = cache.repeat_rows(n)
        logits = logits.repeat_interleave(n, dim=0)
    filled = [len(w) for w in state.windows]  # cache positions of each row, tracked here to avoid host syncs
    fused = getattr(model, "fused_decoder", None)
    fused = fused if fused is not None and fused.accepts(cache) else None
    for step in range(state.cfg.max_new_tokens):
        ids = state.choose(logits)
        yield ids.tolist()
        if step + 1 == state.cfg.max_new_tokens:
            break  # no logits needed after the last token
        _slide(model, cache, state, filled)
        if fused is not None:
            logits = fused.step(ids, cache)  # (R, V)
        else:
            logits = model(ids[:, None], kv_cache=cache, last_only=True)[0][:, -1]  # (R, V)
        filled = [k + 1 for k in filled]


def generate(model: nn.Module, prompt: Sequence[int], cfg: SampleConfig, num_samples: int = 1) -> Iterator[list[int]]:
    """`generate_batch` for one prompt: yields the `num_samples` next ids of each new position."""
    return generate_batch(model, [prompt], cfg, num_samples)


def generate_uncached(model: nn.Module, prompts: Sequence[Sequence[int]], cfg: SampleConfig,
                      num_samples: int = 1) -> Iterator[list[int]]:
    """The reference for `generate_batch` (same arguments, rows, window policy and yields): no cache, every step
    recomputes each row's whole window, rows of equal window length together, others one by one."""
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

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
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


def complete(model: nn.Module, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]], cfg: SampleConfig,
             num_samples: int = 1) -> list[Completion]:
    """Generate to the end and return every row's Completion."""
    stream = TextStream(model, tokenizer, prompts, cfg, num_samples)
    for _ in stream:
        pass
    return stream.completions
