"""Token files read and written at the edges (tokenfiles.py), a split's shards written resumably and prepare's
staging folder (staging.py): expected bytes and ids worked out with struct, hashlib and plain lists."""

import errno
import fcntl
import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import tree

from gptlab.data import encoder
from gptlab.data import prepare as prepare_module
from gptlab.data.batches import load_dataset
from gptlab.data.prepare import prepare
from gptlab.data.staging import STAGE, ShardWriter, Staging
from gptlab.data.tokenfiles import ShardedTokens, TokenWriter, data_files, read_split, read_tokens
from gptlab.errors import GptlabError

DOCS = [f"Dok {i}: {'ünïcode bröwn fox ' * (2 + i % 5)}— café ☕ 日本 {i * 7}.\n" for i in range(300)]


def header(version: int, width: int, count: int) -> bytes:
    """A token file's 32 bytes by hand: magic, version, bytes per token, count, 8 bytes of padding."""
    return struct.pack("<8sIIQ", b"GPTLABTK", version, width, count) + bytes(8)


def ids_on_disk(path: Path, width: int = 2) -> list[int]:
    return np.fromfile(path, dtype=f"<u{width}", offset=32).tolist()


# ---- token files ---------------------------------------------------------------------------------------------------

def test_a_vocabulary_of_exactly_65536_ids_is_stored_in_two_bytes(tmp_path):
    writer = TokenWriter(tmp_path / "t.bin", vocab_size=65_536)
    assert writer.path == tmp_path / "t.bin"
    writer.write([0, 65_535, 7])
    writer.close()
    raw = (tmp_path / "t.bin").read_bytes()
    assert raw[:32] == header(1, 2, 3) and len(raw) == 32 + 3 * 2
    tokens = read_tokens(tmp_path / "t.bin")
    assert tokens.dtype == np.uint16 and tokens.tolist() == [0, 65_535, 7]


def test_files_of_one_id_and_of_none_read_back(tmp_path):
    one = TokenWriter(tmp_path / "one.bin", 300)
    one.write([299])
    one.close()
    assert read_tokens(tmp_path / "one.bin").tolist() == [299]
    TokenWriter(tmp_path / "none.bin", 300).close()
    assert (tmp_path / "none.bin").read_bytes() == header(1, 2, 0)
    empty = read_tokens(tmp_path / "none.bin")
    assert len(empty) == 0 and np.issubdtype(empty.dtype, np.unsignedinteger)


def test_an_unclosed_token_file_never_reads_as_complete(tmp_path):
    writer = TokenWriter(tmp_path / "t.bin", 300)
    writer.write([5])
    writer.sync()  # the id is on disk, the header's count is not yet
    with pytest.raises(GptlabError, match="the header says 0 tokens but the file holds 1"):
        read_tokens(tmp_path / "t.bin")
    writer.close()


@pytest.mark.parametrize("raw, message", [
    ("plain text, long enough to hold a header: ünïcode ☕".encode(), "is not a gptlab token file"),
    (b"GPTLABTK\x01\x00", "is not a gptlab token file"),  # the magic, then cut inside the header
    (header(2, 2, 1) + b"\x01\x00", "has token-file version 2 / width 2, which this gptlab cannot read"),
    (header(1, 3, 1) + b"\x01\x00\x00", "has token-file version 1 / width 3, which this gptlab cannot read"),
    (header(1, 2, 10) + bytes(17), "the header says 10 tokens but the file holds 8; run `gptlab prepare` again"),
], ids=["text", "cut header", "version 2", "width 3", "17 bytes of ids"])
def test_a_file_that_is_not_a_readable_token_file_is_refused_in_one_line(tmp_path, raw, message):
    (tmp_path / "t.bin").write_bytes(raw)
    with pytest.raises(GptlabError, match=message):
        read_tokens(tmp_path / "t.bin")


def test_token_files_are_mapped_read_only(tmp_path):
    writer = TokenWriter(tmp_path / "t.bin", 300)
    writer.write([1, 2, 3])
    writer.close()
    tokens = read_tokens(tmp_path / "t.bin")
    with pytest.raises(ValueError, match="read-only"):
        tokens[0] = 9
    del tokens
    assert ids_on_disk(tmp_path / "t.bin") == [1, 2, 3]


