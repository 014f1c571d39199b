"""Corpora as people have them: source trees with __pycache__, binary and foreign-encoded files, FineWeb-shaped
JSON-lines and Parquet shards, compressed or not (corpus.py and readers.py)."""

import bz2
import email
import gzip
import io
import json
import multiprocessing
import os
import py_compile
import random
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from gptlab.cli import main
from gptlab.data import corpus, encoder, readers
from gptlab.data.batches import load_dataset
from gptlab.data.prepare import prepare
from gptlab.errors import GptlabError
from gptlab.tokenizer import GPT2Tokenizer

TEXTS = [f"Document {i}: the café opened at {i} o'clock.\nIt served {i * 7} cups of tea — "
         f"{'naïve ' * (i % 4)}customers liked it.\n" for i in range(40)] + ["short", "\n\nblank lines\r\n"]


def fineweb_records() -> list[dict]:
    """Records in the shape of FineWeb's (text first, then metadata the reader must ignore)."""
    return [{"text": t, "id": f"<urn:uuid:{i:08d}>", "dump": "CC-MAIN-2024-10", "url": f"https://example.com/{i}",
             "date": "2024-02-21T00:00:00Z", "language": "en", "language_score": 0.93, "token_count": len(t)}
            for i, t in enumerate(TEXTS)]


def write_jsonl(path: Path, records: list[dict], opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return path


def split_documents(ids: list[int], eot: int) -> list[list[int]]:
    """Token ids cut after each end-of-text token (the last id must be one)."""
    assert ids[-1] == eot
    cuts = [i + 1 for i, t in enumerate(ids) if t == eot]
    return [ids[a:b - 1] for a, b in zip([0] + cuts, cuts)]


def held_out(ds, texts: list[str]) -> tuple[list[int], list[int]]:
    """The indices of `texts` in the train and val splits of `ds`, each split checked to be exactly the direct
    tokenization of its documents, each closed by the end-of-text token, in reading order."""
    tok, sides = ds.tokenizer, []
    for ids in (ds.train.tolist(), ds.val.tolist()):
        docs = split_documents(ids, tok.eot_id)
        sides.append([texts.index(tok.decode(d)) for d in docs])
        assert docs == [tok.encode(texts[i]) for i in sides[-1]] and sides[-1] == sorted(sides[-1])
    return sides[0], sides[1]


def fraction_gap(val: list[int], fraction: float) -> int:
    """How far the documents `val` of TEXTS fall short of `fraction` of all their characters (int(): as prepare
    aims)."""
    return int(sum(map(len, TEXTS)) * fraction) - sum(len(TEXTS[i]) for i in val)


def test_fineweb_shaped_shards_give_the_ids_of_direct_tokenization(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "PARQUET_BATCH_ROWS", 5)  # several record batches per file
    records = fineweb_records()
    shards = tmp_path / "fineweb"
    shards.mkdir()
    write_jsonl(shards / "000.jsonl", records[:10])
    write_jsonl(shards / "001.jsonl.gz", records[10:20], gzip.open)
    write_jsonl(shards / "002.jsonl.bz2", records[20:25], bz2.open)
    frames = [zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in part).encode())
              for part in (records[25:28], records[28:30])]
    (shards / "003.jsonl.zst").write_bytes(b"".join(frames))  # two frames, as parallel writers make
    blank = [{**records[0], "text": ""}, {**records[0], "text": None}]  # left out, as empty JSON lines are
    pq.write_table(pa.Table.from_pylist(records[30:36] + blank + records[36:]), shards / "004.parquet",
                   row_group_size=4)
    meta = prepare([str(shards)], tmp_path / "data", "gpt2", quiet=True)
    train, val = held_out(load_dataset(tmp_path / "data"), TEXTS)
    assert sorted(train + val) == list(range(len(TEXTS))) and val
    assert 0 <= fraction_gap(val, 0.1) < min(len(TEXTS[i]) for i in train)  # each one left out would not fit
    assert meta["documents"] == len(TEXTS) and [s["documents"] for s in meta["sources"]] == [10, 10, 5, 5, 12]
    assert (meta["split"], meta["val_documents"]) == ("documents", len(val))
    assert meta["val_chars"] == sum(len(TEXTS[i]) for i in val)


