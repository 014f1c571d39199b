import functools

import pytest
from hypothesis import assume, given, strategies as st

from gptlab.errors import GptlabError
from gptlab.tokenizer import EOT, BPETokenizer, CharTokenizer, GPT2Tokenizer, StreamDecoder, load, train_tokenizer

VARIED = "Héllo wörld — naïve café 😀🚀 日本語テキスト\n\n\t  spaces   and 12345 don't we'll\n"


def test_char_round_trip_and_sorted_vocabulary():
    tok = CharTokenizer.train(["hello world"])
    assert tok.chars == sorted(set("hello world"))
    assert tok.decode(tok.encode("hello")) == "hello"


def test_char_round_trip_non_ascii():
    tok = CharTokenizer.train([VARIED])
    assert tok.decode(tok.encode(VARIED)) == VARIED


def test_char_unseen_characters_are_named():
    tok = CharTokenizer.train(["abc"])
    with pytest.raises(GptlabError, match=r"2 character\(s\).*'x', 'z'"):
        tok.encode("abzx")


def test_bpe_round_trip_on_non_ascii_text_it_was_not_trained_on():
    tok = BPETokenizer.train(["the quick brown fox jumps over the lazy dog\n" * 50], vocab_size=300)
    assert 257 < tok.vocab_size <= 300  # training stops early when no pair is left to merge
    assert tok.decode(tok.encode(VARIED)) == VARIED
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges were learned


def test_bpe_special_token_only_when_allowed():
    tok = BPETokenizer.train(["some text\n" * 20], vocab_size=280)
    with pytest.raises(GptlabError, match="special token"):
        tok.encode(f"a{EOT}b")
    ids = tok.encode(f"a{EOT}b", allow_special=True)
    assert tok.eot_id in ids
    assert tok.decode(ids) == f"a{EOT}b"


def test_gpt2_known_ids_and_round_trip():
    tok = GPT2Tokenizer()
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode(tok.encode(VARIED)) == VARIED
    with pytest.raises(GptlabError, match="special token"):
        tok.encode(f"x{EOT}")
    assert tok.encode(EOT, allow_special=True) == [50256]


@pytest.mark.parametrize("make", [
    lambda: CharTokenizer.train([VARIED]),
    lambda: BPETokenizer.train([VARIED * 5], vocab_size=270),
    GPT2Tokenizer,
])
def test_save_and_load_give_the_same_ids(tmp_path, make):
    tok = make()
    tok.save(tmp_path / "tok.json")
    again = load(tmp_path / "tok.json")
    assert again.encode(VARIED) == tok.encode(VARIED)
    assert again.vocab_size == tok.vocab_size


def test_stream_decoder_never_emits_half_a_character():
    tok = GPT2Tokenizer()
    ids = tok.encode("😀日本")
    decoder = StreamDecoder(tok)
    pieces = [decoder.push([i]) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == "😀日本"
    assert all("\ufffd" not in p for p in pieces)


def test_damaged_tokenizer_file_is_a_clear_error(tmp_path):
    (tmp_path / "t.json").write_text("{not json")
    with pytest.raises(GptlabError, match="not valid JSON"):
        load(tmp_path / "t.json")
    with pytest.raises(GptlabError, match="missing"):
        load(tmp_path / "absent.json")


# ---- round trips on arbitrary Unicode text (hypothesis) ----------------------------------------------------------

ANY_TEXT = st.text(st.characters(codec="utf-8"), max_size=120)  # every code point UTF-8 can hold: no surrogates


@functools.lru_cache(maxsize=1)
def trained_bpe() -> BPETokenizer:
    """A byte-level BPE trained on mixed-script text, with merges across multi-byte characters."""
    return BPETokenizer.train([VARIED * 30, "the quick brown fox jumps over the lazy dog\n" * 30], vocab_size=400)


@given(ANY_TEXT)
def test_char_round_trip_on_any_text(text):
    assume(text)
    tok = CharTokenizer.train([text[::-1]])
    ids = tok.encode(text)
    assert ids == [sorted(set(text)).index(c) for c in text]  # each character's rank among the sorted ones
    assert tok.decode(ids) == text and tok.decode_bytes(ids) == text.encode("utf-8")


@given(ANY_TEXT)
def test_trained_bpe_round_trip_on_any_text(text):
    assume(EOT not in text)
    tok = trained_bpe()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids) and tok.eot_id not in ids
    assert tok.decode_bytes(ids) == text.encode("utf-8") and tok.decode(ids) == text
    assert b"".join(tok.decode_bytes([i]) for i in ids) == text.encode("utf-8")  # id by id, bytes add up