def test_a_resume_refuses_a_file_shorter_than_its_checkpoint_or_without_the_magic(tmp_path):
    path = tmp_path / "t.bin.part"
    path.write_bytes(header(1, 2, 0) + np.arange(5, dtype="<u2").tobytes())
    with pytest.raises(ValueError, match="shorter than its checkpoint"):
        TokenWriter(path, 300, resume_at=6)
    path.write_bytes(b"NOTMAGIC" + bytes(24) + np.arange(5, dtype="<u2").tobytes())
    with pytest.raises(ValueError, match="shorter than its checkpoint"):
        TokenWriter(path, 300, resume_at=5)
    path.write_bytes(header(1, 2, 0) + np.arange(5, dtype="<u2").tobytes())
    again = TokenWriter(path, 300, resume_at=5)  # the file holds exactly the checkpoint: nothing to cut
    again.write([9])
    again.close()
    assert ids_on_disk(path) == [0, 1, 2, 3, 4, 9]


# ---- a split's shards read as one stream ---------------------------------------------------------------------------

@pytest.fixture
def stream():
    """(4 shards of uint16 ids, one of a single id, read as one; the same ids as a plain list)"""
    rng = np.random.default_rng(3)
    shards = [rng.integers(0, 300, n).astype(np.uint16) for n in (5, 1, 7, 4)]
    return ShardedTokens(shards), np.concatenate(shards).tolist()


def test_every_index_and_slice_of_shards_is_that_of_the_plain_list(stream):
    tokens, whole = stream
    n = len(whole)
    assert len(tokens) == n == 17 and [int(tokens[i]) for i in range(-n, n)] == whole + whole
    for i in (n, n + 3, -n - 1):
        with pytest.raises(IndexError, match=f"is outside a split of {n}"):
            tokens[i]
    for a in range(-n - 2, n + 3):
        for b in range(-n - 2, n + 3):
            for step in (None, 1, 2, 3, -1, -2, -4):
                part = tokens[a:b:step]
                assert part.tolist() == whole[a:b:step] and part.dtype == np.uint16, (a, b, step)


def test_windows_of_shards_are_those_of_the_plain_list_in_the_ids_dtype(stream):
    tokens, whole = stream
    for length in range(1, len(whole) + 1):
        starts = np.arange(len(whole) - length + 1)[::-1]  # inside one shard and across one or more boundaries
        out = tokens.windows(starts, length)
        assert out.dtype == np.uint16 and out.tolist() == [whole[s:s + length] for s in starts], length
    narrow = ShardedTokens([np.arange(65_530, dtype=np.uint16) % 300, np.arange(100, dtype=np.uint16)])
    starts = np.array([65_528, 3], dtype=np.uint16)  # a start + length past 65535 must not wrap
    assert narrow.windows(starts, 8).tolist() == [[128, 129] + list(range(6)), list(range(3, 11))]  # 65528 = 218 * 300 + 128


def test_shards_convert_to_arrays_of_the_dtype_asked_for(stream):
    tokens, whole = stream
    assert np.asarray(tokens).dtype == np.uint16 and np.asarray(tokens).tolist() == whole
    for dtype in (np.int32, np.int64):
        assert tokens.__array__(dtype).dtype == dtype and tokens.__array__(dtype).tolist() == whole
        assert tokens.astype(dtype).dtype == dtype and tokens.astype(dtype).tolist() == whole
    assert tokens.tolist() == whole
    one = ShardedTokens([np.array([7, 8, 9], dtype=np.uint32)])  # a split of a single shard reads as that shard
    assert len(one) == 3 and one[:].dtype == np.uint32 and one[1:].tolist() == [8, 9] and int(one[-1]) == 9


# ---- the manifest --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("listed", [[], [{"file": "..", "tokens": 0}], [{"file": "", "tokens": 0}],
                                    [{"file": 5, "tokens": 0}], [{"tokens": 0}]])
def test_a_manifest_with_no_shards_or_no_plain_file_name_is_damaged(tmp_path, listed):
    with pytest.raises(GptlabError, match=r"meta.json is damaged \(its train shards\); run `gptlab prepare` again"):
        read_split(tmp_path, {"shards": {"train": listed}}, "train")


def test_a_manifest_whose_shards_are_not_a_table_reads_the_split_file(tmp_path):
    writer = TokenWriter(tmp_path / "train.bin", 300)
    writer.write([4, 5, 6])
    writer.close()
    (tmp_path / "meta.json").write_text(json.dumps({"shards": ["train.bin"]}))
    assert read_split(tmp_path, {"shards": ["train.bin"]}, "train").tolist() == [4, 5, 6]
    assert data_files(tmp_path) == ["train.bin", "val.bin"]