def test_validation_holds_out_whole_documents_chosen_by_the_seed(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", fineweb_records())
    chosen = {}
    for name, seed, fraction in (("a", 0, 0.2), ("b", 0, 0.2), ("c", 1, 0.2), ("d", 0, 0.5)):
        prepare([str(path)], tmp_path / name, "bpe", vocab_size=300, val_fraction=fraction, seed=seed, quiet=True)
        chosen[name] = held_out(load_dataset(tmp_path / name), TEXTS)[1]
    assert chosen["a"] == chosen["b"] and chosen["a"] != chosen["c"]
    for name, fraction in (("a", 0.2), ("c", 0.2), ("d", 0.5)):  # a fraction of the characters, within a document
        left = [i for i in range(len(TEXTS)) if i not in chosen[name]]
        assert 0 <= fraction_gap(chosen[name], fraction) < min(len(TEXTS[i]) for i in left), name
    few = write_jsonl(tmp_path / "few.jsonl", fineweb_records()[:5])  # fewer than 1 / val_fraction documents
    meta = prepare([str(few)], tmp_path / "few", "char", quiet=True)
    assert meta["split"] == "characters" and meta["train_chars"] == int(sum(map(len, TEXTS[:5])) * 0.9)


def test_compressed_and_plain_forms_give_byte_identical_token_files(tmp_path, monkeypatch):
    plain = write_jsonl(tmp_path / "a.jsonl", fineweb_records())
    forms = {"plain": plain, "gz": tmp_path / "a.jsonl.gz", "zst": tmp_path / "a.jsonl.zst",
             "bz2": tmp_path / "a.jsonl.bz2", "txt.gz": tmp_path / "t.txt.gz"}
    forms["gz"].write_bytes(gzip.compress(plain.read_bytes()))
    forms["zst"].write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    forms["bz2"].write_bytes(bz2.compress(plain.read_bytes()))
    forms["txt.gz"].write_bytes(gzip.compress("".join(TEXTS).encode()))
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 11)  # JSON lines longer than a chunk
    made = {k: prepare([str(p)], tmp_path / k, "char", quiet=True) for k, p in forms.items()}
    assert len({m["train_sha256"] for k, m in made.items() if k != "txt.gz"}) == 1
    assert made["plain"]["documents"] == len(TEXTS) and made["txt.gz"]["documents"] == 1
    text = load_dataset(tmp_path / "txt.gz")
    assert text.tokenizer.decode(text.train.tolist() + text.val.tolist()) == "".join(TEXTS).replace("\r\n", "\n")


def test_text_field_names_the_field_that_holds_the_text(tmp_path):
    records = [{"content": t, "id": i} for i, t in enumerate(TEXTS)]
    path = write_jsonl(tmp_path / "stack.jsonl", records)
    with pytest.raises(GptlabError, match=r"stack.jsonl line 1 has no text field 'text' \(its fields: content, id\), "
                                          r"and no line of it is a good record; pass --text-field"):
        prepare([str(path)], tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()
    meta = prepare([str(path)], tmp_path / "out", quiet=True, text_field="content")
    assert meta["documents"] == len(TEXTS) and meta["text_field"] == "content"
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "stack.parquet")
    with pytest.raises(GptlabError, match=r"no text column 'text' \(its columns: content, id\)"):
        prepare([str(tmp_path / "stack.parquet")], tmp_path / "out2", quiet=True)