@given(ANY_TEXT)
def test_gpt2_round_trip_on_any_text_and_in_a_stream(text):
    assume(EOT not in text)
    tok = GPT2Tokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 50256 for i in ids) and tok.decode(ids) == text
    assert b"".join(tok.decode_bytes([i]) for i in ids) == text.encode("utf-8")
    decoder = StreamDecoder(tok)
    assert "".join([decoder.push([i]) for i in ids] + [decoder.flush()]) == text


def test_more_than_ten_unseen_characters_are_shown_ten_and_an_ellipsis():
    tok = CharTokenizer("ab")
    with pytest.raises(GptlabError) as many:
        tok.encode("cdefghijklm")  # 11 unseen
    with pytest.raises(GptlabError) as ten:
        tok.encode("cdefghijkl")
    assert str(many.value).count("'") == 20 and " ..." in str(many.value) and " ..." not in str(ten.value)
    shown = ", ".join(repr(c) for c in "cdefghijkl")
    assert str(many.value) == (f"the text has 11 character(s) the char vocabulary has never seen: {shown} ...; "
                               "remove them or train on a corpus that contains them")
    assert str(ten.value) == (f"the text has 10 character(s) the char vocabulary has never seen: {shown}; "
                              "remove them or train on a corpus that contains them")


def test_train_tokenizer_builds_each_kind():
    assert isinstance(train_tokenizer("gpt2", []), GPT2Tokenizer)
    assert isinstance(train_tokenizer("char", ["ab"]), CharTokenizer)
    text = [" ".join(f"w{i} x{i * 7 % 50} y{i % 13}" for i in range(3000))]  # pairs enough for 1024 tokens
    assert train_tokenizer("bpe", text).vocab_size == 1024  # the default
    small = train_tokenizer("bpe", text, 300)
    assert isinstance(small, BPETokenizer) and small.vocab_size == 300
    with pytest.raises(GptlabError) as bad:
        train_tokenizer("BPE", text)
    assert str(bad.value) == "unknown tokenizer 'BPE'; choose char, bpe or gpt2"


def test_a_byte_level_bpe_needs_its_256_bytes_and_end_of_text_and_decodes_in_transformers_too():
    text = ["hello world, hello there " * 40]
    with pytest.raises(GptlabError) as bad:
        BPETokenizer.train(text, 256)
    assert str(bad.value) == "a byte-level BPE needs vocab_size >= 257 (256 bytes + end-of-text), not 256"
    assert BPETokenizer.train(text, 257).vocab_size == 257  # the bytes and end-of-text, no merge
    tok = BPETokenizer.train(text, 270)
    ids = tok.encode("hello é there")
    assert tok.hf.decode(ids) == "hello é there" == tok.decode(ids)  # the tokenizers library's own decoder too


def test_special_tokens_are_refused_unless_allowed_by_every_tokenizer_and_the_interface():
    import inspect

    from gptlab.tokenizer import ChatTokenizer, Tokenizer

    for cls in (Tokenizer, CharTokenizer, BPETokenizer, GPT2Tokenizer, ChatTokenizer):
        assert inspect.signature(cls.encode).parameters["allow_special"].default is False, cls


