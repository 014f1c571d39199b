"""Scoring a text (gptlab.evaluate) against a hand computation: every token after the first predicted once, from
the tokens of its own window before it (windows of block_size + 1 tokens overlapping by one), each -log p taken
from the model's plain forward on that context alone; the totals divided by the text's characters and by its
UTF-8 bytes, on text where the two differ (é is 2 bytes, 中 3, 😀 4)."""

import math
import statistics
from contextlib import contextmanager
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.config import ModelConfig
from gptlab.data.batches import load_dataset
from gptlab.data.prepare import prepare
from gptlab.errors import GptlabError
from gptlab.evaluate import Score, score, score_files, score_split, total_nats
from gptlab.model import GPT
from gptlab.tokenizer import EOT, BPETokenizer, CharTokenizer

TEXT = "Café 中文 😀 naïve — déjà vu à 東京!\n" * 3  # 3 times 32 characters, more bytes than characters
TOKENIZER = CharTokenizer(TEXT)


@lru_cache
def moved_model(block_size: int, vocab_size: int = TOKENIZER.vocab_size) -> GPT:
    """A GPT whose every parameter is moved off its initial value (its predictions far from uniform, so that
    scoring the wrong token or context changes the total), for TOKENIZER's vocabulary unless told another."""
    torch.manual_seed(block_size)
    model = GPT(ModelConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=24,
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


def test_a_score_as_json_holds_its_counts_and_every_measure():
    # 10 tokens costing ln 2 nats each over 20 characters in 40 bytes: 1 bit per token, 1/2 per char, 1/4 per byte
    assert Score("t.txt", 10, 20, 40, 10 * math.log(2)).as_dict() == pytest.approx(
        {"text": "t.txt", "tokens": 10, "chars": 20, "bytes": 40, "special_tokens": 0, "loss": math.log(2), "perplexity": 2.0,
         "bits_per_token": 1.0, "bits_per_char": 0.5, "bits_per_byte": 0.25})


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


def prepared(tmp_path):
    """A data folder prepared from TEXT * 10 with the char tokenizer, 30 % of it the validation split."""
    (tmp_path / "corpus.txt").write_text(TEXT * 10, encoding="utf-8")
    prepare([str(tmp_path / "corpus.txt")], tmp_path / "data", "char", val_fraction=0.3, quiet=True)
    return tmp_path / "data"


def text_file(tmp_path, text: str, encoding: str = "utf-8"):
    path = tmp_path / "text.txt"
    path.write_bytes(text.encode(encoding))
    return path


@contextmanager
def forward_record(model: GPT):
    """The rows and logits dtype of each forward the model runs inside the block."""
    calls = []
    handle = model.register_forward_hook(lambda m, args, out: calls.append((args[0].shape[0], out[0].dtype)))
    try:
        yield calls
    finally:
        handle.remove()


def test_by_default_sixteen_windows_share_a_forward_pass(tmp_path):
    """The default batch is the 16 sequences the CLI documents for --batch-size (its memory bound): at block size
    4, TEXT's 95 predictions are 24 windows (16 + 8), and the 288-token split of prepared() 72 (4 x 16 + 8)."""
    model = moved_model(4)
    ids = TOKENIZER.encode(TEXT)
    with forward_record(model) as direct:
        score(model, "text", ids, TOKENIZER)
    with forward_record(model) as files:
        score_files(model, TOKENIZER, [str(text_file(tmp_path, TEXT))])
    data_dir = prepared(tmp_path)
    assert len(load_dataset(data_dir).val) == 288
    with forward_record(model) as split:
        score_split(model, TOKENIZER, data_dir)
    assert [rows for rows, _ in direct] == [rows for rows, _ in files] == [16, 8]
    assert [rows for rows, _ in split] == [16, 16, 16, 16, 8]


def test_bf16_scores_run_the_model_under_bf16_autocast(tmp_path):
    """precision="bf16" reaches the forward (its logits come out in bf16, the fp32 default's in fp32), and the
    totals stay those of the plain fp32 forward to bf16's precision (8 bits of mantissa)."""
    model = moved_model(8)
    path = text_file(tmp_path, TEXT)
    data_dir = prepared(tmp_path)
    with forward_record(model) as bf16:
        (file_score,) = score_files(model, TOKENIZER, [str(path)], batch_size=4, precision="bf16")
        split_score = score_split(model, TOKENIZER, data_dir, batch_size=4, precision="bf16")
    with forward_record(model) as fp32:
        score_files(model, TOKENIZER, [str(path)], batch_size=4)
        score_split(model, TOKENIZER, data_dir, batch_size=4)
    assert {dtype for _, dtype in bf16} == {torch.bfloat16}
    assert {dtype for _, dtype in fp32} == {torch.float32}
    assert file_score.nats == pytest.approx(nats_by_hand(model, TOKENIZER.encode(TEXT)), rel=2e-2)
    assert split_score.nats == pytest.approx(nats_by_hand(model, load_dataset(data_dir).val.tolist()), rel=2e-2)


def test_a_file_is_read_in_the_encoding_given(tmp_path):
    text = "Café naïve, déjà vu à Noël!\n"  # all in latin-1: é ï é à à ë one byte there, two in UTF-8
    tokenizer = CharTokenizer(text)
    model = moved_model(8, tokenizer.vocab_size)
    path = text_file(tmp_path, text, "latin-1")
    assert path.stat().st_size == 28
    (latin,) = score_files(model, tokenizer, [str(path)], encoding="latin-1", batch_size=4)
    assert (latin.tokens, latin.chars, latin.bytes) == (27, 28, 28 + 6)  # its bytes are those of its UTF-8 text
    assert latin.nats == pytest.approx(nats_by_hand(model, [tokenizer.stoi[c] for c in text]), rel=1e-5)
    with pytest.raises(GptlabError, match="text.txt is not valid utf-8"):  # the default, not a silent misreading
        score_files(model, tokenizer, [str(path)])


def test_end_of_text_markers_in_a_file_are_scored_as_the_special_token(tmp_path):
    tokenizer = BPETokenizer.train([TEXT], 300)
    model = moved_model(8, tokenizer.vocab_size)
    first, second = "Café naïve — 東京!\n", "déjà vu à 中文 😀\n"
    path = text_file(tmp_path, first + EOT + second)
    (scored,) = score_files(model, tokenizer, [str(path)], batch_size=2)
    ids = tokenizer.encode(first) + [tokenizer.eot_id] + tokenizer.encode(second)  # the documents apart, one id between
    assert scored.tokens == len(ids) - 1
    assert scored.nats == pytest.approx(nats_by_hand(model, ids), rel=1e-5)


def test_a_file_of_two_tokens_is_scored_and_one_of_fewer_is_refused(tmp_path):
    model = moved_model(8)
    path = text_file(tmp_path, "中文")
    (two,) = score_files(model, TOKENIZER, [str(path)])
    logits, _ = model(torch.tensor([[TOKENIZER.stoi["中"]]]))
    by_hand = -torch.log_softmax(logits[0, -1].double(), dim=-1)[TOKENIZER.stoi["文"]].item()
    assert (two.name, two.tokens, two.chars, two.bytes) == (str(path), 1, 2, 6)
    assert two.nats == pytest.approx(by_hand, rel=1e-5)
    for short in ("東", ""):
        path.write_text(short, encoding="utf-8")
        with pytest.raises(GptlabError, match=f"text.txt is too short to score.*it has {len(short)}"):
            score_files(model, TOKENIZER, [str(path)])


def test_each_files_score_is_named_by_its_path_in_order(tmp_path):
    model = moved_model(8)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    paths = [text_file(tmp_path / "b", TEXT[:40]), text_file(tmp_path / "a", TEXT[40:])]
    scores = score_files(model, TOKENIZER, [str(p) for p in paths], batch_size=4)
    assert [(s.name, s.tokens) for s in scores] == [(str(paths[0]), 39), (str(paths[1]), 55)]


def test_a_split_is_named_by_its_folder_and_refused_with_another_tokenizer(tmp_path):
    data_dir = prepared(tmp_path)
    model = moved_model(8)
    assert score_split(model, TOKENIZER, data_dir, batch_size=4).name == f"{data_dir} (val)"
    other = CharTokenizer(TEXT + "xyz")  # the same characters and three more: other ids for some of them
    with pytest.raises(GptlabError, match=r"data was tokenized with another tokenizer than the model's"):
        score_split(model, other, data_dir)
    with pytest.raises(GptlabError, match=r"than run r1's, .*--tokenizer-from"):
        score_split(model, other, data_dir, source="run r1")
