import json
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from helpers import interruptible, tree

from gptlab.data import corpus
from gptlab.data.batches import batch_generator, get_batch, load_dataset
from gptlab.data.prepare import prepare
from gptlab.data.tokenfiles import HEADER, TokenWriter, read_tokens
from gptlab.errors import GptlabError


def test_prepare_writes_headered_files_split_90_10(char_data, corpus_file):
    meta = json.loads((char_data / "meta.json").read_text())
    text = corpus_file.read_text()
    assert meta["train_chars"] == int(len(text) * 0.9) and meta["train_tokens"] == meta["train_chars"]
    assert meta["val_tokens"] == len(text) - meta["train_chars"]
    assert meta["dtype"] == "uint16" and meta["sources"][0]["chars"] == len(text)
    raw = (char_data / "train.bin").read_bytes()
    magic, version, width, count = HEADER.unpack(raw[:HEADER.size])
    assert (magic, version, width, count) == (b"GPTLABTK", 1, 2, meta["train_tokens"])
    ds = load_dataset(char_data)
    assert ds.tokenizer.decode(ds.train.tolist()) + ds.tokenizer.decode(ds.val.tolist()) == text


def test_one_text_is_split_90_10_by_characters_not_bytes(tmp_path):
    text = "".join(f"línea {i}: ☕ café, 日本語 {i * 7}\n" for i in range(300))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    meta = prepare([str(tmp_path / "t.txt")], tmp_path / "d", "char", quiet=True)
    ds, cut = load_dataset(tmp_path / "d"), int(len(text) * 0.9)
    assert len(text.encode()) > 1.2 * len(text) and (meta["train_chars"], meta["val_chars"]) == (cut, len(text) - cut)
    assert ds.tokenizer.decode(ds.train.tolist()) == text[:cut] and ds.tokenizer.decode(ds.val.tolist()) == text[cut:]


def test_bundled_corpus_has_the_reference_split(tmp_path):
    meta = prepare([], tmp_path / "ts", "char", quiet=True)
    assert (meta["train_tokens"], meta["val_tokens"], meta["vocab_size"]) == (1_003_854, 111_540, 65)
    assert meta["sources"][0]["sha256"] == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def test_uint32_when_the_vocabulary_does_not_fit_uint16(tmp_path):
    writer = TokenWriter(tmp_path / "big.bin", vocab_size=70_000)
    writer.write([0, 65_535, 65_536, 69_999])
    writer.close()
    tokens = read_tokens(tmp_path / "big.bin")
    assert tokens.dtype == np.uint32 and tokens.tolist() == [0, 65_535, 65_536, 69_999]


def test_token_ids_outside_the_vocabulary_never_wrap(tmp_path):
    writer = TokenWriter(tmp_path / "x.bin", vocab_size=100)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        writer.write([100])


def test_truncated_token_file_is_refused(char_data):
    path = char_data / "val.bin"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(GptlabError, match="truncated"):
        read_tokens(path)


def test_batches_are_windows_with_targets_shifted_by_one(char_data):
    ds = load_dataset(char_data)
    x, y = get_batch(ds.train, 8, 16, batch_generator(1, 0))
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    train = torch.from_numpy(ds.train.astype(np.int64))
    for row_x, row_y in zip(x, y):  # each row is a real window of the corpus
        starts = [s for s in range(len(train) - 16) if torch.equal(train[s:s + 16], row_x)]
        assert any(torch.equal(train[s + 1:s + 17], row_y) for s in starts)


def test_batches_are_a_pure_function_of_seed_step_micro_and_rank(char_data):
    ds = load_dataset(char_data)
    a = get_batch(ds.train, 4, 8, batch_generator(7, 3, 1, 0))[0]
    assert torch.equal(a, get_batch(ds.train, 4, 8, batch_generator(7, 3, 1, 0))[0])
    for other in [(7, 4, 1, 0), (7, 3, 0, 0), (7, 3, 1, 1), (8, 3, 1, 0)]:
        assert not torch.equal(a, get_batch(ds.train, 4, 8, batch_generator(*other))[0])


def test_folders_and_chunked_streaming_give_the_same_tokens(tmp_path, monkeypatch, corpus_file):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("ünïcode héllo\n" * 30)
    (folder / "sub" / "b.txt").write_text(corpus_file.read_text())
    (folder / ".hidden").write_text("skipped")
    whole = prepare([str(folder)], tmp_path / "d1", "char", quiet=True)
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 7)  # forces splits inside multi-byte characters and lines
    small = prepare([str(folder)], tmp_path / "d2", "char", quiet=True)
    assert len(whole["sources"]) == 2
    assert (tmp_path / "d1" / "train.bin").read_bytes() == (tmp_path / "d2" / "train.bin").read_bytes()
    assert whole["train_sha256"] == small["train_sha256"] and whole["val_sha256"] == small["val_sha256"]
    ds = load_dataset(tmp_path / "d2")  # and both are the files' text, in path order, each character one id,
    text = "ünïcode héllo\n" * 30 + "\n" + corpus_file.read_text()  # a newline between them (no end-of-text)
    chars = sorted(set(text))  # a.txt holds about a tenth of the text: held out, its newline after it
    assert ds.meta["val_documents"] == 1 and ds.meta["val_chars"] == len("ünïcode héllo\n" * 30)
    assert np.concatenate([ds.val, ds.train]).tolist() == [chars.index(c) for c in text]


def test_bpe_and_gpt2_prepare(tmp_path, corpus_file):
    meta = prepare([str(corpus_file)], tmp_path / "bpe", "bpe", vocab_size=300, quiet=True)
    assert 257 < meta["vocab_size"] <= 300 and meta["train_tokens"] < meta["train_chars"]
    meta = prepare([str(corpus_file)], tmp_path / "gpt2", "gpt2", quiet=True)
    assert meta["vocab_size"] == 50257 and meta["dtype"] == "uint16"


def test_empty_corpus_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(GptlabError, match="is empty"):
        prepare([str(tmp_path / "empty.txt")], tmp_path / "out", quiet=True)


def test_non_utf8_names_the_file_and_byte_offset(tmp_path):
    bad = tmp_path / "latin.txt"
    bad.write_bytes(b"hello caf\xe9 world\n")
    with pytest.raises(GptlabError, match=r"latin.txt is not valid utf-8: bad byte at offset 9.*--encoding"):
        prepare([str(bad)], tmp_path / "out", quiet=True)
    meta = prepare([str(bad)], tmp_path / "out", encoding="latin-1", quiet=True)
    assert meta["train_chars"] + meta["val_chars"] == len("hello café world\n")


def test_missing_input_is_refused(tmp_path):
    with pytest.raises(GptlabError, match="does not exist"):
        prepare([str(tmp_path / "nope.txt")], tmp_path / "out", quiet=True)