def test_text_of_leaves_special_tokens_out_and_counts_them():
    tok = GPT2Tokenizer()
    ids = tok.encode("hi" + EOT + "yo", allow_special=True)
    assert tok.text_of(ids) == ("hiyo", 1)
    assert tok.text_of(tok.encode("plain")) == ("plain", 0)
    chars = CharTokenizer("ab")  # no end-of-text: nothing to leave out
    assert chars.text_of(chars.encode("abba")) == ("abba", 0)


def test_chat_of_takes_a_chat_tokenizer_and_refuses_a_plain_one():
    from gptlab.tokenizer import ChatTokenizer, chat_of

    chat = ChatTokenizer(GPT2Tokenizer())
    assert chat_of(chat) is chat
    with pytest.raises(GptlabError) as bad:
        chat_of(GPT2Tokenizer())
    assert str(bad.value).startswith("this run's tokenizer has no chat template; fine-tune it on conversations first")


def test_a_damaged_tokenizer_file_is_refused_in_one_line(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"type": "char", "chars"', encoding="utf-8")
    with pytest.raises(GptlabError) as bad:
        load(path)
    assert str(bad.value) == f"tokenizer file {path} is not valid JSON; it is damaged"
    with pytest.raises(GptlabError) as missing:
        load(tmp_path / "nowhere.json")
    assert str(missing.value) == f"tokenizer file {tmp_path / 'nowhere.json'} is missing"
    path.write_text('{"type": "char"}', encoding="utf-8")  # JSON, but no vocabulary in it
    with pytest.raises(GptlabError) as bad:
        load(path)
    assert str(bad.value) == f"tokenizer file {path} could not be read ('chars'); it is damaged"
    path.write_bytes(b'{"type": "char", "chars": "\xff"}')  # not UTF-8
    with pytest.raises(GptlabError) as bad:
        load(path)
    assert str(bad.value) == f"tokenizer file {path} is not valid JSON; it is damaged"


def test_a_tokenizer_file_of_an_unknown_type_is_refused_naming_it():
    from gptlab.tokenizer import from_dict

    with pytest.raises(GptlabError) as bad:
        from_dict({"type": "wordpiece"})
    assert str(bad.value) == "unknown tokenizer type 'wordpiece' in tokenizer file"


def test_a_stream_ending_inside_a_character_flushes_a_replacement_character():
    tok = GPT2Tokenizer()
    ids = tok.encode("é")  # two UTF-8 bytes: é is c3 a9
    first = [i for i in range(256) if tok.decode_bytes([i]) == b"\xc3"]
    stream = StreamDecoder(tok)
    assert stream.push(tok.encode("ok") + first) == "ok"  # half a character: held back
    assert stream.flush() == "\ufffd"  # the end of the stream: the half shown as U+FFFD, not dropped
    assert len(first) == 1 and tok.decode(ids) == "é"


def test_a_chat_tokenizer_wraps_the_base_once_and_passes_allow_special_through():
    from gptlab.tokenizer import CHAT_TOKENS, ChatTokenizer

    base = GPT2Tokenizer()
    chat = ChatTokenizer(ChatTokenizer(base))  # a chat tokenizer given again keeps its base
    assert chat.base is base and chat.vocab_size == base.vocab_size + len(CHAT_TOKENS)
    eot = base.encode(EOT, allow_special=True)
    assert chat.encode("hi" + EOT, allow_special=True) == base.encode("hi") + eot  # no marker: the base's rule
    user = chat.special_ids["<|user|>"]
    assert chat.encode("<|user|>hi" + EOT, allow_special=True) == [user] + base.encode("hi") + eot
    with pytest.raises(GptlabError) as bad:
        chat.encode("<|user|>hi")
    assert str(bad.value).endswith("special tokens (" + ", ".join(CHAT_TOKENS) + ")")


def test_the_stream_decoder_replaces_bytes_that_are_not_utf8():
    tok = GPT2Tokenizer()
    bad = [i for i in range(256) if tok.decode_bytes([i]) == b"\xff"]  # a byte no UTF-8 text holds
    stream = StreamDecoder(tok)
    assert len(bad) == 1 and stream.push(bad + tok.encode("ok")) + stream.flush() == "\ufffdok"
