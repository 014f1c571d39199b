"""Tracing: the GPT's own forward run with its hook points open (hooks.py), keeping what it computes.

With no hook the model's forward keeps its fast paths; a trace taps it, so the attention is the equation itself,
softmax(QK^T / sqrt(D) + mask) V, written out in model.py, and the probabilities are exact (eval mode, no dropout:
a trace is an inference). Letters as in model.py: B batch, T positions, C channels, H heads, D head_dim, V
vocabulary, L layers.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptlab.config import SampleConfig
from gptlab.engine import generate
from gptlab.errors import GptlabError
from gptlab.inspect.hooks import Hooked
from gptlab.model import GPT, is_gpt, layer_norm
from gptlab.plots import escape
from gptlab.tokenizer import Tokenizer


@dataclass
class Trace:
    """What one forward computed, for ids (B, T).

    residual[l] (B, T, C) is the residual stream entering block l (residual[0]: token + position embeddings) and
    residual[L] what leaves the last block, before ln_f; after_attention[l] is block l's stream after its attention
    has been added (x + attn(ln_1(x))), before the MLP. attn_out[l] / mlp_out[l] are what attention / the MLP of
    block l add to the stream. attention[l] (B, H, T, T): row i is where query i looks, exactly 0 above the diagonal.
    logits (B, T, V) are the model's logits.
    """

    ids: torch.Tensor
    residual: list[torch.Tensor]
    after_attention: list[torch.Tensor]
    attn_out: list[torch.Tensor]
    mlp_out: list[torch.Tensor]
    attention: list[torch.Tensor]
    logits: torch.Tensor

    @property
    def n_layer(self) -> int:
        return len(self.attention)


def check_traceable(model: torch.nn.Module) -> GPT:
    """The model as a GPT; GptlabError for the bigram baseline, which has no attention or residual stream."""
    if not is_gpt(model):
        raise GptlabError(f"this run's model is a {type(model).__name__}: it has no attention or residual stream to "
                          "look inside; inspect a GPT run")
    return model


def check_length(model: GPT, n_tokens: int, what: str = "the prompt", fix: str = "give a shorter prompt") -> None:
    """GptlabError when n_tokens does not fit the model's context (a trace is never truncated silently)."""
    if n_tokens == 0:
        raise GptlabError("the prompt is empty: give some text to look at")
    if n_tokens > model.config.block_size:
        raise GptlabError(f"{what} is {n_tokens} tokens but the model's context is {model.config.block_size}; {fix}")


TRACED = ("hook_resid_pre", "hook_resid_mid", "hook_attn_out", "hook_mlp_out", "attn.hook_pattern", "hook_resid_post")