def make_messy_folder(root: Path) -> Path:
    """A download folder: text in several forms, and files that are not text or not UTF-8."""
    (root / "sub" / "__pycache__").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.txt").write_text(TEXTS[0])
    (root / "sub" / "b.md").write_text(TEXTS[1])
    (root / "sub" / "c.py").write_text("print('hello')\n")
    (root / "sub" / "__pycache__" / "c.cpython-311.pyc").write_bytes(b"\x00\x01binary")
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "photo.png").write_bytes(bytes(range(256)))
    (root / "latin.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (root / "broken.txt.gz").write_bytes(b"not gzip at all")
    (root / "config.json").write_text('{\n  "name": "x"\n}\n')
    return root


def test_unreadable_files_in_folders_are_skipped_and_counted_unless_strict(tmp_path):
    folder = make_messy_folder(tmp_path / "messy")
    meta = prepare([str(folder)], tmp_path / "out", quiet=True)
    assert [Path(s["path"]).name for s in meta["sources"]] == ["a.txt", "b.md", "c.py"]
    assert sorted(Path(s["path"]).name for s in meta["skipped"]) == [
        "broken.txt.gz", "config.json", "latin.txt", "photo.png"]
    assert meta["skipped_files"] == 4 and meta["skipped_folders"] == 2
    reasons = {Path(s["path"]).name: s["reason"] for s in meta["skipped"]}
    assert "could not be decompressed" in reasons["broken.txt.gz"] and "not JSON" in reasons["config.json"]
    with pytest.raises(GptlabError, match="broken.txt.gz could not be decompressed"):
        prepare([str(folder)], tmp_path / "strict", quiet=True, strict=True)
    assert not (tmp_path / "strict").exists()
    with pytest.raises(GptlabError, match="latin.txt is not valid utf-8"):  # a file named is never skipped
        prepare([str(folder / "latin.txt")], tmp_path / "named", quiet=True)


def test_include_and_exclude_globs(tmp_path):
    folder = make_messy_folder(tmp_path / "messy")
    meta = prepare([str(folder)], tmp_path / "py", quiet=True, include=["*.py", "*.md"], exclude=["*.md"])
    assert [Path(s["path"]).name for s in meta["sources"]] == ["c.py"] and meta["skipped_files"] == 0
    meta = prepare([str(folder)], tmp_path / "nosub", quiet=True, exclude=["sub/*", "*.png", "*.gz"])
    assert [Path(s["path"]).name for s in meta["sources"]] == ["a.txt"] and meta["skipped_files"] == 2
    with pytest.raises(GptlabError, match="no files that pass --include / --exclude found"):
        prepare([str(folder)], tmp_path / "none", quiet=True, include=["*.rst"])


def test_every_document_ends_with_the_end_of_text_token_and_val_names_the_validation_corpus(tmp_path):
    write_jsonl(tmp_path / "docs.jsonl", [{"text": "one"}, {"text": ""}, {"text": "two"}])
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "held.txt").write_text("three")
    meta = prepare([str(tmp_path / "docs.jsonl")], tmp_path / "out", "gpt2", quiet=True,
                   val_paths=[str(tmp_path / "val")])
    ds = load_dataset(tmp_path / "out")
    tok = ds.tokenizer
    assert meta["documents"] == 3 and meta["split"] == "validation files"  # the empty record is left out
    assert ds.train.tolist() == tok.encode("one") + [tok.eot_id] + tok.encode("two") + [tok.eot_id]
    assert ds.val.tolist() == tok.encode("three") + [tok.eot_id]
    (tmp_path / "val" / "held.txt").write_text("")
    with pytest.raises(GptlabError, match=r"the validation corpus \(.*held.txt\) is empty"):
        prepare([str(tmp_path / "docs.jsonl")], tmp_path / "out2", quiet=True, val_paths=[str(tmp_path / "val")])


@pytest.fixture
def email_tree(tmp_path):
    """The standard library's email package as it lies on disk, with its __pycache__ of compiled files, plus a
    stray binary file of the kind download folders hold."""
    tree = tmp_path / "email"
    shutil.copytree(Path(email.__file__).parent, tree)
    for source in sorted(tree.glob("*.py"))[:3]:  # make sure a __pycache__ with .pyc files exists
        py_compile.compile(str(source), cfile=str(tree / "__pycache__" / f"{source.stem}.pyc"), doraise=True)
    shutil.copy(tree / "__pycache__" / f"{min(tree.glob('*.py')).stem}.pyc", tree / "stray.pyc")
    return tree


def test_the_email_package_prepares_trains_samples_and_evaluates(tmp_path, monkeypatch, capsys, email_tree):
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", str(email_tree), "--out", "data", "--quiet"]) == 0
    out = capsys.readouterr().out
    pycache = len(list(email_tree.rglob("__pycache__")))
    assert pycache >= 1 and f"skipped {pycache} hidden or __pycache__ folder" in out
    assert f"skipped 1 unreadable file ({email_tree / 'stray.pyc'}): binary" in out
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    texts = [p for p in email_tree.rglob("*") if p.suffix in (".py", ".rst") and p.stat().st_size]
    assert meta["documents"] == len(texts) and meta["skipped_files"] == 1
    tiny = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
            "--eval-interval", "5", "--eval-batches", "2", "--precision", "fp32", "--quiet"]
    assert main(["train", "--data", "data", "--run", "runs/email", "--max-steps", "5", *tiny]) == 0
    assert main(["sample", "--run", "runs/email", "--prompt", "def ", "--max-new-tokens", "20", "--seed", "1"]) == 0
    assert main(["eval", "--run", "runs/email"]) == 0
    out = capsys.readouterr().out
    assert "def " in out and "bits/char" in out


