"""The edges of the chat helpers (gptlab.chat) and of reading conversations (gptlab.data.conversations) that
tests/test_conversations.py and tests/test_lora_chat.py do not reach, each by a direct call with hand-worked
expectations: the messages' numbering and default name in errors, text parts that are not text, a context cut when
the first turn is not an answer's question, the rows a vocabulary grows by, folders of conversations, the error
lines of files that cannot be read, the exchanges a long conversation is cut into, the held-out draw, and what
`prepare --chat` writes: meta.json read back against the files it lists, a killed prepare's leftovers, new folders,
a failed overwrite."""

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from gptlab.chat import check_messages, fit_context, grow_vocab, rows_added
from gptlab.config import PrepareConfig
from gptlab.data import conversations
from gptlab.data.batches import load_dataset
from gptlab.data.conversations import Conversation, chat_tokenizer, held_out, pieces, read_conversations
from gptlab.data.prepare import prepare
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


def test_two_user_messages_before_an_answer_are_one_exchange_never_cut_apart():
    """A conversation cut to a context is cut before a user turn that follows an answer, not between two user
    messages in a row: the answer's question stays with the message before it."""
    tok = ChatTokenizer(CharTokenizer("abcd"))  # a-d: ids 0-3; <|system|> 4, <|user|> 5, <|assistant|> 6, <|end|> 7
    roles = ("user", "assistant", "user", "user", "assistant")
    convo = Conversation("x:1", [{"role": r, "content": c} for r, c in zip(roles, "abcda")])
    # each message is 3 ids (15 in all); a context of 9 holds the last three messages, so the pieces are 1-2 and 3-5
    assert pieces(convo, tok, 9) == [([5, 0, 7, 6, 1, 7], [False, False, False, False, True, True]),
                                     ([5, 2, 7, 5, 3, 7, 6, 0, 7], [False] * 7 + [True, True])]


def test_held_out_conversations_are_drawn_without_replacement_and_leave_one_for_training():
    # round(10 x 0.5) = 5 different conversations, whatever the seed
    assert [int(held_out(10, 0.5, seed).sum()) for seed in range(8)] == [5] * 8
    # round(2 x 0.9) = 2 and round(4 x 0.9) = 4 would leave training nothing: count - 1
    assert [int(held_out(count, 0.9, 0).sum()) for count in (2, 4)] == [1, 3]


# ---- what prepare --chat writes: meta.json, read back against the files and hand-worked values -------------------

def header(path) -> tuple[bytes, int, int, int]:
    """A token file's header as tokenfiles.py documents it: magic, version, bytes per token, token count
    (little-endian: 8 bytes, 4, 4, 8)."""
    data = path.read_bytes()
    return data[:8], int.from_bytes(data[8:12], "little"), int.from_bytes(data[12:16], "little"), \
        int.from_bytes(data[16:24], "little")


def test_the_chat_meta_json_describes_the_split_and_lists_every_file_with_its_sha256(tmp_path):
    train = write(tmp_path / "c.jsonl", 4)
    out = tmp_path / "d"
    prepare([train], out, PrepareConfig(chat=True, val_fraction=0.25, seed=3), quiet=True)
    meta = json.loads((out / "meta.json").read_text())
    magic, version, itemsize, tokens = header(out / "train.bin")
    # 4 conversations, round(4 x 0.25) = 1 held out; 8 ids ("hiyo" and the 4 markers), so two bytes each; each
    # conversation is <|user|> h i <|end|> <|assistant|> y o <|end|>: 8 ids, 3 x 8 in train
    assert (magic, itemsize, tokens) == (b"GPTLABTK", 2, 3 * 8)
    assert {k: meta.get(k) for k in ("format_version", "dtype", "split", "val_fraction", "seed", "documents",
                                 "val_documents")} == {"format_version": version, "dtype": "uint16",
                                                       "split": "conversations", "val_fraction": 0.25, "seed": 3,
                                                       "documents": 4, "val_documents": 1}
    for split in ("train", "val"):
        body = (out / f"{split}.bin").read_bytes()[32:]  # the ids after the 32-byte header
        assert meta["shards"][split] == [{"file": f"{split}.bin", "tokens": len(body) // 2,
                                          "sha256": hashlib.sha256(body).hexdigest()}]
        files = meta["chat"]["files"][split]
        for kind in ("mask", "starts"):
            data = (out / f"{split}.{kind}.npy").read_bytes()
            assert files[kind] == {"file": f"{split}.{kind}.npy", "sha256": hashlib.sha256(data).hexdigest()}
        assert np.load(out / f"{split}.mask.npy").dtype == np.uint8  # one byte a flag, as the module says


def test_the_chat_meta_json_of_validation_files_counts_them_and_has_no_fraction(tmp_path):
    train, val = write(tmp_path / "c.jsonl", 3), write(tmp_path / "v.jsonl", 2)
    prepare([train], tmp_path / "d", PrepareConfig(chat=True, val=[val]), quiet=True)
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert {k: meta.get(k) for k in ("split", "val_fraction", "documents", "val_documents")} == {
        "split": "validation files", "val_fraction": None, "documents": 5, "val_documents": 2}


def test_prepare_chat_writes_over_a_killed_prepares_staging_and_into_folders_not_made_yet(tmp_path):
    train = write(tmp_path / "c.jsonl", 2)
    stale = tmp_path / ".d.chat-staging"  # what a prepare killed while writing leaves beside its --out
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"half a file")
    for out in (tmp_path / "d", tmp_path / "new" / "deeper" / "d"):
        prepare([train], out, PrepareConfig(chat=True), quiet=True)
        assert len(load_dataset(out).chat["train"][1]) - 1 == 1  # round(2 x 0.1) -> 1 held out, 1 to train
    assert not stale.exists()


def test_a_prepare_over_earlier_chat_data_that_fails_while_moving_in_leaves_no_meta_json(tmp_path, monkeypatch):
    """The earlier meta.json goes first: a folder half old and half new is never taken for prepared data."""
    prepare([write(tmp_path / "a.jsonl", 2)], tmp_path / "d", PrepareConfig(chat=True), quiet=True)
    moved = []

    def replace(src, dst):
        if Path(dst).parent == tmp_path / "d":  # moving in, not the staging folder's own atomic writes
            if moved:
                raise OSError(errno.ENOSPC, "No space left on device")
            moved.append(dst)
        os.rename(src, dst)

    monkeypatch.setattr(conversations.os, "replace", replace)
    assert error(prepare, [write(tmp_path / "b.jsonl", 3)], tmp_path / "d", PrepareConfig(chat=True), quiet=True,
                 overwrite=True) == (f"cannot write the conversations' token files in {tmp_path / 'd'}: No space "
                                     "left on device; free some space or fix the permissions")
    assert len(moved) == 1 and not (tmp_path / "d" / "meta.json").exists()