@pytest.mark.parametrize("meta, names", [
    ({}, ["train.bin", "val.bin"]),  # a folder from before shards
    ({"shards": {"val": [{"file": "v-0.bin"}], "train": [{"file": "t-0.bin"}, {"file": "t-1.bin"}]}},
     ["t-0.bin", "t-1.bin", "v-0.bin"]),
    ({"shards": {"train": [{"file": "../x.bin"}, {"file": ".."}, {"file": ""}, {"nofile": 1}, "t.bin",
                           {"file": "ok.bin"}]}}, ["ok.bin"]),
    ([1, 2], []),
])
def test_the_files_of_a_prepared_folder_are_the_plain_names_its_manifest_lists(tmp_path, meta, names):
    (tmp_path / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    assert data_files(tmp_path) == names


# ---- a split's shards written ------------------------------------------------------------------------------------

def test_ids_fill_whole_shards_and_an_empty_split_still_gets_one(tmp_path):
    ids = np.random.default_rng(1).integers(0, 300, 20)
    writer = ShardWriter(tmp_path, "train", 300, 10)
    for a, b in ((0, 3), (3, 3), (3, 20)):
        writer.write(ids[a:b])
    entries = writer.finish()  # exactly two full shards: no empty third one
    assert [(e["file"], e["tokens"]) for e in entries] == [("train-00000.bin", 10), ("train-00001.bin", 10)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train-00000.bin", "train-00001.bin"]
    for i, e in enumerate(entries):
        body = ids[10 * i:10 * i + 10].astype("<u2").tobytes()
        assert (tmp_path / e["file"]).read_bytes() == header(1, 2, 10) + body
        assert e["sha256"] == hashlib.sha256(body).hexdigest()
    empty = ShardWriter(tmp_path, "val", 300, 10).finish()
    assert empty == [{"file": "val-00000.bin", "tokens": 0, "sha256": hashlib.sha256(b"").hexdigest()}]
    assert (tmp_path / "val-00000.bin").read_bytes() == header(1, 2, 0)


def test_a_resume_takes_up_the_open_shard_even_once_it_completed_after_the_checkpoint(tmp_path):
    ids = np.random.default_rng(2).integers(0, 300, 25)
    writer = ShardWriter(tmp_path, "train", 300, 10)
    writer.write(ids[:3])
    writer.sync()
    saved = json.loads(json.dumps(writer.state()))  # the checkpoint: shard 0 open with 3 ids
    writer.write(ids[3:12])  # after it: shard 0 completes (renamed), shard 1 opens; then the process dies
    writer.abandon()
    assert (tmp_path / "train-00000.bin").exists() and not (tmp_path / "train-00000.bin.part").exists()
    again = ShardWriter(tmp_path, "train", 300, 10, saved["closed"], saved["open_tokens"])
    again.write(ids[3:])
    assert [e["tokens"] for e in again.finish()] == [10, 10, 5]
    assert [ids_on_disk(tmp_path / f"train-0000{i}.bin") for i in range(3)] == [ids[:10].tolist(),
                                                                                ids[10:20].tolist(), ids[20:].tolist()]


@pytest.mark.parametrize("first", [0, 10])
def test_a_checkpoint_with_no_shard_open_resumes_into_the_same_shards(tmp_path, first):
    """A checkpoint taken before a split's first id (0) or right as a shard completed (10): nothing is open, and
    the resumed writer starts the next shard from its first id."""
    ids = np.random.default_rng(3).integers(0, 300, 23)
    writer = ShardWriter(tmp_path, "train", 300, 10)
    writer.write(ids[:first])
    writer.sync()
    saved = json.loads(json.dumps(writer.state()))
    writer.abandon()
    again = ShardWriter(tmp_path, "train", 300, 10, saved["closed"], saved["open_tokens"])
    again.write(ids[first:])
    assert [e["tokens"] for e in again.finish()] == [10, 10, 3]
    assert [ids_on_disk(tmp_path / f"train-0000{i}.bin") for i in range(3)] == [ids[:10].tolist(),
                                                                                ids[10:20].tolist(), ids[20:].tolist()]


def test_a_resume_prefers_the_open_part_to_a_stale_complete_shard_of_its_name(tmp_path):
    part = TokenWriter(tmp_path / "train-00000.bin.part", 300)
    part.write([1, 2, 3, 4])
    part.file.close()
    stale = TokenWriter(tmp_path / "train-00000.bin", 300)
    stale.write([9] * 10)
    stale.close()
    writer = ShardWriter(tmp_path, "train", 300, 10, [], open_tokens=3)
    writer.write([7] * 7)
    assert ids_on_disk(tmp_path / "train-00000.bin") == [1, 2, 3] + [7] * 7


def test_abandoning_a_shard_on_a_full_disk_raises_nothing_of_its_own(tmp_path):
    writer = ShardWriter(tmp_path, "train", 300, 10)
    writer.write([1, 2])
    real = writer.writer.file

    class Full:
        def close(self):
            real.close()
            raise OSError(errno.ENOSPC, "No space left on device")
    writer.writer.file = Full()
    writer.abandon()
    assert real.closed


# ---- the staging folder --------------------------------------------------------------------------------------------

class Stop(KeyboardInterrupt):
    pass


def held_by_another(lock: Path) -> bool:
    with open(lock, "a+") as other:
        try:
            fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(other.fileno(), fcntl.LOCK_UN)
        return False


def test_starting_over_empties_the_staging_folder_but_keeps_its_lock(tmp_path):
    stage = tmp_path / "out" / STAGE
    (stage / "old").mkdir(parents=True)
    (stage / "old" / "x.bin").write_bytes(b"ids")
    (stage / "train-00000.bin.part").write_bytes(b"ids")
    (stage / "progress.json").write_text('{"fingerprint": "another prepare", "units_done": 3, "splits": []}')
    with Staging(tmp_path / "out", "this prepare") as s:
        assert s.progress is None and sorted(p.name for p in stage.iterdir()) == ["lock"]
        assert held_by_another(stage / "lock")
    assert list((tmp_path / "out").iterdir()) == []  # nothing to resume: the staging folder goes, OUT (not new) stays


@pytest.mark.parametrize("units, kept", [(None, False), (0, False), (1, True)])
def test_a_checkpoint_is_kept_only_when_it_records_units_done(tmp_path, units, kept):
    out = tmp_path / "out"
    with pytest.raises(Stop), Staging(out, "fp") as s:
        if units is None:
            (s.path / "progress.json").write_text('{"fingerprint": "fp", "splits": []}')
        else:
            s.checkpoint(units, [])
        raise Stop()
    assert out.exists() == kept and (out / STAGE / "progress.json").exists() == kept
    if kept:
        with Staging(out, "fp") as s:
            assert s.progress == {"fingerprint": "fp", "units_done": 1, "splits": []}
        assert not held_by_another(out / STAGE / "lock")


@pytest.mark.parametrize("complete, said", [(0, "0 complete shards and"), (1, "1 complete shard and"),
                                            (2, "2 complete shards and")])
@pytest.mark.parametrize("stop", [Stop, OSError], ids=["ctrl-c", "error"])
def test_a_kept_checkpoint_says_how_many_complete_shards_it_keeps(tmp_path, caplog, complete, said, stop):
    """In Ctrl-C's own message (the CLI prints it as its one line), or after any other failure in a warning."""
    with pytest.raises(stop) as stopped, Staging(tmp_path / "out", "fp") as s:
        writer = ShardWriter(s.path, "train", 300, 2)
        writer.write(np.arange(2 * complete + 1))
        s.checkpoint(4, [writer, ShardWriter(s.path, "val", 300, 2)])
        writer.abandon()
        raise stop()
    kept = f"keeps {said} the checkpoint; run the same command again to continue from there"
    assert kept in (str(stopped.value) if stop is Stop else caplog.text)
    assert kept not in (caplog.text if stop is Stop else str(stopped.value))


def test_an_output_folder_that_cannot_be_made_is_one_error_and_deep_new_ones_are_made(tmp_path):
    (tmp_path / "docs.txt").write_text("".join(DOCS[:40]), encoding="utf-8")
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(GptlabError, match=r"cannot create output folder .*a-file/out: Not a directory"):
        prepare([str(tmp_path / "docs.txt")], tmp_path / "a-file" / "out", "char", quiet=True, workers=1)
    meta = prepare([str(tmp_path / "docs.txt")], tmp_path / "a" / "b" / "out", "char", quiet=True, workers=1)
    out = tmp_path / "a" / "b" / "out"
    assert (out / "meta.json").read_text() == json.dumps(meta, indent=2)  # readable
    for split in ("train", "val"):  # a split of one file has its hash as folders from before shards have it
        assert meta[f"{split}_sha256"] == hashlib.sha256((out / f"{split}.bin").read_bytes()[32:]).hexdigest()
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]


# ---- prepare's checkpoints and commit ----------------------------------------------------------------------------

@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(encoder, "UNIT_CHARS", 2000)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(DOCS):
        (folder / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    return folder


def checkpoints_of(monkeypatch, stop_at: int | None = None) -> list[int]:
    """The units_done of each checkpoint prepare makes; with stop_at, Ctrl-C right after that many."""
    real, seen = Staging.checkpoint, []

    def checkpoint(self, units_done, writers):
        real(self, units_done, writers)
        seen.append(units_done)
        if len(seen) == stop_at:
            raise Stop()
    monkeypatch.setattr(Staging, "checkpoint", checkpoint)
    return seen


def test_without_a_completed_shard_a_checkpoint_falls_every_64_units(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(encoder, "UNIT_CHARS", 1)  # a unit per document (300) and per newline between two (299),
    seen = checkpoints_of(monkeypatch)  # and the last end-of-text: 600
    prepare([str(corpus)], tmp_path / "out", "char", quiet=True, workers=1)
    assert seen == [64, 128, 192, 256, 320, 384, 448, 512, 576]


def test_a_stopped_prepare_holds_no_file_of_its_folder_open(tmp_path, corpus, monkeypatch):
    checkpoints_of(monkeypatch, stop_at=2)
    out = tmp_path / "out"
    with pytest.raises(Stop) as stopped:  # its traceback keeps prepare's frames, and their writers, alive
        prepare([str(corpus)], out, "char", quiet=True, workers=1, shard_tokens=1000)
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    assert (out / STAGE / "progress.json").is_file() and not [f for f in fds if f.startswith(str(out))], fds
    assert not held_by_another(out / STAGE / "lock")
    del stopped


@pytest.mark.parametrize("tokenizer_kept", [True, False])
def test_a_resume_reuses_the_tokenizer_it_saved_and_trains_one_only_when_it_is_gone(tmp_path, corpus, monkeypatch,
                                                                                   tokenizer_kept):
    prepare([str(corpus)], tmp_path / "straight", "bpe", 300, quiet=True, workers=1, shard_tokens=1000)
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        checkpoints_of(m, stop_at=2)
        with pytest.raises(Stop):
            prepare([str(corpus)], out, "bpe", 300, quiet=True, workers=1, shard_tokens=1000)
    if not tokenizer_kept:
        (out / STAGE / "tokenizer.json").unlink()
    trained, real = [], prepare_module.train_tokenizer
    monkeypatch.setattr(prepare_module, "train_tokenizer", lambda *a: trained.append(1) or real(*a))
    prepare([str(corpus)], out, "bpe", 300, quiet=True, workers=1, shard_tokens=1000)
    assert len(trained) == (0 if tokenizer_kept else 1) and tree(out) == tree(tmp_path / "straight")


def fail_moving(monkeypatch, out: Path, name: str) -> None:
    """os.replace of `name` into `out` fails, as a full or failing disk would make it."""
    real = os.replace

    def replace(src, dst):
        if Path(dst) == out / name:
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)
    monkeypatch.setattr(os, "replace", replace)


def test_a_commit_that_fails_keeps_no_checkpoint_and_no_half_prepared_folder(tmp_path, corpus, monkeypatch):
    new, old = tmp_path / "new", tmp_path / "old"
    prepare([str(corpus)], old, "char", quiet=True, workers=1, shard_tokens=1000)
    with monkeypatch.context() as m:
        fail_moving(m, new, "tokenizer.json")
        fail_moving(m, old, "tokenizer.json")
        with pytest.raises(GptlabError, match="cannot write the token files in .*: Input/output error"):
            prepare([str(corpus)], new, "char", quiet=True, workers=1, shard_tokens=1000)
        assert not new.exists()  # a new folder is removed whole, checkpoints and all
        with pytest.raises(GptlabError, match="cannot write the token files"):
            prepare([str(corpus)], old, "char", quiet=True, workers=1, shard_tokens=3000, overwrite=True)
    assert not (old / "meta.json").exists() and not (old / STAGE).exists()  # never taken for prepared data
    with pytest.raises(GptlabError, match="not a prepared data folder"):
        load_dataset(old)


def test_overwriting_replaces_every_old_token_file_even_of_a_damaged_folder(tmp_path, corpus):
    out = tmp_path / "out"
    prepare([str(corpus)], out, "char", quiet=True, workers=1)
    meta = json.loads((out / "meta.json").read_text())
    del meta["shards"]  # as a folder from before shards has it
    (out / "meta.json").write_text(json.dumps(meta))
    prepare([str(corpus)], out, "char", quiet=True, workers=1, shard_tokens=5000, overwrite=True)
    assert "train.bin" not in {p.name for p in out.iterdir()} and (out / "train-00001.bin").is_file()
    (out / "train-00001.bin").unlink()  # damaged: a shard its manifest lists is gone
    prepare([str(corpus)], out, "char", quiet=True, workers=1, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