def test_char_vocabulary_comes_from_readable_files_only(tmp_path):
    folder = make_messy_folder(tmp_path / "messy")
    prepare([str(folder)], tmp_path / "out", quiet=True)
    ds = load_dataset(tmp_path / "out")
    text = TEXTS[0] + "\n" + TEXTS[1] + "\n" + "print('hello')\n"  # a.txt, sub/b.md, sub/c.py, a newline between
    assert ds.tokenizer.to_dict() == {"type": "char", "chars": sorted(set(text))}
    assert np.concatenate([ds.train, ds.val]).tolist() == [sorted(set(text)).index(c) for c in text]


def test_workers_give_byte_identical_token_files(tmp_path, monkeypatch):
    monkeypatch.setattr(encoder, "UNIT_CHARS", 500)  # many units, so that two processes share the work
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "a.jsonl", fineweb_records() * 3)
    (shards / "b.txt").write_text("".join(TEXTS) * 5)  # one long document, cut into pieces by the reader
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 300)
    made = {n: prepare([str(shards)], tmp_path / f"w{n}", "gpt2", quiet=True, workers=n) for n in (1, 2)}
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()
    assert made[1]["train_tokens"] > 5000
    with pytest.raises(GptlabError, match="--workers must be at least 1, not 0"):
        prepare([str(shards)], tmp_path / "w0", quiet=True, workers=0)


def test_the_encoding_bar_of_compressed_inputs_knows_its_total(tmp_path, monkeypatch):
    """A compressed file's text size is unknown until read: the scan counts it, so the encoding pass (the long one)
    can show the time left."""
    import tqdm

    totals = {}
    real = tqdm.tqdm

    def recording(*args, **kwargs):
        totals[kwargs.get("desc")] = kwargs.get("total")
        return real(*args, **kwargs)
    monkeypatch.setattr(tqdm, "tqdm", recording)
    write_jsonl(tmp_path / "part.jsonl.gz", fineweb_records(), gzip.open)
    meta = prepare([str(tmp_path / "part.jsonl.gz")], tmp_path / "out", "char", quiet=True, workers=1)
    assert totals["scan"] is None  # the rate alone while scanning
    assert totals["encode"] == meta["sources"][0]["bytes"] == len(gzip.decompress((tmp_path / "part.jsonl.gz")
                                                                                   .read_bytes()))


@pytest.mark.parametrize("chunk", [corpus.CHUNK_BYTES, 13])
def test_the_last_json_line_counts_without_a_final_newline(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", chunk)
    texts = TEXTS + ["el último café ☕, sin salto de línea"]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in texts), encoding="utf-8")
    assert path.read_bytes().endswith("línea\"}".encode())
    meta = prepare([str(path)], tmp_path / "out", "gpt2", quiet=True)
    train, val = held_out(load_dataset(tmp_path / "out"), texts)
    assert meta["documents"] == len(texts) and sorted(train + val) == list(range(len(texts)))


def test_a_utf16_file_is_binary_though_it_is_valid_utf8(tmp_path):
    """UTF-16 of ASCII text is every other byte NUL: valid UTF-8, and no text to learn from."""
    text = "plain ASCII text, as UTF-16 spells it\n" * 20
    data = text.encode("utf-16-le")
    assert data.decode("utf-8") == "".join(c + "\x00" for c in text)
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXTS[0], encoding="utf-8")
    (folder / "wide.txt").write_bytes(data)
    with pytest.raises(GptlabError, match=r"wide.txt looks like a binary file \(a NUL byte near offset 1\)"):
        prepare([str(folder / "wide.txt")], tmp_path / "named", quiet=True)
    assert not (tmp_path / "named").exists()
    meta = prepare([str(folder)], tmp_path / "out", quiet=True)
    assert [Path(s["path"]).name for s in meta["sources"]] == ["a.txt"]
    assert [Path(s["path"]).name for s in meta["skipped"]] == ["wide.txt"] and "binary" in meta["skipped"][0]["reason"]