# ---- one rule for reading text, every way of giving it ---------------------------------------------------------

def test_a_byte_order_mark_and_windows_line_ends_read_like_plain_text(tmp_path, corpus_file):
    text = corpus_file.read_text()
    (tmp_path / "windows.txt").write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    plain = prepare([str(corpus_file)], tmp_path / "plain", "char", quiet=True)
    windows = prepare([str(tmp_path / "windows.txt")], tmp_path / "win", "char", quiet=True)
    assert "\ufeff" not in load_dataset(tmp_path / "win").tokenizer.to_dict()["chars"]
    assert windows["train_sha256"] == plain["train_sha256"] and windows["val_sha256"] == plain["val_sha256"]
    assert corpus.read_text(tmp_path / "windows.txt") == text  # what eval and --prompt-file read: the same rule


def test_standard_input_and_pipes_are_read_like_files(tmp_path, corpus_file):
    import subprocess
    import sys

    reference = prepare([str(corpus_file)], tmp_path / "file", "char", quiet=True)
    for arg, out in (("-", "stdin"), ("/dev/stdin", "devstdin")):
        with open(corpus_file, "rb") as f:
            subprocess.run([sys.executable, "-m", "gptlab", "prepare", arg, "--out", str(tmp_path / out), "--quiet"],
                           stdin=f, check=True, capture_output=True)
        meta = json.loads((tmp_path / out / "meta.json").read_text())
        assert meta["train_sha256"] == reference["train_sha256"] and meta["val_sha256"] == reference["val_sha256"]


def test_the_end_of_text_marker_in_text_is_refused_or_read_as_the_token(tmp_path):
    (tmp_path / "docs.txt").write_text("first document<|endoftext|>second one\n" * 20)
    with pytest.raises(GptlabError, match="docs.txt contains the text <|endoftext|>.*--allow-special"):
        prepare([str(tmp_path / "docs.txt")], tmp_path / "out", "gpt2", quiet=True)
    assert not (tmp_path / "out").exists()
    prepare([str(tmp_path / "docs.txt")], tmp_path / "out", "gpt2", quiet=True, allow_special=True)
    ds = load_dataset(tmp_path / "out")
    assert (np.asarray(ds.train) == 50256).sum() >= 15


def test_tokenizer_from_a_data_folder_gives_the_same_ids(tmp_path, char_data, corpus_file):
    meta = prepare([str(corpus_file)], tmp_path / "again", tokenizer_from=char_data, quiet=True)
    assert meta["train_sha256"] == json.loads((char_data / "meta.json").read_text())["train_sha256"]
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (char_data / "tokenizer.json").read_bytes()


