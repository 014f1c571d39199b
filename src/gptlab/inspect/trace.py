"""Tracing: the GPT's forward written out once more, over the model's own weights, keeping what it computes.

The model's forward (model.py) stays as it is, fast paths and all: tracing never hooks into it, so a training step
runs the same code and gives the same result whether or not anything is traced. Here the attention is the
equation itself, softmax(QK^T / sqrt(D) + mask) V, so the probabilities are exact (no dropout: a trace is an
inference). Letters as in model.py: B batch, T positions, C channels, H heads, D head_dim, V vocabulary, L layers.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptlab.config import SampleConfig
from gptlab.engine import generate
from gptlab.errors import GptlabError
from gptlab.model import GPT, is_gpt
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


def _attention(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block's attention on the normed stream x (B, T, C): (what it adds to the stream, probabilities (B, H, T, T))."""
    attn = block.attn
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q = q.view(B, T, attn.n_head, attn.head_dim).transpose(1, 2)  # (B, H, T, D)
    k = k.view(B, T, attn.n_head, attn.head_dim).transpose(1, 2)  # (B, H, T, D)
    v = v.view(B, T, attn.n_head, attn.head_dim).transpose(1, 2)  # (B, H, T, D)
    scores = (q * (1.0 / math.sqrt(attn.head_dim))) @ k.transpose(-2, -1)  # (B, H, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # key j hidden from query i iff j > i
    probs = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)  # exp(-inf) = 0: exactly 0 above
    y = (probs @ v).transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
    return attn.c_proj(y), probs


def _mlp(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    mlp = block.mlp
    return mlp.c_proj(mlp.gelu(mlp.c_fc(x)))  # C -> 4C -> C, no dropout


@torch.no_grad()
def trace(model: torch.nn.Module, ids: torch.Tensor | Sequence[int]) -> Trace:
    """Run `model` (a GPT) on ids (B, T) or one sequence, keeping every layer's attention probabilities and the
    residual stream; returns a Trace. Raises GptlabError for a model without attention (bigram), an empty input
    or one longer than the context."""
    gpt = check_traceable(model)
    device = gpt.transformer.wte.weight.device
    ids = torch.as_tensor(ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids  # (B, T)
    check_length(gpt, ids.size(1))
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < gpt.config.vocab_size:
        raise GptlabError(f"token ids must be in [0, {gpt.config.vocab_size}): use the run's tokenizer")
    pos = torch.arange(ids.size(1), device=device)  # (T,)
    x = gpt.transformer.wte(ids) + gpt.transformer.wpe(pos)  # (B, T, C)
    out = Trace(ids, [x], [], [], [], [], torch.empty(0))
    for block in gpt.transformer.h:
        added, probs = _attention(block, block.ln_1(x))
        x = x + added
        out.attn_out.append(added)
        out.attention.append(probs)
        out.after_attention.append(x)
        added = _mlp(block, block.ln_2(x))
        x = x + added
        out.mlp_out.append(added)
        out.residual.append(x)
    out.logits = gpt.lm_head(gpt.transformer.ln_f(x))  # (B, T, V)
    return out


@torch.no_grad()
def logit_lens(model: torch.nn.Module, tr: Trace) -> torch.Tensor:
    """The logit lens: ln_f and the LM head applied to the residual stream at every depth. Returns logits
    (L + 1, B, T, V): row 0 reads the embeddings, row l the stream after block l; row L equals tr.logits."""
    gpt = check_traceable(model)
    return torch.stack([gpt.lm_head(gpt.transformer.ln_f(x)) for x in tr.residual])


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