def bad_records_file(path: Path) -> Path:
    """TEXTS as JSON lines with three bad records among them: line 4 {"text": null}, line 8 without the field,
    line 12 not JSON (cut off)."""
    good = [json.dumps({"text": t, "id": i}, ensure_ascii=False) for i, t in enumerate(TEXTS)]
    lines = good[:3] + ['{"text": null, "id": "x"}'] + good[3:6] + ['{"id": 7, "títle": "no text"}'] + good[6:9] + \
        ['{"text": "cut off, the café'] + good[9:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("given", ["named", "in a folder"])
def test_a_bad_json_record_is_skipped_and_counted_with_its_file_and_line(tmp_path, capsys, given):
    path = bad_records_file(tmp_path / "in" / "docs.jsonl")
    meta = prepare([str(path if given == "named" else path.parent)], tmp_path / "out", "gpt2", quiet=True)
    train, val = held_out(load_dataset(tmp_path / "out"), TEXTS)  # every good record, nothing of the bad ones
    assert sorted(train + val) == list(range(len(TEXTS))) and meta["documents"] == len(TEXTS)
    assert meta["skipped_files"] == 0 and meta["skipped_records"] == 3
    assert [(r["path"], r["line"]) for r in meta["bad_records"]] == [(str(path), 4), (str(path), 8), (str(path), 12)]
    reasons = [r["reason"] for r in meta["bad_records"]]
    assert "null" in reasons[0] and "no text field 'text' (its fields: id, títle)" in reasons[1]
    assert "is not JSON" in reasons[2]
    assert main(["prepare", str(path), "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    assert f"skipped 3 bad records ({path}:4, {path}:8, {path}:12)" in capsys.readouterr().out
    with pytest.raises(GptlabError, match=rf"{path} line 4 has text field 'text' null, not a string.*--strict"):
        prepare([str(path if given == "named" else path.parent)], tmp_path / "strict", quiet=True, strict=True)
    assert not (tmp_path / "strict").exists()


# ---- corpus.py's sources, directly ------------------------------------------------------------------------------

def _packed(path: Path, data: bytes) -> bytes:
    name = path.name.lower()
    return gzip.compress(data) if name.endswith(".gz") else bz2.compress(data) if name.endswith(".bz2") else \
        zstandard.ZstdCompressor().compress(data) if name.endswith(".zst") else data


@pytest.mark.parametrize("name, kind, packed", [
    ("notes.txt", "text", False), ("LICENSE", "text", False), ("notes.gz", "text", True), ("a.TXT.GZ", "text", True),
    ("docs.JSONL", "jsonl", False), ("docs.json.bz2", "jsonl", True), ("v1.2.jsonl.zst", "jsonl", True),
    ("archive.tar.gz", "text", True), ("t.parquet", "parquet", True), ("t.parquet.gz", "text", True)])
def test_a_files_name_tells_its_kind_and_compression(tmp_path, name, kind, packed):
    path = tmp_path / name
    path.write_bytes(_packed(path, "café ☕\n".encode() * 50))
    source = corpus.file_source(path)
    assert (source.name, source.path, source.size, source.found) == (str(path), path, path.stat().st_size, False)
    assert (source.kind, source.packed) == (kind, packed)
    with source.open() as f:
        assert f.read() == (path.read_bytes() if kind == "parquet" else "café ☕\n".encode() * 50)


def test_a_zstd_file_is_closed_with_its_reader(tmp_path):
    (tmp_path / "a.zst").write_bytes(zstandard.ZstdCompressor().compress(b"text\n"))
    before = len(list(Path("/proc/self/fd").iterdir()))
    f = corpus.open_file(tmp_path / "a.zst", "zstd")
    assert f.read() == b"text\n"
    f.close()
    assert len(list(Path("/proc/self/fd").iterdir())) == before  # the compressed file's descriptor too


def test_the_bundled_and_spooled_sources_read_like_files():
    shakespeare = corpus.bundled_source()
    with shakespeare.open() as f:  # Tiny Shakespeare's input.txt: 1,115,394 ASCII characters
        assert (shakespeare.name, shakespeare.size, len(f.read())) == ("tinyshakespeare (bundled)", 1_115_394, 1_115_394)
    spooled = corpus.spooled_source("standard input", io.BytesIO("café ☕\n".encode()))
    assert (spooled.name, spooled.size, spooled.kind) == ("standard input", len("café ☕\n".encode()), "text")
    for _ in range(2):
        with spooled.open() as f:
            assert f.read() == "café ☕\n".encode()


def test_standard_input_and_a_pipe_are_spooled_under_their_names_and_stdin_stays_open(tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_bytes("from stdin ☕\n".encode())
    with open(tmp_path / "in.txt", "rb") as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        r, w = os.pipe()
        os.write(w, b"from a pipe\n")
        os.close(w)
        try:
            sources = corpus.collect_sources(["-", f"/dev/fd/{r}"])
        finally:
            os.close(r)
        os.fstat(stdin.fileno())  # still open: reading "-" must not close the process's standard input
    assert [s.name for s in sources] == ["standard input", f"/dev/fd/{r}"]
    assert [s.open().read() for s in sources] == ["from stdin ☕\n".encode(), b"from a pipe\n"]


def test_files_named_and_found_keep_their_order_and_pass_the_globs(tmp_path):
    folder = make_messy_folder(tmp_path / "messy")
    (tmp_path / "b.md").write_text("b")
    (tmp_path / "a.txt").write_text("a")
    got = corpus.collect_sources([str(tmp_path / "b.md"), str(folder), str(tmp_path / "a.txt")], exclude=["*.png"])
    inside = [p for p in sorted(folder.rglob("*")) if p.is_file() and ".git" not in p.parts and "__pycache__" not in
              p.parts and p.suffix != ".png"]
    assert [(s.name, s.found) for s in got] == [(str(tmp_path / "b.md"), False), *[(str(p), True) for p in inside],
                                                (str(tmp_path / "a.txt"), False)]
    assert [s.name for s in corpus.collect_sources([str(tmp_path / "a.txt"), str(tmp_path / "b.md")],
                                                   include=["*.md"], exclude=[".*"])] == [str(tmp_path / "b.md")]


def test_folders_prune_hidden_and_pycache_folders_by_path(tmp_path):
    folder = make_messy_folder(tmp_path / "messy")
    pruned = ["before"]
    files = corpus.folder_files(folder, pruned)
    assert pruned == ["before", str(folder / ".git"), str(folder / "sub" / "__pycache__")]
    assert files == sorted(p for p in folder.rglob("*") if p.is_file() and ".git" not in p.parts
                           and "__pycache__" not in p.parts)


def test_no_files_found_names_every_input(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(GptlabError, match=rf"^no files found in {tmp_path / 'a'}, {tmp_path / 'b'}; give text files "
                                          "or folders of text files$"):
        corpus.collect_sources([str(tmp_path / "a"), str(tmp_path / "b")])


# ---- encoder.py: units, and the processes that encode them ------------------------------------------------------

def test_units_close_once_they_hold_size_characters():
    pieces = [(0, "x" * n, False) for n in (2, 2, 1, 5, 2, 2, 1, 3)]
    assert [[len(p[1]) for p in unit] for unit in encoder.units(iter(pieces), 5)] == [[2, 2, 1], [5], [2, 2, 1], [3]]


def test_a_unit_is_encoded_side_by_side_as_int32_and_special_text_only_when_allowed():
    tok = GPT2Tokenizer()  # "a" 64, "b" 65, <|endoftext|> 50256
    train, val = encoder.encode_unit(tok, [(1, "a<|endoftext|>b", True), (1, "", True)], True)
    assert (train.dtype, val.dtype, train.tolist(), val.tolist()) == (np.int32, np.int32, [], [64, 50256, 65, 50256,
                                                                                                   50256])
    assert [(a.tolist(), b.tolist()) for a, b in encoder.encode_units(tok, [[(0, "a<|endoftext|>", False)]], 1,
                                                                      True)] == [([64, 50256], [])]
    with pytest.raises(GptlabError, match="special token"):  # not allowed by default
        list(encoder.encode_units(tok, [[(0, "a<|endoftext|>", False)]], 1))
    assert list(encoder.encode_units(tok, iter([]), 2)) == []


def test_encoding_processes_are_spawned_fresh_and_hold_two_units_each(monkeypatch):
    tok, pulled = GPT2Tokenizer(), []
    texts = [f"unit {i} café<|endoftext|>" for i in range(8)]
    expected = [(tok.encode(t, True), []) if i % 2 == 0 else ([], tok.encode(t, True)) for i, t in enumerate(texts)]

    def stream():
        for i, text in enumerate(texts):
            pulled.append(i)
            yield [(i % 2, text, False)]

    def here(*args):  # an Exception, not pytest.fail's BaseException, which would kill a worker and hang the pool
        raise AssertionError("a unit was encoded in the calling process, or in a worker that inherited its state")
    monkeypatch.setattr(encoder, "encode_unit", here)
    for workers in (2, 3):  # 3: not this machine's core count, which a pool of the default size would have
        pulled.clear()
        before = len(multiprocessing.active_children())
        it = encoder.encode_units(tok, stream(), workers, allow_special=True)
        first = next(it)
        assert len(pulled) == 2 * workers and len(multiprocessing.active_children()) - before == workers
        assert [(a.tolist(), b.tolist()) for a, b in [first, *it]] == expected


def test_a_single_unit_is_encoded_here_whatever_the_workers():
    before = set(multiprocessing.active_children())
    it = encoder.encode_units(GPT2Tokenizer(), [[(0, "only one", False)]], 4)
    assert next(it)[0].tolist() == GPT2Tokenizer().encode("only one")
    assert not [p for p in multiprocessing.active_children() if p not in before]  # no process started for it
    assert list(it) == []


def _consume(it, seconds=120):
    """What iterating `it` to the end raised, from a thread that may wait at most `seconds` (a wait for ever fails
    the test instead of hanging it)."""
    outcome = []

    def run():
        try:
            outcome.append(list(it))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return outcome[0]


def _big_units(count=8):
    """Units of 2.6 million characters of distinct words: each takes a worker about 0.3 s, and its 1.5 million ids
    (6 MB) do not fit in a pipe's buffer."""
    rng = random.Random(0)
    text = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyzé") for _ in range(rng.randint(2, 9)))
                    for _ in range(400_000))
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ([(0, text.translate(str.maketrans(letters, letters[i:] + letters[:i])), False)] for i in range(count))


def test_leaving_the_encoding_early_ends_the_workers_even_with_big_results_unread():
    before = set(multiprocessing.active_children())
    it = encoder.encode_units(GPT2Tokenizer(), _big_units(), 2)
    next(it)
    closer = threading.Thread(target=it.close, daemon=True)  # a worker blocked sending a result nobody reads
    closer.start()  # must be ended, not waited for
    closer.join(60)
    assert not closer.is_alive(), "closing the encoding waits for ever for the workers"
    assert not [p for p in multiprocessing.active_children() if p not in before]


def test_a_worker_that_dies_ends_the_encoding_with_one_line_and_ends_the_others_instead_of_a_wait_for_ever():
    units = _big_units()
    before = set(multiprocessing.active_children())
    it = encoder.encode_units(GPT2Tokenizer(), units, 2)
    next(it)
    workers = [p for p in multiprocessing.active_children() if p not in before]
    assert len(workers) == 2
    for worker in workers:  # what the out-of-memory killer does, while unit 2 at least is being encoded: a pool
        os.kill(worker.pid, signal.SIGKILL)  # replaces a dead worker and waits for its unit for ever
    error = _consume(it, 60)
    assert isinstance(error, GptlabError) and str(error) == (
        "a worker process encoding the text was killed by signal 9 (out of memory?); run the same command again to "
        "continue from the last checkpoint, with --workers 1 if it happens again")
    assert not [p for p in multiprocessing.active_children() if p not in before]


def test_a_worker_encodes_what_arrives_in_order_sends_a_units_error_back_and_stops_at_none(monkeypatch):
    """The worker's loop, run here (a spawned worker's own run is seen only through the results it sends)."""
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # it ignores Ctrl-C in its own process, not in pytest's
    tok = GPT2Tokenizer()
    inbox, to_worker = multiprocessing.Pipe(duplex=False)
    from_worker, outbox = multiprocessing.Pipe(duplex=False)
    for unit in ([(0, "ab", False)], [(1, "é<|endoftext|>", False)], [(1, "cd", True)], None, [(0, "after", False)]):
        to_worker.send(unit)
    encoder._work(tok.to_dict(), False, inbox, outbox)  # returns at None
    first, error, third = (from_worker.recv() for _ in range(3))
    assert (first[0].tolist(), first[1].tolist()) == (tok.encode("ab"), [])
    assert isinstance(error, GptlabError) and "special token" in str(error)  # special text is not allowed here
    assert (third[0].tolist(), third[1].tolist()) == ([], tok.encode("cd") + [tok.eot_id])
    assert not from_worker.poll(0.5)  # nothing after None was encoded
    to_worker.close()


def test_a_worker_whose_unit_is_cut_halfway_by_ctrl_c_ends_quietly(monkeypatch):
    """Ctrl-C can stop the caller halfway through sending a unit (bigger than the pipe's buffer, it goes in pieces):
    the worker's reader then meets the end of the pipe inside a message (OSError, not EOFError). The worker ends as
    at the end of its units, without a traceback from its reader thread (the caller ends it anyway)."""
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # it ignores Ctrl-C in its own process, not in pytest's
    failures = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    inbox, to_worker = multiprocessing.Pipe(duplex=False)
    from_worker, outbox = multiprocessing.Pipe(duplex=False)
    to_worker.send([(0, "ab", False)])
    os.write(to_worker.fileno(), (1000).to_bytes(4, "big") + b"x" * 10)  # a 1000-byte unit cut after 10 bytes
    to_worker.close()
    worker = threading.Thread(target=encoder._work, args=(GPT2Tokenizer().to_dict(), False, inbox, outbox),
                              daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the worker waits for ever for a unit that never comes"
    assert not failures, [f.exc_value for f in failures]
    assert from_worker.recv()[0].tolist() == GPT2Tokenizer().encode("ab") and not from_worker.poll(0.1)


def test_a_ctrl_c_while_a_worker_starts_comes_once_the_start_is_done():
    """A start cut halfway leaves a child that prints the traceback of its half-read start: Ctrl-C is held off
    until the start is done, then raised, neither lost nor doubled; the child starts with SIGINT blocked."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as gptlab's main has it, whatever pytest's
    reached = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with encoder._sigint_held():
                signal.raise_signal(signal.SIGINT)  # Ctrl-C, halfway through a start
                reached.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        assert reached == [True] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_worker_that_cannot_be_started_is_said_so_not_taken_for_a_full_disk(tmp_path, monkeypatch):
    """A worker process that fails to start (no process left, or it died before reading its start: Broken pipe) is
    named as such, in one line, not reported as token files that cannot be written."""
    from multiprocessing.context import SpawnProcess

    def start(self):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(SpawnProcess, "start", start)
    (tmp_path / "t.txt").write_text("abc " * 3000, encoding="utf-8")
    monkeypatch.setattr(encoder, "UNIT_CHARS", 2000)
    with pytest.raises(GptlabError, match=r"^cannot start a worker process to encode the text \(Broken pipe\); run the "
                                          r"same command again, with --workers 1 if it happens again$"):
        prepare([str(tmp_path / "t.txt")], tmp_path / "out", "char", quiet=True, workers=2)


def test_a_worker_that_exits_with_a_unit_pending_is_named_with_its_exit_code():
    worker = encoder._Worker(multiprocessing.get_context("spawn"), GPT2Tokenizer().to_dict(), False)
    worker.send(None)  # the end: it exits at once, with status 0, before the unit the caller waits for
    with pytest.raises(GptlabError, match=r"^a worker process encoding the text exited with code 0 \(out of memory\?\); "):
        worker.receive()


def test_a_worker_killed_halfway_through_sending_its_result_is_named_with_its_signal():
    """A result bigger than the pipe's buffer is written in pieces: the out-of-memory killer may strike between
    two of them, and the reader then sees the end of the pipe inside a message (OSError, not EOFError)."""
    worker = encoder._Worker(multiprocessing.get_context("spawn"), GPT2Tokenizer().to_dict(), False)
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.process.join()
    reader, writer = multiprocessing.Pipe(duplex=False)
    os.write(writer.fileno(), (1000).to_bytes(4, "big") + b"x" * 10)  # a 1000-byte message cut after 10 bytes
    writer.close()
    worker.outbox = reader
    with pytest.raises(GptlabError, match=r"^a worker process encoding the text was killed by signal 9 \(out of "):
        worker.receive()


def test_a_program_that_stops_reading_halfway_exits_without_waiting_for_the_workers(tmp_path):
    script = tmp_path / "half.py"
    script.write_text("import sys\nfrom gptlab.data import encoder\nfrom gptlab.tokenizer import GPT2Tokenizer\n"
                      "if __name__ == '__main__':\n"
                      "    units = ([(0, f'unit {i}', False)] for i in range(50))\n"
                      "    KEPT = encoder.encode_units(GPT2Tokenizer(), units, 2)\n"
                      "    print(next(KEPT)[0].tolist(), flush=True)\n"
                      "    sys.exit(0)  # the generator left open: the interpreter ends the workers at exit\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, f"{GPT2Tokenizer().encode('unit 0')}\n"), done.stderr


def test_a_units_error_in_a_worker_reaches_the_caller_and_ends_the_workers():
    before = set(multiprocessing.active_children())
    units = [[(0, "ab", False)], [(0, "é<|endoftext|>", False)], [(0, "cd", False)], [(0, "ef", False)]]
    it = encoder.encode_units(GPT2Tokenizer(), units, 2)  # special text is refused unless allowed
    assert next(it)[0].tolist() == GPT2Tokenizer().encode("ab")
    error = _consume(it)
    assert isinstance(error, GptlabError) and "special token" in str(error), error
    assert not [p for p in multiprocessing.active_children() if p not in before]