def test_ctrl_c_stops_long_native_work_at_once():
    """Training a BPE vocabulary runs in native code that never returns to Python until it is done; prepare runs it
    through `_interruptible` so that Ctrl-C stops at once. Here the native work is a key derivation that takes
    minutes and, called directly, would hold off Ctrl-C until it finished."""
    import signal
    import subprocess
    import sys

    script = ("import hashlib, sys\nfrom gptlab.data.prepare import _interruptible\nprint('started', flush=True)\n"
              "try:\n    _interruptible(lambda: hashlib.pbkdf2_hmac('sha256', b'k', b's', 500_000_000))\n"
              "except KeyboardInterrupt:\n    sys.exit(130)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            preexec_fn=interruptible)
    try:
        assert proc.stdout.readline() == "started\n"
        time.sleep(0.5)  # inside the native call
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130  # called directly, the derivation would run for minutes
    finally:
        proc.kill()



@pytest.fixture(scope="module")
def words_corpus(tmp_path_factory):
    """A text of about 8 units of encoding (8 M characters), so that two workers encode it for a while."""
    import random

    from gptlab.data.encoder import UNIT_CHARS

    rng, words = random.Random(0), ["speak", "citizen", "first", "all", "hear", "me", "famish", "resolved"]
    path = tmp_path_factory.mktemp("words") / "words.txt"
    with path.open("w", encoding="utf-8") as f:
        for _ in range(8):
            f.write(" ".join(rng.choices(words, k=UNIT_CHARS // 6)) + "\n\n")
    return path


def ctrl_c_to_prepare(argv, until):
    """`gptlab prepare ARGV` in a process group of its own, sent SIGINT as a terminal's Ctrl-C is (to the command
    and its worker processes) once `until(pid)` holds: (exit status, stderr)."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "gptlab", "prepare", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, preexec_fn=interruptible)
    try:
        deadline = time.time() + 120
        while not until(proc.pid):
            assert time.time() < deadline and proc.poll() is None, proc.communicate()[1]
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, err


def workers_started(pid: int) -> bool:
    """Whether process `pid` has started its two worker processes (they may still be importing)."""
    return len(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()) >= 2


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to see the worker processes")
@pytest.mark.parametrize("wait", [0.0, 0.15, 0.6], ids=["as the workers start", "0.15 s later", "0.6 s later"])
def test_ctrl_c_to_a_prepare_with_two_workers_is_one_line(tmp_path, words_corpus, wait):
    """Ctrl-C while two worker processes start up (import) or encode, before the first checkpoint: `gptlab:
    interrupted` and exit 130, no traceback from the workers or their threads; the same command again prepares what
    an uninterrupted one does."""
    argv = [str(words_corpus), "--out", str(tmp_path / "out"), "--workers", "2", "--quiet"]
    started = []

    def until(pid):
        if not started and workers_started(pid):
            started.append(time.time())
        return bool(started) and time.time() >= started[0] + wait
    assert ctrl_c_to_prepare(argv, until) == (130, "gptlab: interrupted\n")
    prepare([str(words_corpus)], tmp_path / "out", "char", quiet=True, workers=2)
    prepare([str(words_corpus)], tmp_path / "straight", "char", quiet=True, workers=1)
    assert tree(tmp_path / "out") == tree(tmp_path / "straight")


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to see the worker processes")
def test_ctrl_c_to_a_prepare_with_two_workers_after_a_checkpoint_keeps_it_in_one_line(tmp_path, words_corpus,
                                                                                      capsys):
    """Ctrl-C once a checkpoint is on disk: one line, `gptlab: interrupted: ` and what is kept, nothing else; the
    same command again resumes from the checkpoint to the bytes of an uninterrupted prepare."""
    from gptlab.cli import main
    from gptlab.data.staging import STAGE

    out = tmp_path / "out"
    argv = [str(words_corpus), "--out", str(out), "--workers", "2", "--shard-tokens", "1000000", "--quiet"]
    code, err = ctrl_c_to_prepare(argv, lambda pid: (out / STAGE / "progress.json").exists())
    (interrupted,) = err.splitlines()
    assert code == 130 and interrupted.startswith(f"gptlab: interrupted: {out / STAGE} keeps "), err
    assert interrupted.endswith("; run the same command again to continue from there"), err
    assert json.loads((out / STAGE / "progress.json").read_text())["units_done"] < 8
    assert main(["prepare", *argv[:-1]]) == 0 and "resuming the prepare interrupted" in capsys.readouterr().err
    prepare([str(words_corpus)], tmp_path / "straight", "char", quiet=True, workers=1, shard_tokens=1000000)
    assert tree(out) == tree(tmp_path / "straight")



LIBRARY_CHILD = """import os, signal, sys
from gptlab.data import encoder
from gptlab.data.prepare import prepare
from gptlab.data.staging import Staging
encoder.UNIT_CHARS = 2000
real = Staging.checkpoint
def checkpoint(self, *args):  # SIGINT once the first checkpoint is on disk
    real(self, *args)
    os.kill(os.getpid(), signal.SIGINT)
Staging.checkpoint = checkpoint
try:
    prepare([sys.argv[1]], sys.argv[2], "char", quiet=True, workers=1, shard_tokens=1000)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_prepare_called_from_python_in_a_background_job_stops_at_ctrl_c_and_keeps_its_checkpoint(tmp_path,
                                                                                                 corpus_file):
    """prepare() itself, not only `gptlab prepare` (whose main restores SIGINT for every command), takes Ctrl-C
    where SIGINT came ignored, as a shell starts a background job (`python script.py &`)."""
    import signal
    import subprocess
    import sys

    from gptlab.data.staging import STAGE

    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", LIBRARY_CHILD, str(corpus_file), str(out)], capture_output=True,
                          text=True, timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert done.returncode == 130, done.stderr
    assert not (out / "meta.json").exists() and (out / STAGE / "progress.json").exists()


# ---- a prepared folder is replaced only by the same data, or with --overwrite ----------------------------------

def test_prepare_refuses_to_replace_data_made_from_other_inputs_or_settings(tmp_path, corpus_file):

    out = tmp_path / "data"
    prepare([str(corpus_file)], out, "char", quiet=True)
    before = tree(out)
    prepare([str(corpus_file)], out, "char", quiet=True)  # the same inputs and settings again: allowed, the same
    assert tree(out) == before
    (tmp_path / "other.txt").write_text("Ünïcode, other text entirely.\n" * 40, encoding="utf-8")
    for paths, settings in (([str(tmp_path / "other.txt")], {}), ([str(corpus_file)], {"val_fraction": 0.2}),
                            ([str(corpus_file)], {"shard_tokens": 5000})):
        with pytest.raises(GptlabError, match=rf"{out} holds data prepared from other inputs or settings; give "
                                              r"--out another folder, or pass --overwrite to replace it"):
            prepare(paths, out, "char", quiet=True, **settings)
        assert tree(out) == before
    meta = prepare([str(tmp_path / "other.txt")], out, "char", quiet=True, overwrite=True)
    assert meta["train_chars"] + meta["val_chars"] == len("Ünïcode, other text entirely.\n" * 40)


def test_the_prepare_verb_names_the_runs_that_train_on_the_folder_it_refuses(tmp_path, corpus_file, monkeypatch,
                                                                           capsys):

    from gptlab.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["prepare", str(corpus_file), "--out", "data", "--quiet"]) == 0
    tiny = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
            "--eval-interval", "2", "--eval-batches", "1", "--max-steps", "2", "--quiet"]
    for run in ("runs/a", "runs/b"):
        assert main(["train", "--data", "data", "--run", run, *tiny]) == 0
    assert main(["train", "--data", str(tmp_path / "data"), "--run", "elsewhere/c", *tiny]) == 0  # not under runs/
    (tmp_path / "other.txt").write_text("Ünïcode, other text entirely.\n" * 40, encoding="utf-8")
    before = tree(tmp_path)
    capsys.readouterr()
    assert main(["prepare", "other.txt", "--out", "data", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data holds data prepared from other inputs or settings" in err[0], err
    assert "which runs runs/a, runs/b train on" in err[0] and "elsewhere" not in err[0] and "--overwrite" in err[0]
    assert tree(tmp_path) == before
    assert main(["prepare", str(corpus_file), "--out", "data", "--quiet"]) == 0  # the same data again
    assert main(["prepare", "other.txt", "--out", "data", "--overwrite", "--quiet"]) == 0


def test_a_folder_prepared_by_the_earlier_split_rule_loads_and_is_kept_not_called_other_data(tmp_path, monkeypatch,
                                                                                            capsys, caplog):
    """Before issue 41 prepare held out int(n x val_fraction) documents whatever their sizes and joined a char
    corpus's documents with nothing. A folder it made still loads, and the same prepare again keeps it as it is
    (runs may train on it), saying why and how to prepare it anew, instead of calling it other data."""
    from gptlab.cli import main
    from gptlab.data import prepare as prepare_module
    from gptlab.data.readers import val_documents_before

    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    for i in range(30):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(f"dokument {i}: {'naïve café ' * (1 + i * i)}", "utf-8")
    with monkeypatch.context() as earlier:  # gptlab as it was
        earlier.setattr(prepare_module, "val_documents", val_documents_before)
        earlier.setattr(prepare_module, "joiner", lambda scan, end_of_text: "")
        old = prepare(["docs"], "data", "char", quiet=True)
    assert old["val_documents"] == 3 and load_dataset("data").meta == old
    before = tree(tmp_path / "data")
    capsys.readouterr()
    assert main(["prepare", "docs", "--out", "data", "--quiet"]) == 0
    said = capsys.readouterr()
    assert "other inputs or settings" not in said.err + caplog.text and tree(tmp_path / "data") == before
    share = old["val_chars"] / (old["train_chars"] + old["val_chars"])
    assert (f"data was prepared from these inputs and settings by an earlier gptlab, which held out {share:.1%} of "
            "the characters (whole documents, by count) and joined the documents with nothing; it is kept as it is, "
            "so that the runs trained on it can go on; pass --overwrite to prepare it again (whole documents "
            "holding about 0.1 of the characters and a newline between documents)") in caplog.text
    assert "30 documents (3 held out)" in said.out
    new = prepare(["docs"], "data", "char", quiet=True, overwrite=True)
    assert abs(new["val_chars"] / (new["train_chars"] + new["val_chars"]) - 0.1) < 0.02 < abs(share - 0.1)
    caplog.clear()
    prepare(["docs"], "data", "char", quiet=True)  # today's folder again: made again, the same, nothing said
    assert caplog.text == "" and load_dataset("data").meta == new


# ---- what prepare says when it refuses, and its recipes --------------------------------------------------------

@pytest.mark.parametrize("files, said", [
    ("abcde", "the corpus (f/a.txt, f/b.txt, f/c.txt, f/d.txt, f/e.txt) is empty; give a file with text in it"),
    ("abcdeé", "the corpus (f/a.txt, f/b.txt, f/c.txt, f/d.txt, f/e.txt ...) is empty; give a file with text in it"),
    ("ay", ("the corpus (f/a.txt, f/y.dat) is empty; give a file with text in it; 1 unreadable file was skipped, "
            "e.g. f/y.dat looks like a binary file (a NUL byte near offset 0); give a text file")),
    ("axy", ("the corpus (f/a.txt, f/x.dat, f/y.dat) is empty; give a file with text in it; 2 unreadable files "
             "were skipped, e.g. f/x.dat looks like a binary file (a NUL byte near offset 0); give a text file")),
], ids=["5 files", "6 files", "1 skipped", "2 skipped"])
def test_an_empty_corpus_is_refused_naming_its_files_and_the_skipped_ones(tmp_path, monkeypatch, files, said):
    monkeypatch.chdir(tmp_path)
    Path("f").mkdir()
    for name in files:  # x and y: binary, the rest empty text files
        Path("f", f"{name}.dat" if name in "xy" else f"{name}.txt").write_bytes(b"\0\0" if name in "xy" else b"")
    with pytest.raises(GptlabError) as refused:
        prepare(["f"], "out", quiet=True)
    assert str(refused.value) == said and not Path("out").exists()


def test_an_empty_validation_corpus_is_refused_by_that_name(tmp_path, monkeypatch, corpus_file):
    monkeypatch.chdir(tmp_path)
    Path("v.txt").write_text("")
    with pytest.raises(GptlabError) as refused:
        prepare([str(corpus_file)], "out", quiet=True, val_paths=["v.txt"])
    assert str(refused.value) == "the validation corpus (v.txt) is empty; give a file with text in it"


@pytest.mark.parametrize("unseen, shown", [("ĀĂĄĆĈ", "'Ā', 'Ă', 'Ą', 'Ć', 'Ĉ'"),
                                           ("ĀĂĄĆĈĊ", "'Ā', 'Ă', 'Ą', 'Ć', 'Ĉ' and 1 more")])
def test_a_char_tokenizer_from_elsewhere_must_know_every_character(tmp_path, char_data, corpus_file, unseen, shown):
    (tmp_path / "new.txt").write_text(corpus_file.read_text() + unseen[::-1] + "\n", encoding="utf-8")
    with pytest.raises(GptlabError) as refused:
        prepare([str(tmp_path / "new.txt")], tmp_path / "out", tokenizer_from=char_data, quiet=True)
    assert str(refused.value) == (f"the text has characters the tokenizer of {char_data} has never seen: {shown}; "
                                  "prepare without --tokenizer-from to build a new vocabulary")


def test_tokenizer_from_takes_a_run_a_data_folder_or_a_tokenizer_file_and_nothing_else(tmp_path, char_data,
                                                                                      corpus_file):
    import shutil

    for name, config in (("run", {"model": {}, "train": {}}), ("hf", {"model_type": "gpt2", "train": True})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        shutil.copy(char_data / "tokenizer.json", tmp_path / name)
    want = json.loads((char_data / "meta.json").read_text())["train_sha256"]
    for i, given in enumerate((tmp_path / "run", char_data / "tokenizer.json")):
        assert prepare([str(corpus_file)], tmp_path / f"o{i}", tokenizer_from=given, quiet=True)["train_sha256"] == want
    for given in (tmp_path / "hf", tmp_path / "missing"):
        with pytest.raises(GptlabError) as refused:
            prepare([str(corpus_file)], tmp_path / "out", tokenizer_from=given, quiet=True)
        assert str(refused.value) == (f"--tokenizer-from {given} is not a gptlab run or prepared data folder; point "
                                      "it at one (it must hold tokenizer.json)")


@pytest.mark.parametrize("files, kind", [
    ({"meta.json": "{}", "train.bin": ""}, "data"), ({"meta.json": "{}", "train-00000.bin": ""}, "data"),
    ({"meta.json": "{}"}, None), ({"train.bin": ""}, None), ({}, None),
    ({"config.json": '{"model": {}, "train": {}}'}, "run"), ({"config.json": '{"model": 1, "train": 2, "x": 3}'}, "run"),
    ({"config.json": '{"model_type": "gpt2", "train": 1}'}, "hf"), ({"config.json": '["model", "train"]'}, "hf"),
    ({"config.json": '{"model": '}, "hf"),
])
def test_what_a_folder_holds_decides_what_may_be_written_over_it(tmp_path, files, kind):
    from gptlab.rundir import folder_kind

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert folder_kind(tmp_path) == kind


def test_the_refusal_to_replace_data_names_the_runs_trained_on_it():
    from gptlab.data.prepare import OtherData

    tail = "(replaced, it could no longer resume them or evaluate them on their data); give --out another folder, " \
        "or pass --overwrite to replace it"
    one, two = OtherData(Path("d"), [Path("runs/a")]), OtherData(Path("d"), [Path("runs/a"), Path("rüns/b")])
    assert one.out == Path("d")
    assert str(one) == f"d holds data prepared from other inputs or settings, which run runs/a trains on {tail}"
    assert str(two) == f"d holds data prepared from other inputs or settings, which runs runs/a, rüns/b train on {tail}"


def test_work_run_off_the_main_thread_returns_its_value_or_raises_its_error():
    import threading

    from gptlab.data.prepare import _interruptible

    assert _interruptible(lambda: ["ünï", 3]) == ["ünï", 3]
    assert _interruptible(lambda: threading.current_thread().daemon) is True  # abandoned, it dies with the process

    def fails():
        raise GptlabError("the vocabulary cannot be trained")
    with pytest.raises(GptlabError, match="^the vocabulary cannot be trained$"):
        _interruptible(fails)


def test_a_batch_generator_is_seeded_by_a_hash_of_seed_step_micro_and_rank():
    """The recipe, which the batches of a run resumed by a later gptlab depend on: blake2b-64 of
    "seed/step/micro/rank", read little-endian, top bit cleared."""
    import hashlib

    for args, text in (((7, 3), "7/3/0/0"), ((7, 3, 2, 1), "7/3/2/1"), ((0, 123_456), "0/123456/0/0")):
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & (2 ** 63 - 1)
        expected = torch.randint(10 ** 6, (8,), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(torch.randint(10 ** 6, (8,), generator=batch_generator(*args)), expected), args


def test_the_fingerprints_of_a_prepare_and_of_its_dataset_follow_their_recipes(tmp_path, corpus_file):
    """Runs and later prepares compare them across gptlab versions: sha256 of the sorted JSON of what they cover."""
    import hashlib

    meta = prepare([str(corpus_file)], tmp_path / "d", "char", quiet=True)
    what = {"version": 1, "sources": [hashlib.sha256(corpus_file.read_bytes()).hexdigest()], "tokenizer": ["char", 1024],
            "encoding": "utf-8", "text_field": "text", "allow_special": False, "shard_tokens": 100_000_000,
            "val_fraction": 0.1, "held": None}  # one document: split by characters, none held out
    assert meta["fingerprint"] == hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
    ds = load_dataset(tmp_path / "d")
    on_disk = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert ds.path == tmp_path / "d" and ds.meta == on_disk
    assert ds.fingerprint() == hashlib.sha256(json.dumps(on_disk, sort_keys=True).encode()).hexdigest()


def test_a_split_of_exactly_block_size_plus_one_tokens_has_one_window_and_a_shorter_one_is_refused():
    from gptlab.data.tokenfiles import ShardedTokens

    tokens = np.arange(9, dtype=np.uint16) * 3
    for split in (tokens, ShardedTokens([tokens[:4], tokens[4:]])):
        x, y = get_batch(split, 2, 8, batch_generator(0, 0))
        assert x.dtype == y.dtype == torch.int64
        assert x.tolist() == [list(range(0, 24, 3))] * 2 and y.tolist() == [list(range(3, 27, 3))] * 2
    with pytest.raises(GptlabError) as refused:
        get_batch(tokens, 2, 9, batch_generator(0, 0))
    assert str(refused.value) == ("the split has 9 tokens, fewer than block_size + 1 = 10; use a longer corpus or a "
                                  "smaller --block-size")


@pytest.mark.parametrize("damage", ["no meta.json", "not JSON", "a list", "counts"])
def test_a_missing_or_damaged_data_folder_is_refused_in_one_line(char_data, corpus_file, damage, monkeypatch):
    monkeypatch.chdir(char_data.parent.parent)  # the hint's data/NAME is under the working folder: a new name there

    meta = json.loads((char_data / "meta.json").read_text())
    said = {"no meta.json": f"{char_data} is not a prepared data folder (no meta.json); make one from its text with "
                            f"`gptlab prepare {char_data} --out data/data` and train with --data data/data",
            "not JSON": f"{char_data / 'meta.json'} is damaged; run `gptlab prepare` again",
            "a list": f"{char_data / 'meta.json'} is damaged; run `gptlab prepare` again",
            "counts": f"the token files in {char_data} do not match its meta.json ({meta['train_tokens']} / "
                      f"{meta['val_tokens']} tokens, meta.json says {meta['train_tokens'] + 1} / {meta['val_tokens']}); "
                      "run `gptlab prepare` again"}[damage]
    if damage == "no meta.json":
        (char_data / "meta.json").unlink()
    else:
        (char_data / "meta.json").write_text({"not JSON": '{"train_tokens": ', "a list": "[1, 2]"}.get(damage) or
                                             json.dumps({**meta, "train_tokens": meta["train_tokens"] + 1}))
    with pytest.raises(GptlabError) as refused:
        load_dataset(char_data)
    assert str(refused.value) == said
    if damage == "a list":  # nor is it taken for prepared data, to be written over
        with pytest.raises(GptlabError, match="holds files gptlab did not write"):
            prepare([str(corpus_file)], char_data, "char", quiet=True)


def test_the_hint_for_an_unprepared_data_path_names_its_text_and_a_new_folder_under_data(tmp_path, monkeypatch):
    """What `--data PATH` is told when PATH holds no meta.json: the prepare command for its text (nanoGPT's
    input.txt where the folder has one, else the folder or file itself) into data/NAME, or data/NAME-gptlab when
    that would be PATH itself or another folder already there; a name with a space quoted for the shell."""
    monkeypatch.chdir(tmp_path)

    def hint(path):
        with pytest.raises(GptlabError) as refused:
            load_dataset(path)
        return str(refused.value)

    def told(path, source, out):
        return (f"{path} is not a prepared data folder (no meta.json); make one from its text with "
                f"`gptlab prepare {source} --out {out}` and train with --data {out}")

    (tmp_path / "data" / "shakespeare_char").mkdir(parents=True)  # nanoGPT's layout: data/NAME/input.txt
    (tmp_path / "data" / "shakespeare_char" / "input.txt").write_text("some text\n")
    assert hint("data/shakespeare_char") == told("data/shakespeare_char", "data/shakespeare_char/input.txt",
                                                 "data/shakespeare_char-gptlab")
    (tmp_path / "notes.v2").mkdir()  # a folder of texts: its whole name, suffix and all
    (tmp_path / "notes.v2" / "a.txt").write_text("some text\n")
    assert hint("notes.v2") == told("notes.v2", "notes.v2", "data/notes.v2")
    (tmp_path / "data" / "notes.v2").mkdir()  # another folder of that name already under data/: never written over
    assert hint("notes.v2") == told("notes.v2", "notes.v2", "data/notes.v2-gptlab")
    (tmp_path / "book.txt").write_text("some text\n")  # a text file: its stem
    assert hint("book.txt") == told("book.txt", "book.txt", "data/book")
    (tmp_path / "my texts").mkdir()
    assert hint("my texts") == told("my texts", "'my texts'", "'data/my texts'")
    assert hint("/") == told("/", "/", "data/corpus")  # no name at all
    assert hint("nowhere") == ("nowhere does not exist; give --data a folder made by `gptlab prepare TEXT --out "
                               "data/NAME`")


@pytest.mark.parametrize("block_size", [1, 4])
def test_one_pass_holds_every_target_once_for_splits_below_at_and_past_each_row_edge(block_size):
    """pass_batches (evaluation's whole pass over a small split) on splits of 2 to 4 * block_size + 3 tokens: the
    n - 1 targets each in exactly one row, after the token before it, in ceil((n - 1) / block_size) rows that each
    hold one (pass_rows says how many without reading the split), then rows of -1 alone up to a whole batch of
    3."""
    from gptlab.data.batches import Dataset, pass_batches, pass_rows

    for n in range(2, 4 * block_size + 4):
        ids = np.arange(100, 100 + n, dtype=np.uint16)  # distinct: a target names its position
        batches = pass_batches(Dataset(Path("."), ids, ids, None, {}), "val", 3, block_size)
        assert pass_rows(Dataset(Path("."), ids, ids, None, {}), "val", block_size) == -(-(n - 1) // block_size)
        assert all(x.shape == y.shape == (3, block_size) and x.dtype == y.dtype == torch.int64 for x, y in batches)
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        rows = -(-(n - 1) // block_size)
        assert len(x) == -(-rows // 3) * 3, (n, len(x))
        assert sorted(y[y != -1].tolist()) == list(range(101, 100 + n)), n
        assert torch.equal(x[y != -1], y[y != -1] - 1), n
        assert (y[:rows] != -1).any(dim=1).all() and (y[rows:] == -1).all(), n


def test_a_drawn_batch_comes_from_the_split_asked_for():
    from gptlab.data.batches import Dataset, draw_batch

    train, val = np.arange(0, 200, dtype=np.uint16), np.arange(500, 600, dtype=np.uint16)
    ds = Dataset(Path("."), train, val, None, {})
    for split, low, high in (("train", 0, 200), ("val", 500, 600)):
        x, y = draw_batch(ds, split, 4, 8, batch_generator(0, 0))
        assert bool(((x >= low) & (x < high)).all() and (y == x + 1).all()), split


def test_one_pass_over_a_conversation_split_reads_that_split_with_its_own_pieces():
    """Conversations: a row from each piece's start, its own targets where the mask trains them, from the split
    asked for (train and val differ in tokens, masks and pieces here)."""
    from gptlab.data.batches import Dataset, pass_batches

    train, val = np.arange(10, 30, dtype=np.uint16), np.arange(50, 62, dtype=np.uint16)
    train_mask = np.ones(20, dtype=np.uint8)
    train_mask[3] = 0  # a token that is no lesson
    chat = {"train": (train_mask, np.array([0, 8, 20])), "val": (np.ones(12, dtype=np.uint8), np.array([0, 12]))}
    ds = Dataset(Path("."), train, val, None, {}, chat)
    for split, lessons in (("train", [11, 12, 14, 15, 16, 17, *range(19, 30)]), ("val", list(range(51, 62)))):
        batches = pass_batches(ds, split, 2, 16)
        y = torch.cat([b[1] for b in batches])
        assert len(batches) == 1 and y.dtype == torch.int64 and sorted(y[y != -1].tolist()) == lessons, split


def test_the_end_of_text_of_a_document_ending_at_the_split_goes_to_train(tmp_path):
    """Three documents of 50, 40 and 10 characters split by characters at 90: the second ends exactly there."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for name, text in (("a.txt", "ä" * 49 + "\n"), ("b.txt", "b" * 39 + "\n"), ("c.txt", "c" * 9 + "\n")):
        (folder / name).write_text(text, encoding="utf-8")
    meta = prepare([str(folder)], tmp_path / "out", "gpt2", quiet=True)
    ds = load_dataset(tmp_path / "out")
    assert (meta["train_chars"], meta["val_chars"]) == (90, 10)
    assert ds.train.tolist()[-1] == 50256 and ds.train.tolist().count(50256) == 2 and ds.val.tolist().count(50256) == 1
    assert ds.tokenizer.decode(ds.val.tolist()) == "c" * 9 + "\n<|endoftext|>"


class Bar:
    """Stands in for tqdm: records how prepare's progress bars are made, what they count and the rate they show."""
    made: ClassVar[list] = []

    def __init__(self, **kwargs):
        self.kwargs, self.n, self.postfix, self.format_dict = kwargs, 0, [], {"elapsed": 0.5}
        Bar.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def update(self, n):
        self.n += n

    def set_postfix_str(self, s, refresh=True):
        self.postfix.append((s, refresh))


@pytest.mark.parametrize("quiet", [False, True])
def test_the_bars_count_the_bytes_read_and_show_the_encoding_rate(tmp_path, monkeypatch, quiet):
    import tqdm

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    monkeypatch.setattr(Bar, "made", [])
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"dokument {i}: naïve café ☕\n" * (20 + i), encoding="utf-8")
    size = sum(p.stat().st_size for p in (tmp_path / "docs").iterdir())
    meta = prepare([str(tmp_path / "docs")], tmp_path / "out", "char", quiet=quiet, workers=1)
    scan, encode = Bar.made
    shown = {"unit": "B", "unit_scale": True, "disable": True if quiet else None, "leave": False}
    assert scan.kwargs == {"total": size, "desc": "scan", **shown} and scan.n == size
    assert encode.kwargs == {"total": size, "desc": "encode", **shown} and encode.n == size
    rate = (meta["train_tokens"] + meta["val_tokens"]) / 0.5  # tokens over the bar's elapsed seconds
    assert encode.postfix[-1] == (f"{rate:,.0f} tokens/s", False)


def test_a_resumed_prepare_says_what_it_keeps_unless_quiet(tmp_path, monkeypatch, capsys):
    import shutil

    from gptlab.data import encoder
    from gptlab.data.staging import STAGE, Staging

    monkeypatch.setattr(encoder, "UNIT_CHARS", 2000)
    (tmp_path / "docs").mkdir()
    for i in range(300):
        (tmp_path / "docs" / f"{i:03d}.txt").write_text(f"Dok {i}: {'ünïcode fox ' * (3 + i % 7)}☕\n", "utf-8")
    real, seen = Staging.checkpoint, []

    def checkpoint(self, units_done, writers):
        real(self, units_done, writers)
        seen.append(units_done)
        if len(seen) == 3:
            raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(Staging, "checkpoint", checkpoint)
        with pytest.raises(KeyboardInterrupt):
            prepare([str(tmp_path / "docs")], tmp_path / "a", "char", quiet=True, workers=1, shard_tokens=1000)
    splits = json.loads((tmp_path / "a" / STAGE / "progress.json").read_text())["splits"]
    kept = [sum(e["tokens"] for e in s["closed"]) + s["open_tokens"] for s in splits]
    shards = sum(len(s["closed"]) for s in splits)
    assert kept[0] > 0 and kept[1] > 0 and shards >= 2
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    capsys.readouterr()
    prepare([str(tmp_path / "docs")], tmp_path / "a", "char", quiet=True, workers=1, shard_tokens=1000)
    assert capsys.readouterr().err == ""
    prepare([str(tmp_path / "docs")], tmp_path / "b", "char", quiet=False, workers=1, shard_tokens=1000)
    assert (f"resuming the prepare interrupted in {tmp_path / 'b' / STAGE}: {sum(kept):,} tokens already written, "
            f"{shards} complete shards\n") in capsys.readouterr().err


def test_for_a_char_tokenizer_the_end_of_text_marker_is_plain_text(tmp_path):
    text = "first document<|endoftext|>second, ünïcode\n" * 20
    (tmp_path / "docs.txt").write_text(text, encoding="utf-8")
    prepare([str(tmp_path / "docs.txt")], tmp_path / "out", "char", quiet=True)
    ds = load_dataset(tmp_path / "out")
    assert ds.tokenizer.decode(ds.train.tolist()) + ds.tokenizer.decode(ds.val.tolist()) == text


def test_a_char_corpus_joins_its_documents_with_a_newline_that_is_not_counted_as_their_text(tmp_path):
    """The char tokenizer has no end-of-text token: a newline goes between documents, in the vocabulary even when
    no document holds one; the characters counted are the documents' own."""
    (tmp_path / "r.jsonl").write_text('{"text": "one good line"}\n{"text": "two good"}\n', encoding="utf-8")
    meta = prepare([str(tmp_path / "r.jsonl")], tmp_path / "out", "char", quiet=True)
    ds = load_dataset(tmp_path / "out")
    assert ds.tokenizer.decode(ds.train.tolist()) + ds.tokenizer.decode(ds.val.tolist()) == "one good line\ntwo good"
    assert "\n" in ds.tokenizer.to_dict()["chars"] and meta["documents"] == 2
    assert meta["train_chars"] + meta["val_chars"] == len("one good linetwo good")
    assert meta["train_tokens"] + meta["val_tokens"] == len("one good line\ntwo good")


def test_a_single_char_document_gets_no_newline_it_does_not_hold(tmp_path):
    (tmp_path / "one.txt").write_text("a single line without an end " * 4, encoding="utf-8")
    prepare([str(tmp_path / "one.txt")], tmp_path / "out", "char", quiet=True)
    ds = load_dataset(tmp_path / "out")
    assert "\n" not in ds.tokenizer.to_dict()["chars"]
    assert ds.tokenizer.decode(ds.train.tolist() + ds.val.tolist()) == "a single line without an end " * 4


def test_the_held_out_documents_hold_about_val_fraction_of_the_characters(tmp_path):
    """180 short documents and 24 long ones: a tenth of the documents by count held from 0.7 % to 16 % of the
    text as the seed fell (issue 41: 20 of 204 documents were 2.6 % of the tokens); a tenth of the characters is
    held out instead, whole documents still."""
    lines = [{"text": f"short {i:03d}"} for i in range(180)] + [{"text": "long " * 199 + f"{i:04d}"} for i in range(24)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    for seed in range(6):
        meta = prepare([str(tmp_path / "docs.jsonl")], tmp_path / f"out{seed}", "char", quiet=True, seed=seed)
        total = meta["train_chars"] + meta["val_chars"]
        assert meta["split"] == "documents" and abs(meta["val_chars"] / total - 0.1) < 0.005, (seed, meta["val_chars"])


def test_each_documents_end_of_text_is_on_the_side_of_its_document(tmp_path):
    (tmp_path / "docs").mkdir()
    for i in range(20):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(f"dokument {i}: {'naïve café ' * (2 + i % 3)}\n", "utf-8")
    meta = prepare([str(tmp_path / "docs")], tmp_path / "out", "gpt2", quiet=True)
    ds = load_dataset(tmp_path / "out")
    assert meta["split"] == "documents" and 0 < meta["val_documents"] < 20
    assert ds.val.tolist().count(50256) == meta["val_documents"] and ds.train.tolist().count(50256) == 20 - meta[
        "val_documents"]


def test_text_with_the_end_of_text_marker_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from gptlab.data import encoder

    monkeypatch.setattr(encoder, "UNIT_CHARS", 50)  # checkpoints early, were the text encoded
    (tmp_path / "docs").mkdir()
    for i in range(30):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(f"dokument {i}: naïve café\n" * 3, "utf-8")
    (tmp_path / "docs" / "99.txt").write_text("the last one<|endoftext|>\n")
    with pytest.raises(GptlabError, match="99.txt contains the text <|endoftext|>"):
        prepare([str(tmp_path / "docs")], tmp_path / "out", "gpt2", quiet=True, workers=1, shard_tokens=20)
    assert not (tmp_path / "out").exists()


def test_prepare_takes_its_settings_whole_or_by_name_not_both(tmp_path, corpus_file):
    from gptlab.config import PrepareConfig

    whole = prepare([str(corpus_file)], tmp_path / "a", PrepareConfig(val_fraction=0.3, shard_tokens=5000), quiet=True)
    named = prepare([str(corpus_file)], tmp_path / "b", "char", val_fraction=0.3, shard_tokens=5000, quiet=True)
    assert (whole["val_fraction"], whole["shard_tokens"]) == (0.3, 5000)
    assert {k: v for k, v in whole.items() if k != "sources"} == {k: v for k, v in named.items() if k != "sources"}
    with pytest.raises(TypeError, match="as a PrepareConfig or by name, not both"):
        prepare([str(corpus_file)], tmp_path / "c", PrepareConfig(), vocab_size=300, quiet=True)
    assert not (tmp_path / "c").exists()


def test_the_short_form_takes_the_tokenizer_by_its_name_too(tmp_path, corpus_file):
    """prepare(paths, out, tokenizer="char", ...) is how Python callers named the tokenizer before PrepareConfig."""
    by_name = prepare([str(corpus_file)], tmp_path / "a", tokenizer="char", val_fraction=0.3, quiet=True)
    in_place = prepare([str(corpus_file)], tmp_path / "b", "char", val_fraction=0.3, quiet=True)
    assert {k: v for k, v in by_name.items() if k != "sources"} == {k: v for k, v in in_place.items() if k != "sources"}
    with pytest.raises(TypeError, match="tokenizer twice"):
        prepare([str(corpus_file)], tmp_path / "c", "bpe", tokenizer="char", quiet=True)
    assert not (tmp_path / "c").exists()


# ---- where prepare may write, what meta.json records, what --tokenizer-from decides ------------------------------

def test_prepare_refuses_to_write_into_a_run_or_a_model_folder(tmp_path, corpus_file):
    for name, config, holds in (("run", {"model": {}, "train": {}}, "a gptlab run"),
                                ("hf", {"model_type": "gpt2", "n_layer": 2}, "a model (config.json)")):
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps(config))
        before = tree(out)
        with pytest.raises(GptlabError) as refused:
            prepare([str(corpus_file)], out, quiet=True)
        assert str(refused.value) == (f"{out} holds {holds}; preparing data there would overwrite its files, so give "
                                      "--out a folder of its own")
        assert tree(out) == before


def test_the_short_forms_tokenizer_is_char_unless_named():
    from gptlab.data.prepare import prepare_config

    assert prepare_config().tokenizer == "char"
    assert (prepare_config(vocab_size=300, seed=3).tokenizer, prepare_config(seed=3).seed) == ("char", 3)
    assert prepare_config("bpe", 300).tokenizer == "bpe"


def test_meta_json_records_the_format_the_encoding_the_seed_and_how_val_was_chosen(tmp_path):
    (tmp_path / "docs").mkdir()
    for i in range(20):
        (tmp_path / "docs" / f"{i:02d}.txt").write_bytes(f"dokument {i}: café crème\n".encode("latin-1"))
    (tmp_path / "val.txt").write_bytes("la validación\n".encode("latin-1"))
    prepare([str(tmp_path / "docs")], tmp_path / "a", quiet=True, encoding="latin-1", seed=7)
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    _, version, _, _ = HEADER.unpack((tmp_path / "a" / "train.bin").read_bytes()[:HEADER.size])
    assert (meta["format_version"], version) == (1, 1)  # the token files' format, as their header says
    assert (meta["encoding"], meta["split"], meta["val_fraction"], meta["seed"], meta["val_documents"]) == (
        "latin-1", "documents", 0.1, 7, 2)  # 20 documents: 2 held out, chosen by seed 7
    prepare([str(tmp_path / "docs")], tmp_path / "b", quiet=True, encoding="latin-1",
            val_paths=[str(tmp_path / "val.txt")])
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert (meta["split"], meta["val_fraction"], meta["val_documents"]) == ("validation files", None, 1)
    assert meta["val_chars"] == len("la validación\n")


def test_meta_json_counts_every_skipped_file_and_bad_record_and_lists_the_first_20(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("f").mkdir()
    for i in range(21):
        Path("f", f"bin{i:02d}.dat").write_bytes(b"\0\0binary")
    Path("f", "good.txt").write_text("some text, enough of it\n" * 20)
    Path("f", "recs.jsonl").write_text(json.dumps({"text": "a good record"}) + "\n" + '{"text": null}\n' * 21)
    meta = prepare(["f"], "out", quiet=True)
    on_disk = json.loads(Path("out", "meta.json").read_text())
    assert on_disk["skipped_files"] == 21 and [s["path"] for s in on_disk["skipped"]] == [
        f"f/bin{i:02d}.dat" for i in range(20)]  # path order
    assert on_disk["skipped_records"] == 21 and [(r["path"], r["line"]) for r in on_disk["bad_records"]] == [
        ("f/recs.jsonl", line) for line in range(2, 22)]
    assert meta["skipped"] == on_disk["skipped"] and meta["bad_records"] == on_disk["bad_records"]


def test_the_same_text_encoded_with_another_tokenizer_from_elsewhere_is_other_data(tmp_path, corpus_file, char_data):
    from gptlab.data.prepare import OtherData

    (tmp_path / "wider.txt").write_text(corpus_file.read_text() + "\t\n", encoding="utf-8")  # a tab: every id moves
    prepare([str(tmp_path / "wider.txt")], tmp_path / "wider", quiet=True)
    out = tmp_path / "out"
    prepare([str(corpus_file)], out, tokenizer_from=char_data, quiet=True)
    before = tree(out)
    with pytest.raises(OtherData):
        prepare([str(corpus_file)], out, tokenizer_from=tmp_path / "wider", quiet=True)
    assert tree(out) == before
    prepare([str(corpus_file)], out, tokenizer_from=char_data, quiet=True)  # the same tokenizer again: allowed
    assert tree(out) == before


def test_another_seed_holding_out_other_documents_is_other_data(tmp_path):
    from gptlab.data.prepare import OtherData

    (tmp_path / "docs").mkdir()
    for i in range(20):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(f"dokument {i}: {'naïve café ' * (2 + i % 3)}\n", "utf-8")
    held = {}
    for seed in (0, 1):
        prepare([str(tmp_path / "docs")], tmp_path / f"s{seed}", quiet=True, seed=seed)
        ds = load_dataset(tmp_path / f"s{seed}")
        held[seed] = ds.tokenizer.decode(ds.val.tolist())
    assert held[0] != held[1]  # the two seeds hold out other documents
    before = tree(tmp_path / "s0")
    with pytest.raises(OtherData):
        prepare([str(tmp_path / "docs")], tmp_path / "s0", quiet=True, seed=1)
    assert tree(tmp_path / "s0") == before


def test_a_bpe_vocabulary_is_trained_on_the_text_field_named(tmp_path):
    line = "the cat sat on the mat; the cat sat on the hat. "
    (tmp_path / "recs.jsonl").write_text("".join(json.dumps({"id": i, "body": line * 3}) + "\n" for i in range(40)))
    meta = prepare([str(tmp_path / "recs.jsonl")], tmp_path / "out", "bpe", vocab_size=300, text_field="body",
                   quiet=True)
    tok = load_dataset(tmp_path / "out").tokenizer
    assert 257 < meta["vocab_size"] <= 300 and meta["documents"] == 40
    assert [len(tok.encode(word)) for word in (" cat", " sat", " the")] == [1, 1, 1]  # its frequent words


def test_a_tokenizer_from_elsewhere_with_an_end_of_text_token_refuses_the_marker_in_text(tmp_path, corpus_file):
    prepare([str(corpus_file)], tmp_path / "gpt2", "gpt2", quiet=True)
    (tmp_path / "docs.txt").write_text("first document<|endoftext|>second one\n" * 20)
    with pytest.raises(GptlabError) as refused:
        prepare([str(tmp_path / "docs.txt")], tmp_path / "out", tokenizer_from=tmp_path / "gpt2", quiet=True)
    assert str(refused.value) == (f"{tmp_path / 'docs.txt'} contains the text <|endoftext|>, which this tokenizer "
                                  "reserves for the end of a document; pass --allow-special to read it as that token, "
                                  "or remove it")
    assert not (tmp_path / "out").exists()
    prepare([str(tmp_path / "docs.txt")], tmp_path / "out", tokenizer_from=tmp_path / "gpt2", allow_special=True,
            quiet=True)
    ds = load_dataset(tmp_path / "out")
    assert np.concatenate([ds.train, ds.val]).tolist().count(50256) == 21  # 20 in the text, 1 ending the document


def test_tokenizer_from_decides_the_tokenizer_whatever_tokenizer_says(tmp_path):
    """A char tokenizer from elsewhere must know every character, and reads the end-of-text marker as plain text (it
    has no such token), also when --tokenizer names another kind: --tokenizer-from decides."""
    text = "first document<|endoftext|>second, ünïcode\n" * 20
    (tmp_path / "docs.txt").write_text(text, encoding="utf-8")
    prepare([str(tmp_path / "docs.txt")], tmp_path / "chars", "char", quiet=True)
    for kind in ("char", "bpe", "gpt2"):
        out = tmp_path / f"out-{kind}"
        meta = prepare([str(tmp_path / "docs.txt")], out, kind, tokenizer_from=tmp_path / "chars", quiet=True)
        ds = load_dataset(out)
        assert (meta["tokenizer"], ds.tokenizer.decode(np.concatenate([ds.train, ds.val]).tolist())) == ("char", text)
    (tmp_path / "new.txt").write_text(text + "Ā\n", encoding="utf-8")
    for kind in ("char", "bpe"):
        with pytest.raises(GptlabError) as refused:
            prepare([str(tmp_path / "new.txt")], tmp_path / "out", kind, tokenizer_from=tmp_path / "chars", quiet=True)
        assert str(refused.value) == (f"the text has characters the tokenizer of {tmp_path / 'chars'} has never seen: "
                                      "'Ā'; prepare without --tokenizer-from to build a new vocabulary")
