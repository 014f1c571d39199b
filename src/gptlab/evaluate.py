"""How well a model predicts a text: loss, perplexity, bits per token, per character and per byte."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gptlab.data.batches import load_dataset
from gptlab.data.corpus import read_text
from gptlab.errors import GptlabError
from gptlab.runtime import autocast
from gptlab.tokenizer import Tokenizer


@dataclass
class Score:
    name: str
    tokens: int
    chars: int
    bytes: int
    nats: float  # total cross-entropy over all predicted tokens
    special_tokens: int = 0  # end-of-text and chat markers in the text: tokens, but no characters or bytes of it

    @property
    def loss(self) -> float:
        return self.nats / max(self.tokens, 1)

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))

    @property
    def bits_per_token(self) -> float:
        return self.loss / math.log(2)

    @property
    def bits_per_char(self) -> float:
        return self.nats / math.log(2) / max(self.chars, 1)

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / max(self.bytes, 1)

    def as_dict(self) -> dict[str, str | int | float]:
        """The counts and every measure (`gptlab eval --json`): text, tokens, chars, bytes, special_tokens, loss,
        perplexity, bits_per_token, bits_per_char, bits_per_byte."""
        return {"text": self.name, "tokens": self.tokens, "chars": self.chars, "bytes": self.bytes,
                "special_tokens": self.special_tokens,
                "loss": self.loss, "perplexity": self.perplexity, "bits_per_token": self.bits_per_token,
                "bits_per_char": self.bits_per_char, "bits_per_byte": self.bits_per_byte}


@torch.no_grad()
def total_nats(model: torch.nn.Module, tokens: np.ndarray | list[int], batch_size: int = 16,
               precision: str = "fp32") -> tuple[float, int]:
    """Sum of -log p(token | its context) over every token but the first, and how many were predicted.

    The text is cut into windows of block_size + 1 tokens overlapping by one, so every token is predicted
    exactly once from up to block_size tokens of context."""
    device = next(model.parameters()).device
    T = model.config.block_size
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    starts = list(range(0, max(len(ids) - 1, 0), T))
    nats, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        rows = [ids[s:s + T + 1] for s in starts[i:i + batch_size]]
        width = max(len(r) for r in rows)
        x = torch.zeros(len(rows), width - 1, dtype=torch.long)
        y = torch.full((len(rows), width - 1), -1, dtype=torch.long)  # -1: padding, ignored
        for j, r in enumerate(rows):
            x[j, :len(r) - 1], y[j, :len(r) - 1] = r[:-1], r[1:]
        with autocast(device, precision):
            logits, _ = model(x.to(device))
        losses = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), ignore_index=-1,
                                 reduction="sum")
        nats += losses.item()
        count += int((y >= 0).sum())
    return nats, count


def score(model: torch.nn.Module, name: str, tokens: np.ndarray | list[int], tokenizer: Tokenizer,
          batch_size: int = 16, precision: str = "fp32") -> Score:
    """The Score of `tokens`: its nats (total_nats) over the characters and UTF-8 bytes of the text they spell,
    special tokens counted as none (Tokenizer.text_of)."""
    nats, count = total_nats(model, tokens, batch_size, precision)
    text, specials = tokenizer.text_of(np.asarray(tokens).tolist())
    return Score(name, count, len(text), len(text.encode()), nats, specials)


def score_files(model: torch.nn.Module, tokenizer: Tokenizer, files: list[str], encoding: str = "utf-8",
                batch_size: int = 16, precision: str = "fp32") -> list[Score]:
    """A Score for each text file (read by corpus.read_text's rule), the products in `precision` (bf16: autocast;
    an int8 model is passed already quantized, and runs as it is); GptlabError for a file that cannot be read or
    is shorter than 2 tokens."""
    scores = []
    for name in files:
        text = read_text(name, encoding)
        tokens = tokenizer.encode(text, allow_special=True)
        if len(tokens) < 2:
            raise GptlabError(f"{name} is too short to score: it needs at least 2 tokens, it has {len(tokens)}")
        scores.append(score(model, name, tokens, tokenizer, batch_size, precision))
    return scores


def score_split(model: torch.nn.Module, tokenizer: Tokenizer, data_dir: str | Path, batch_size: int = 16,
                source: str = "the model", precision: str = "fp32") -> Score:
    """The Score of a prepared data folder's validation split (products in `precision`, as score_files);
    GptlabError when the data was made with another tokenizer than `tokenizer` (its ids would mean other things to
    the model)."""
    data = load_dataset(data_dir)
    if data.tokenizer.to_dict() != tokenizer.to_dict():
        raise GptlabError(f"{data.path} was tokenized with another tokenizer than {source}'s, so its ids mean other "
                          f"things to the model; prepare the text with --tokenizer-from")
    return score(model, f"{data.path} (val)", data.val, tokenizer, batch_size, precision)
