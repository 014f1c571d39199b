"""Scoring a text (gptlab.evaluate) against a hand computation: every token after the first predicted once, from
the tokens of its own window before it (windows of block_size + 1 tokens overlapping by one), each -log p taken
from the model's plain forward on that context alone; the totals divided by the text's characters and by its
UTF-8 bytes, on text where the two differ (é is 2 bytes, 中 3, 😀 4)."""

import math
import statistics
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.config import ModelConfig
from gptlab.data import load_dataset, prepare
from gptlab.evaluate import score_files, score_split, total_nats
from gptlab.model import GPT
from gptlab.tokenizer import CharTokenizer

TEXT = "Café 中文 😀 naïve — déjà vu à 東京!\n" * 3  # 3 times 32 characters, more bytes than characters
TOKENIZER = CharTokenizer(TEXT)


@lru_cache
def moved_model(block_size: int) -> GPT:
    """A GPT whose every parameter is moved off its initial value (its predictions far from uniform, so that
    scoring the wrong token or context changes the total), for TOKENIZER's vocabulary."""
    torch.manual_seed(block_size)
    model = GPT(ModelConfig(vocab_size=TOKENIZER.vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=24,
                            dropout=0.0)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


@torch.no_grad()
def per_token_nats(model: GPT, ids: list[int]) -> list[float]:
    """-log p(ids[i] | its context) for each i >= 1, one forward per token: token i sits in window
    k = (i - 1) // T (tokens k T .. k T + T) and is read from the tokens of that window before it."""
    T = model.config.block_size
    out = []
    for i in range(1, len(ids)):
        start = (i - 1) // T * T
        logits, _ = model(torch.tensor([ids[start:i]]))
        out.append(-torch.log_softmax(logits[0, -1].double(), dim=-1)[ids[i]].item())
    return out


def nats_by_hand(model: GPT, ids: list[int]) -> float:
    return sum(per_token_nats(model, ids))


def test_the_nats_of_a_text_are_every_tokens_minus_log_p_from_its_window():
    model = moved_model(8)
    ids = TOKENIZER.encode(TEXT)
    each = per_token_nats(model, ids)
    expected = sum(each)
    for batch_size in (1, 3, 16):  # a batch each window, a ragged last batch, one batch for everything
        nats, count = total_nats(model, ids, batch_size=batch_size)
        assert count == len(ids) - 1 == 95
        assert nats == pytest.approx(expected, rel=1e-5)
    assert statistics.pstdev(each) > 0.5  # tokens differ: scoring a wrong token or context changes the total


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 40), block_size=st.sampled_from([1, 4, 7]), offset=st.integers(0, 50))
def test_any_length_and_context_scores_each_token_after_the_first_once(n, block_size, offset):
    """Lengths around every window edge (n - 1 a multiple of block_size or not), block size 1 included."""
    model = moved_model(block_size)
    ids = TOKENIZER.encode(TEXT)[offset:offset + n]
    nats, count = total_nats(model, ids, batch_size=2)
    assert count == len(ids) - 1
    assert nats == pytest.approx(nats_by_hand(model, ids), rel=1e-5, abs=1e-6)


def test_bits_per_byte_count_utf8_bytes_and_bits_per_char_characters(tmp_path):
    model = moved_model(8)
    path = tmp_path / "text.txt"
    path.write_bytes(TEXT.encode("utf-8"))
    (score,) = score_files(model, TOKENIZER, [str(path)], batch_size=4)
    nats = nats_by_hand(model, TOKENIZER.encode(TEXT))
    # 32 characters a line, of which é ï é à à take 2 bytes, 中 文 — 東 京 3 and 😀 4
    chars, n_bytes = 96, 3 * (32 + 5 * 1 + 5 * 2 + 3)
    assert (len(TEXT), len(TEXT.encode())) == (chars, n_bytes) and n_bytes > chars
    assert (score.tokens, score.chars, score.bytes) == (95, chars, n_bytes)
    assert score.loss == pytest.approx(nats / 95, rel=1e-5)
    assert score.perplexity == pytest.approx(math.exp(nats / 95), rel=1e-5)
    assert score.bits_per_token == pytest.approx(nats / 95 / math.log(2), rel=1e-5)
    assert score.bits_per_char == pytest.approx(nats / math.log(2) / chars, rel=1e-5)
    assert score.bits_per_byte == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


def test_a_data_folders_validation_split_is_scored_over_its_own_bytes(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT * 10, encoding="utf-8")
    prepare([str(tmp_path / "corpus.txt")], tmp_path / "data", "char", val_fraction=0.3, quiet=True)
    data = load_dataset(tmp_path / "data")
    model = moved_model(8)
    ids = data.val.tolist()
    val_text = "".join(data.tokenizer.chars[i] for i in ids)  # a char token is its one character
    score = score_split(model, data.tokenizer, tmp_path / "data", batch_size=4)
    assert len(val_text.encode()) > len(val_text)
    assert (score.chars, score.bytes) == (len(val_text), len(val_text.encode()))
    assert score.tokens == len(ids) - 1
    assert score.bits_per_byte == pytest.approx(nats_by_hand(model, ids) / math.log(2) / len(val_text.encode()),
                                                rel=1e-5)
