"""The text stream (gptlab.textstream): a row's Completion (UTF-8-safe streaming, end-of-text, stop strings held back
until ruled out) and TextStream / complete over the engine, held to plain-Python references of the same rules."""

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import tiny_config
from gptlab.config import SampleConfig
from gptlab.engine import one_thread
from gptlab.model import GPT, Bigram
from gptlab.textstream import Completion, TextStream, complete
from gptlab.tokenizer import BPETokenizer, CharTokenizer, Tokenizer


@pytest.fixture(autouse=True)
def _one_thread():  # as test_engine's
    with one_thread():
        yield


# ---- text: stop strings, end-of-text, UTF-8 ------------------------------------------------------------------------

def chain_model(vocab: int, follow: dict[int, int]) -> Bigram:
    """A bigram model that, greedily, always follows token a with token follow[a]."""
    model = Bigram(tiny_config(arch="bigram", vocab_size=vocab)).eval()
    with torch.no_grad():
        for a, b in follow.items():
            model.logits_table.weight[a, b] = 10.0
    return model


CHARS = CharTokenizer("ab\n.")  # ids: "\n" 0, "." 1, "a" 2, "b" 3


def char_ids(text: str) -> list[int]:
    return CHARS.encode(text)


def test_stop_strings_stop_generation_and_are_cut_even_across_tokens():
    model = chain_model(4, {2: 3, 3: 0, 0: 0})  # a -> b -> \n -> \n -> ...
    greedy = SampleConfig(max_new_tokens=20, temperature=0, stop=["\n\n"])
    [done] = complete(model, CHARS, [char_ids("a")], greedy)
    assert (done.text, done.finish_reason) == ("b", "stop")
    assert done.ids == char_ids("b\n\n")  # the tokens that made the stop string are consumed, not shown
    stream = TextStream(model, CHARS, [char_ids("a")], greedy)
    pieces = [p[0] for p in stream]
    assert "".join(pieces) == "b" and "\n" not in "".join(pieces)  # held back, then cut: never shown


def test_the_earliest_stop_string_wins_and_text_without_one_is_all_released():
    model = chain_model(4, {2: 3, 3: 1, 1: 2})  # a -> b -> . -> a -> ...
    two = SampleConfig(max_new_tokens=20, temperature=0, stop=[".a", "b."])
    assert complete(model, CHARS, [char_ids("a")], two)[0].text == ""  # "b." starts first
    none = SampleConfig(max_new_tokens=7, temperature=0, stop=["bb"])
    [done] = complete(model, CHARS, [char_ids("a")], none)
    assert (done.text, done.finish_reason) == ("b.ab.ab", "length")


def test_rows_stop_independently_and_the_stream_ends_when_all_have():
    model = chain_model(4, {2: 3, 3: 0, 0: 0, 1: 1})  # a -> b -> \n ...; . -> . -> ...
    cfg = SampleConfig(max_new_tokens=50, temperature=0, stop=["\n"])
    stream = TextStream(model, CHARS, [char_ids("a"), char_ids(".")], cfg)
    steps = list(stream)
    assert len(steps) == 51  # the "." row never stops: all 50 tokens, then the closing step
    first, second = stream.completions
    assert (first.text, first.finish_reason) == ("b", "stop")
    assert (second.text, second.finish_reason) == ("." * 50, "length")
    early = TextStream(model, CHARS, [char_ids("a"), char_ids("b")], cfg)
    assert len(list(early)) == 2  # both rows stop at their first newline: no more decoding


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(["hello world, the quick brown fox. " * 20], 300)


def test_end_of_text_ends_a_row_and_is_not_shown(bpe):
    tokenizer = bpe
    hello = tokenizer.encode(" hello")
    model = chain_model(tokenizer.vocab_size, {hello[0]: tokenizer.eot_id, tokenizer.eot_id: hello[0]})
    [done] = complete(model, tokenizer, [hello], SampleConfig(max_new_tokens=10, temperature=0))
    assert (done.text, done.finish_reason, done.ids) == ("", "eot", [])


def test_streamed_text_never_splits_a_multi_byte_character(bpe):
    ids = bpe.encode("🙂é 日")  # every byte a different token
    assert any("\ufffd" in bpe.decode([i]) for i in ids)  # some tokens hold part of a character
    start = bpe.encode("h")
    model = chain_model(bpe.vocab_size, dict(zip(start + ids, ids)))  # h -> the bytes of the text, in turn
    stream = TextStream(model, bpe, [start], SampleConfig(max_new_tokens=len(ids), temperature=0))
    pieces = [p[0] for p in stream]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "🙂é 日" and pieces[:4] == ["", "", "", "🙂"]


def test_same_seed_same_text():
    model = GPT(tiny_config(vocab_size=4)).eval()
    cfg = SampleConfig(max_new_tokens=50, temperature=1.0, seed=5)
    texts = [c.text for c in complete(model, CHARS, [char_ids("ab")], cfg, 2)]
    assert texts == [c.text for c in complete(model, CHARS, [char_ids("ab")], cfg, 2)]
    assert texts[0] != texts[1]


# ---- properties: any text, cut into tokens anywhere (inside a character, inside a stop string) ---------------------

class ChunkTokenizer(Tokenizer):
    """Token i is chunks[i], any run of bytes (half a character, say); the id after the last is end-of-text."""

    def __init__(self, chunks: list[bytes]):
        self.chunks, self.eot_id = chunks, len(chunks)

    @property
    def vocab_size(self) -> int:
        return len(self.chunks) + 1

    def decode_bytes(self, ids):
        return b"".join(self.chunks[i] for i in ids)