@torch.no_grad()
def trace(model: torch.nn.Module, ids: torch.Tensor | Sequence[int]) -> Trace:
    """Run `model` (a GPT) on ids (B, T) or one sequence, keeping every layer's attention probabilities and the
    residual stream (read at the model's own hook points); returns a Trace. Raises GptlabError for a model without
    attention (bigram), an empty input or one longer than the context."""
    gpt = check_traceable(model)
    device = gpt.transformer.wte.weight.device
    ids = torch.as_tensor(ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids  # (B, T)
    check_length(gpt, ids.size(1))
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < gpt.config.vocab_size:
        raise GptlabError(f"token ids must be in [0, {gpt.config.vocab_size}): use the run's tokenizer")
    logits, cache = Hooked(gpt).run_with_cache(ids, lambda name: name.endswith(TRACED))
    layers = range(gpt.config.n_layer)

    def each(point: str) -> list[torch.Tensor]:
        return [cache[f"blocks.{i}.{point}"] for i in layers]
    return Trace(ids, each("hook_resid_pre") + each("hook_resid_post")[-1:], each("hook_resid_mid"),
                 each("hook_attn_out"), each("hook_mlp_out"), each("attn.hook_pattern"), logits)


@torch.no_grad()
def logit_lens(model: torch.nn.Module, tr: Trace) -> torch.Tensor:
    """The logit lens: ln_f and the LM head applied to the residual stream at every depth. Returns logits
    (L + 1, B, T, V): row 0 reads the embeddings, row l the stream after block l; row L equals tr.logits."""
    gpt = check_traceable(model)
    same = lambda name, t: t  # (the written-out final LayerNorm, as the traced forward ran it)
    return torch.stack([gpt.lm_head(layer_norm(gpt.transformer.ln_f, x, same, "ln_final")) for x in tr.residual])


def trace_generation(model: torch.nn.Module, prompt: Sequence[int], cfg: SampleConfig) -> Trace:
    """Generate from `prompt` with the KV-cached engine, then trace prompt + generated ids (one row). The total must
    fit the context: GptlabError otherwise, before anything is generated."""
    gpt = check_traceable(model)
    check_length(gpt, len(prompt) + cfg.max_new_tokens, f"the prompt plus {cfg.max_new_tokens} new tokens",
                 "give a shorter prompt or generate fewer tokens")
    new = [row[0] for row in generate(gpt, list(prompt), cfg)]
    return trace(gpt, list(prompt) + new)


VISIBLE = {" ": "␣", "\n": "↵", "\t": "→", "\r": "\\r"}  # whitespace as a picture or a terminal shows it


def visible(ch: str) -> str:
    """ch, or what shows it where it would be invisible or move the cursor: a space, a line break or a tab as a
    symbol (VISIBLE), any other control, format or separator character as its escape."""
    if ch in VISIBLE:
        return VISIBLE[ch]
    return escape(ch) if unicodedata.category(ch)[0] in "CZ" else ch


def token_label(tokenizer: Tokenizer, token: int) -> str:
    """A token as it reads in a table or on a picture: its text with whitespace made visible (space ␣, newline ↵,
    tab →, carriage return \\r) and other control characters escaped (\\x1b), or its bytes as \\xNN where they are
    not whole UTF-8 characters (a byte-level BPE piece); ∅ for a token with no bytes."""
    raw = tokenizer.decode_bytes([token])
    try:
        text = "".join(visible(ch) for ch in raw.decode("utf-8"))
    except UnicodeDecodeError:
        text = "".join(f"\\x{b:02x}" for b in raw)
    return text or "∅"


def token_labels(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    return [token_label(tokenizer, int(i)) for i in ids]


def find_word(tokenizer: Tokenizer, ids: Sequence[int], text: str, word: str) -> int:
    """The position of the last token of the first occurrence of `word` in `text` (encoded as ids): the first
    position where the model has read the whole word. GptlabError when the word is not in the text."""
    start = text.find(word)
    if not word or start < 0:
        raise GptlabError(f"the word {word!r} does not occur in the context {text!r}")
    end = start + len(word)
    for i in range(len(ids)):
        if len(tokenizer.decode(ids[:i + 1])) >= end:
            return i
    raise AssertionError("the decoded context is shorter than the text")


def word_representations(model: torch.nn.Module, tokenizer: Tokenizer, word: str,
                         contexts: Sequence[str]) -> torch.Tensor:
    """The "Apple" experiment's vectors: for each context, `word`'s representation at every depth, (L + 2, N, C).
    Row 0 is the static token embedding wte[token] (no position: the same vector in every context), row 1 the
    residual stream entering block 0 (token + position), row l + 1 the stream after block l. The word is read at
    its last token (see find_word). Raises GptlabError for fewer than two contexts, a context without the word,
    or one longer than the model's context."""
    gpt = check_traceable(model)
    if len(contexts) < 2:
        raise GptlabError("give at least two contexts (--context TEXT --context TEXT ...) to compare the word in")
    rows = []
    for text in contexts:
        ids = tokenizer.encode(text)
        check_length(gpt, len(ids))
        at = find_word(tokenizer, ids, text, word)
        tr = trace(gpt, ids)
        static = gpt.transformer.wte.weight[ids[at]].detach()
        rows.append(torch.stack([static] + [x[0, at] for x in tr.residual]))  # (L + 2, C)
    return torch.stack(rows, dim=1)  # (L + 2, N, C)


def pairwise_cosine(reps: torch.Tensor) -> torch.Tensor:
    """(depths, N, C) -> (depths, N, N) cosine similarities between the contexts at each depth."""
    unit = F.normalize(reps.float(), dim=-1)
    return unit @ unit.transpose(-2, -1)
