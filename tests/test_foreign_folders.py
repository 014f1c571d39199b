"""Folders gptlab did not write are never written over: `prepare --out` and `export --out` refuse a folder holding
another project's files (a nanoGPT data folder, a Hugging Face model, someone's text) in one line, leaving every
byte as it was; the hint after a refused `--data` names a prepare that writes into a folder of its own."""

import json
import shlex

import pytest

from helpers import CORPUS, TINY, run_bad, run_ok, tree

NANOGPT = {"input.txt": CORPUS.encode(), "train.bin": bytes(range(64)) * 4, "val.bin": bytes(range(32)),
           "meta.pkl": b"\x80\x04\x95 not gptlab's"}


def nanogpt_folder(root, name="shakespeare_char", extra=None):
    folder = root / "data" / name
    folder.mkdir(parents=True)
    for file, content in {**NANOGPT, **(extra or {})}.items():
        (folder / file).write_bytes(content)
    return folder


@pytest.mark.parametrize("extra", [{}, {"meta.json": b'{"vocab_size": 65, "itos": {}}'},
                                   {"tokenizer.json": b'{"model": "someone else\'s"}'}],
                         ids=["nanogpt", "with-a-meta-json", "with-a-tokenizer-json"])
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_prepare_refuses_a_folder_of_files_it_did_not_write(tmp_path, capsys, corpus_file, extra, overwrite):
    folder = nanogpt_folder(tmp_path, extra=extra)
    before = tree(tmp_path)
    line = run_bad(capsys, "prepare", str(corpus_file), "--out", str(folder), "--quiet", *overwrite)
    assert f"{folder} holds files gptlab did not write" in line and "input.txt" in line, line
    assert "prepared from other inputs" not in line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_prepare_refuses_the_users_own_text_folder(tmp_path, capsys, chat):
    texts = tmp_path / "my_texts"
    texts.mkdir()
    (texts / "a.txt").write_text(CORPUS, encoding="utf-8")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}) + "\n", encoding="utf-8")
    before = tree(tmp_path)
    argv = ["prepare", "--chat", str(chats)] if chat else ["prepare"]
    line = run_bad(capsys, *argv, "--out", str(texts), "--quiet")
    assert f"{texts} holds files gptlab did not write (a.txt)" in line, line
    assert tree(tmp_path) == before


def test_prepare_still_writes_a_new_an_empty_and_its_own_folder(tmp_path, capsys, corpus_file):
    empty = tmp_path / "empty"
    empty.mkdir()
    run_ok(capsys, "prepare", str(corpus_file), "--out", str(empty), "--quiet")
    run_ok(capsys, "prepare", str(corpus_file), "--out", str(empty), "--quiet")  # the same data again
    other = tmp_path / "other.txt"
    other.write_text(CORPUS[::-1], encoding="utf-8")
    run_ok(capsys, "prepare", str(other), "--out", str(empty), "--quiet", "--overwrite")
    assert json.loads((empty / "meta.json").read_text())["train_tokens"] > 0
    run_ok(capsys, "prepare", str(corpus_file), "--out", str(tmp_path / "new" / "folder"), "--quiet")


def test_an_interrupted_prepares_folder_is_its_own(tmp_path, capsys, corpus_file):
    """A folder holding only prepare's staging folder (a prepare stopped before its first commit) is resumed."""
    out = tmp_path / "data"
    (out / ".prepare-partial").mkdir(parents=True)
    run_ok(capsys, "prepare", str(corpus_file), "--out", str(out), "--quiet")
    assert (out / "meta.json").is_file()


def test_the_hint_after_a_nanogpt_data_folder_prepares_its_text_into_a_folder_of_its_own(tmp_path, capsys,
                                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = nanogpt_folder(tmp_path)
    line = run_bad(capsys, "train", "--data", "data/shakespeare_char", "--run", "runs/x", *TINY)
    command = line.split("`")[1]
    assert command == "gptlab prepare data/shakespeare_char/input.txt --out data/shakespeare_char-gptlab", line
    before = tree(folder)
    run_ok(capsys, *shlex.split(command)[1:], "--quiet")  # the hint as written: the user's folder is left alone
    assert tree(folder) == before
    run_ok(capsys, "train", "--data", "data/shakespeare_char-gptlab", "--run", "runs/x", "--max-steps", "1", *TINY)


def test_the_hint_after_a_folder_of_text_prepares_it_under_data(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_texts").mkdir()
    (tmp_path / "my_texts" / "a.txt").write_text(CORPUS, encoding="utf-8")
    line = run_bad(capsys, "train", "--data", "my_texts", "--run", "runs/x", *TINY)
    assert "`gptlab prepare my_texts --out data/my_texts`" in line, line
    (tmp_path / "book.txt").write_text(CORPUS, encoding="utf-8")
    line = run_bad(capsys, "train", "--data", "book.txt", "--run", "runs/x", *TINY)
    assert "`gptlab prepare book.txt --out data/book`" in line, line
    line = run_bad(capsys, "eval", "--run", "runs/none", "--data", "my_texts")
    assert "gptlab prepare my_texts --out data/my_texts" in line or "runs/none" in line, line


# ---- export ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from helpers import tiny_run

    return tiny_run(tmp_path_factory.mktemp("export"), 2, TINY)


HF_FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"someone's weights",
            "tokenizer.json": b"{}"}


@pytest.mark.parametrize("files", [HF_FILES, {"config.json": b'{"model_type": "gpt2"}'}, {"notes.txt": b"mine"}],
                         ids=["hf-model", "config-only", "other"])
@pytest.mark.parametrize("fmt", ["hf", "peft"])
def test_export_refuses_a_folder_of_another_project(tmp_path, capsys, run, files, fmt):
    out = tmp_path / "model"
    out.mkdir()
    for name, content in files.items():
        (out / name).write_bytes(content)
    before = tree(tmp_path)
    line = run_bad(capsys, "export", str(run), "--format", fmt, "--out", str(out))
    if fmt == "hf":
        assert f"{out} holds files gptlab did not write" in line and "--overwrite" in line, line
    assert tree(tmp_path) == before


def test_export_replaces_its_own_export_and_with_overwrite_another_folder(tmp_path, capsys, run):
    from safetensors.torch import load_file

    out = tmp_path / "model"
    run_ok(capsys, "export", str(run), "--out", str(out))
    first = tree(out)
    run_ok(capsys, "export", str(run), "--out", str(out))  # its own export: replaced, no flag needed
    assert tree(out) == first
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for name, content in HF_FILES.items():
        (theirs / name).write_bytes(content)
    run_ok(capsys, "export", str(run), "--out", str(theirs), "--overwrite")
    assert json.loads((theirs / "config.json").read_text())["model_type"] == "gpt2"
    assert load_file(theirs / "model.safetensors")


def test_export_help_says_what_it_replaces(capsys):
    from gptlab.cli import make_parser

    parser = make_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "files in it are replaced" not in text
    assert "--overwrite" in text