ALPHABET = "ab .\né日🙂"  # one to four UTF-8 bytes a character


@st.composite
def texts_cuts_and_stops(draw):
    """(text, its UTF-8 bytes cut into tokens at arbitrary byte offsets, stop strings: pieces of the text itself,
    so they occur and are often split across tokens, and strings that may not occur)."""
    text = draw(st.text(st.sampled_from(ALPHABET), min_size=1, max_size=30))
    data = text.encode()
    cuts = sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=len(data) - 1)) if len(data) > 1 else [])
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start:start + draw(st.integers(1, 4))])
        else:
            stops.append(draw(st.text(st.sampled_from(ALPHABET), min_size=1, max_size=3)))
    return text, chunks, stops


def reference(chunks: list[bytes], stops: list[str]) -> tuple[str, str, int]:
    """(text, finish reason, tokens taken) by the rules, token by token in plain Python: generation stops at the
    first token after which the text so far (its whole characters) holds a stop string, and the text is cut where
    the first of the stop strings it holds begins."""
    data = b""
    for k, chunk in enumerate(chunks, 1):
        data += chunk
        text = data.decode("utf-8", errors="ignore")  # a character still missing bytes at the end is not text yet
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], "stop", k
    return data.decode("utf-8", errors="replace"), "length", len(chunks)  # at the end: a cut character is U+FFFD


@settings(max_examples=150)
@given(texts_cuts_and_stops())
def test_streamed_text_is_the_decoded_ids_up_to_the_first_stop_and_never_half_a_character(case):
    text, chunks, stops = case
    expected, reason, taken = reference(chunks, stops)
    row = Completion(ChunkTokenizer(chunks), stops)
    shown = ""
    for k in range(len(chunks)):
        piece = row.push(k)
        assert "\ufffd" not in piece  # never half a character
        shown += piece
        assert expected.startswith(shown)  # never past a stop, never taken back
        if row.finish_reason is None:  # held back: at most a partial stop string (and a partial character)
            whole = ChunkTokenizer(chunks).decode_bytes(range(k + 1)).decode("utf-8", errors="ignore")
            assert len(shown) >= len(whole) - max((len(s) - 1 for s in stops), default=0)
    shown += row.close("length")
    assert (shown, row.text, row.finish_reason) == (expected, expected, reason)
    assert row.ids == list(range(taken))  # the tokens up to the one that completed the stop


@settings(max_examples=60)
@given(texts_cuts_and_stops(), st.integers(0, 40))
def test_end_of_text_ends_the_row_with_the_text_before_it(case, at):
    text, chunks, stops = case
    at = min(at, len(chunks))
    tokenizer = ChunkTokenizer(chunks)
    expected, reason, _ = reference(chunks[:at], stops)
    row = Completion(tokenizer, stops)
    shown = "".join(row.push(k) for k in range(at)) + row.push(tokenizer.eot_id) + row.push(0)
    reason = "stop" if reason == "stop" else "eot"
    assert (shown, row.text, row.finish_reason) == (expected, expected, reason)


def test_a_stop_string_of_three_characters_is_caught_when_it_arrives_one_character_at_a_time():
    """Every beginning of a stop string is held back, not only the longest: with "a.b" arriving as "b", "a", ".",
    "b", the "a" is held (it may start the stop), then "a.", then the stop is cut."""
    row = Completion(CHARS, ["a.b"])
    shown = [row.push(i) for i in char_ids("ba.b")]
    assert shown == ["b", "", "", ""]
    assert (row.text, row.finish_reason) == ("b", "stop")
    row = Completion(CHARS, ["a.b"])  # and a beginning that turns out not to be one is released in order
    assert [row.push(i) for i in char_ids("ba.a")] == ["b", "", "", "a."]
    assert row.close() == "a" and row.text == "ba.a"


def test_a_row_closed_without_a_reason_finished_by_length():
    row = Completion(CHARS)
    row.push(char_ids("a")[0])
    assert row.close() == "" and row.finish_reason == "length"  # as OpenAI's API names it


@pytest.mark.parametrize("with_cache", [False, True])
def test_the_stream_decodes_through_the_running_batch_with_the_prefix_cache_it_is_given(with_cache, monkeypatch):
    """TextStream's rows are generate_batch's rows, decoded by the one RunningBatch path with the prefix cache it
    is handed (None by default)."""
    import gptlab.engine as engine
    from gptlab.inference.prefix_cache import PrefixCache

    built = []

    class Seen(engine.RunningBatch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.prefix_cache)

    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=4)).eval()
    cfg = SampleConfig(max_new_tokens=12, temperature=1.0, seed=5)
    prompts = [char_ids("ab"), char_ids("b.a")]
    expected = [list(row) for row in zip(*engine.generate_uncached(model, prompts, replace(cfg, temperature=0), 2))]
    monkeypatch.setattr(engine, "RunningBatch", Seen)
    cache = PrefixCache(2 ** 20, chunk=2) if with_cache else None
    kwargs = {"prefix_cache": cache} if with_cache else {}  # the default is checked as the default
    stream = TextStream(model, CHARS, prompts, replace(cfg, temperature=0), 2, **kwargs)
    list(stream)
    assert [c.ids for c in stream.completions] == expected
    assert len(built) == 1 and built[0] is cache
