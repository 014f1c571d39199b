"""The edges of the chat helpers (gptlab.chat) and of reading conversations (gptlab.data.conversations) that
tests/test_conversations.py and tests/test_lora_chat.py do not reach, each by a direct call with hand-worked
expectations: the messages' numbering and default name in errors, text parts that are not text, a context cut when
the first turn is not an answer's question, the rows a vocabulary grows by, folders of conversations, and the error
lines of files that cannot be read."""

import errno
import json
from pathlib import Path

import pytest
import torch

from gptlab.chat import check_messages, fit_context, grow_vocab, rows_added
from gptlab.config import PrepareConfig
from gptlab.data.conversations import Conversation, chat_tokenizer, read_conversations
from gptlab.errors import GptlabError
from gptlab.tokenizer import CharTokenizer, ChatTokenizer

ONE = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def error(call, *args, **kwargs) -> str:
    with pytest.raises(GptlabError) as err:
        call(*args, **kwargs)
    return str(err.value)


def write(path, lines: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(ONE) + "\n" for _ in range(lines)), encoding="utf-8")
    return str(path)


# ---- gptlab.chat ---------------------------------------------------------------------------------------------------

def test_messages_are_numbered_from_1_and_the_default_place_is_the_conversation():
    assert error(check_messages, []) == ('the conversation: messages must be a non-empty list of {"role", '
                                         '"content"} objects')
    bad = [{"role": "user", "content": "hi"}, "not an object"]
    assert error(check_messages, bad) == "the conversation: message 2 is not an object with a role and a content"


@pytest.mark.parametrize("parts", [
    [{"type": "image_url", "text": "a picture"}],  # a part of another type, even one with a "text"
    ["a bare string"],  # a part that is not an object
])
def test_content_parts_that_are_not_text_parts_are_refused(parts):
    messages = [{"role": "user", "content": parts}]
    assert error(check_messages, messages, "here") == ("here: message 1 has a content that is not text; give a "
                                                       "string (or text parts)")


def test_a_context_cut_drops_a_user_turn_that_no_answer_follows():
    """Two user messages in a row: the older one is a turn of its own, dropped alone."""
    tok = ChatTokenizer(CharTokenizer("ab"))
    messages = [{"role": "user", "content": "aaaa"}, {"role": "user", "content": "b"}]
    # ids: <|user|> aaaa <|end|> (6), <|user|> b <|end|> (3), <|assistant|> (1): 10; the last turn's prompt is 4
    assert fit_context(messages, tok, 4) == ([{"role": "user", "content": "b"}], 1)


def test_a_context_that_cannot_hold_the_system_messages_is_an_error_line():
    tok = ChatTokenizer(CharTokenizer("ab"))
    assert error(fit_context, [{"role": "system", "content": "aaaa"}], tok, 2) == (
        "the conversation's system messages and last turn alone take more than the 2 tokens the context leaves; "
        "shorten them or start again (/reset)")


def test_rows_are_added_only_from_a_plain_tokenizer_to_its_chat_one():
    plain = CharTokenizer("ab")
    assert rows_added(plain, plain) is False  # no chat markers: nothing to add
    assert rows_added(plain, ChatTokenizer(CharTokenizer("ba"))) is True
    assert error(rows_added, plain, ChatTokenizer(CharTokenizer("abc"))) == (
        "the conversations were prepared with a char tokenizer of 3 ids that is not the source model's (char, 2 "
        "ids); prepare them with --tokenizer-from the source")


def test_grow_vocab_grows_an_untied_head_too_in_the_tensors_own_dtype():
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]], dtype=torch.float64)
    tensors = {"transformer.wte.weight": rows.clone(), "lm_head.weight": rows.clone() * 2}
    grown = grow_vocab(tensors, keep=2, vocab_size=4)
    want = torch.tensor([[1.0, 2.0], [3.0, 4.0], [2.0, 3.0], [2.0, 3.0]], dtype=torch.float64)
    for name, scale in (("transformer.wte.weight", 1), ("lm_head.weight", 2)):
        assert grown[name].dtype == torch.float64, name
        assert torch.equal(grown[name], want * scale), name


# ---- gptlab.data.conversations -------------------------------------------------------------------------------------

def test_folders_are_read_for_their_jsonl_files_sorted_after_the_files_named_before_them(tmp_path):
    first = write(tmp_path / "first.jsonl", 1)
    write(tmp_path / "folder" / "b.jsonl", 2)
    write(tmp_path / "folder" / "a" / "x.jsonl", 1)
    (tmp_path / "folder" / "notes.txt").write_text("not conversations")
    found = read_conversations([first, str(tmp_path / "folder")])
    assert [c.where for c in found] == [f"{first}:1", f"{tmp_path}/folder/a/x.jsonl:1",
                                        f"{tmp_path}/folder/b.jsonl:1", f"{tmp_path}/folder/b.jsonl:2"]
    assert found[0].messages == ONE["messages"]


def test_a_folder_without_conversations_or_a_missing_path_is_an_error_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not conversations")
    assert error(read_conversations, [str(tmp_path / "empty")]) == (
        f"{tmp_path}/empty holds no .jsonl files of conversations")
    assert error(read_conversations, [str(tmp_path / "nowhere.jsonl")]) == (
        f"{tmp_path}/nowhere.jsonl does not exist; give JSONL files or folders of them")


def test_files_that_cannot_be_read_as_text_are_error_lines(tmp_path, monkeypatch):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"messages": "caf\xe9"}\n')
    assert error(read_conversations, [str(tmp_path / "latin1.jsonl")]) == (
        f"{tmp_path}/latin1.jsonl is not UTF-8 text; give conversations as UTF-8 JSONL")
    # a file its user may not read (as root can read any, the refusal is the system's error, raised by hand)
    locked = write(tmp_path / "locked.jsonl", 2)

    def refused(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", refused)
    assert error(read_conversations, [locked]) == f"cannot read {locked}: Permission denied"


def test_too_few_conversations_in_several_files_names_them_all(tmp_path):
    a, b = write(tmp_path / "a.jsonl", 1), write(tmp_path / "b.jsonl", 0)
    assert error(read_conversations, [a, b]) == (
        f"{a} {b} hold 1 conversation(s); training and validation need at least 2")


def test_a_bpe_chat_tokenizer_learns_from_each_message_apart():
    """Contents "ab" and "ab", each its own text: the byte-level BPE learns the one merge a+b (256 bytes, end-of-text
    and "ab": 258 ids), never a merge across the two messages ("abab", as one text "abab" would give)."""
    convo = Conversation("x:1", [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ab"}])
    tok = chat_tokenizer(PrepareConfig(tokenizer="bpe", vocab_size=300), [convo], None)
    assert tok.base.vocab_size == 258
    assert len(tok.base.encode("abab")) == 2
