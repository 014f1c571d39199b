"""Sharded token files (tokenfiles.py): a split in several files trains exactly as one file, the manifest is
checked, and an interrupted prepare resumes from its last checkpoint to the same bytes as an uninterrupted one."""

import fcntl
import hashlib
import json
import signal
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import tree
from gptlab.cli import main
from gptlab.data import encoder
from gptlab.data.batches import batch_generator, get_batch, load_dataset
from gptlab.data.prepare import prepare
from gptlab.data.staging import STAGE, Staging
from gptlab.data.tokenfiles import ShardedTokens, TokenWriter, read_tokens
from gptlab.errors import GptlabError

DOCS = [f"Doc {i}: {'the quick brown fox ' * (3 + i % 7)}jumps {i} times — naïve café ☕ 日本.\n" for i in range(300)]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(DOCS):
        (folder / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    return folder


@pytest.fixture(autouse=True)
def small_units(monkeypatch):
    monkeypatch.setattr(encoder, "UNIT_CHARS", 2000)  # many units, so that checkpoints fall inside the corpus


def test_a_sharded_split_is_the_one_file_split_cut_in_pieces_and_trains_the_same(tmp_path, corpus):
    whole = prepare([str(corpus)], tmp_path / "whole", "bpe", 300, quiet=True, workers=1)
    cut = prepare([str(corpus)], tmp_path / "cut", "bpe", 300, quiet=True, workers=1, shard_tokens=997)
    assert len(whole["shards"]["train"]) == 1 and whole["shards"]["train"][0]["file"] == "train.bin"
    assert len(cut["shards"]["train"]) == -(-cut["train_tokens"] // 997) > 3
    for entry in cut["shards"]["train"] + cut["shards"]["val"]:  # every shard full but the last, its hash listed
        ids = read_tokens(tmp_path / "cut" / entry["file"])
        assert len(ids) == entry["tokens"] and entry["sha256"] == hashlib.sha256(ids.tobytes()).hexdigest()
    assert all(e["tokens"] == 997 for e in cut["shards"]["train"][:-1])
    one, many = load_dataset(tmp_path / "whole"), load_dataset(tmp_path / "cut")
    assert isinstance(many.train, ShardedTokens) and isinstance(one.train, np.ndarray)
    assert np.array_equal(np.asarray(many.train), one.train) and many.val.tolist() == one.val.tolist()
    assert many.train[990:1010].tolist() == one.train[990:1010].tolist() and many.train[-1] == one.train[-1]
    for step in range(20):  # windows across shard boundaries included: the same batches, draw for draw
        a = get_batch(one.train, 16, 64, batch_generator(0, step))
        b = get_batch(many.train, 16, 64, batch_generator(0, step))
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_one_and_two_workers_write_byte_identical_shards(tmp_path, corpus):
    prepare([str(corpus)], tmp_path / "w1", "bpe", 300, quiet=True, workers=1, shard_tokens=1500)
    prepare([str(corpus)], tmp_path / "w2", "bpe", 300, quiet=True, workers=2, shard_tokens=1500)
    assert tree(tmp_path / "w1") == tree(tmp_path / "w2") and len(tree(tmp_path / "w1")) > 6


class Stop(KeyboardInterrupt):
    pass


def interrupt_after(monkeypatch, checkpoints: int) -> None:
    """Ctrl-C right after the n-th checkpoint is on disk, in the middle of the next unit's writing."""
    real, calls = Staging.checkpoint, []

    def checkpoint(self, units_done, writers):
        real(self, units_done, writers)
        calls.append(units_done)
        if len(calls) == checkpoints:  # half-written work after the checkpoint, each open shard filled to one id
            for w in writers:  # short of complete (more than the rest of the split may hold): must be dropped
                w.write(np.arange(w.shard_tokens - 1 - (w.writer.count if w.writer else 0)) % 30)
            raise Stop()
    monkeypatch.setattr(Staging, "checkpoint", checkpoint)


@pytest.mark.parametrize("at", ["third", "last"])
def test_an_interrupted_prepare_resumes_from_its_checkpoint_to_the_same_bytes(tmp_path, corpus, monkeypatch, capsys,
                                                                              at):
    counted = []
    with monkeypatch.context() as m:
        real = Staging.checkpoint
        m.setattr(Staging, "checkpoint", lambda *a: counted.append(1) or real(*a))
        prepare([str(corpus)], tmp_path / "straight", "bpe", 300, quiet=True, workers=1, shard_tokens=1000)
    out = tmp_path / "resumed"
    with monkeypatch.context() as m:
        interrupt_after(m, 3 if at == "third" else len(counted))  # the last: stale ids outlast what is left
        with pytest.raises(Stop):
            prepare([str(corpus)], out, "bpe", 300, quiet=True, workers=1, shard_tokens=1000)
    assert not (out / "meta.json").exists() and sorted(p.name for p in out.iterdir()) == [STAGE]
    progress = json.loads((out / STAGE / "progress.json").read_text())
    for split in progress["splits"]:  # what looks complete is complete: its header, its count, its hash
        for entry in split["closed"]:
            ids = read_tokens(out / STAGE / entry["file"])
            assert len(ids) == entry["tokens"] == 1000 and entry["sha256"] == hashlib.sha256(ids.tobytes()).hexdigest()
    assert not [p for p in (out / STAGE).glob("*.bin") if p.name not in
                {e["file"] for s in progress["splits"] for e in s["closed"]}]  # the open shard is still .part
    encoded = []
    real = encoder.encode_unit
    monkeypatch.setattr(encoder, "encode_unit", lambda *a: encoded.append(1) or real(*a))
    meta = prepare([str(corpus)], out, "bpe", 300, quiet=False, workers=1, shard_tokens=1000)
    assert "resuming the prepare interrupted" in capsys.readouterr().err
    total = len(list(encoder.units(iter([(0, d, True) for d in DOCS]))))
    assert 0 < len(encoded) < total - progress["units_done"] + 2  # only what came after the checkpoint
    assert tree(out) == tree(tmp_path / "straight") and meta["train_tokens"] > 3000


@pytest.mark.parametrize("damage", ["an input changed", "the open shard lost"])
def test_a_resume_that_cannot_continue_starts_over(tmp_path, corpus, monkeypatch, damage):
    out, char = tmp_path / "out", {"quiet": True, "workers": 1, "shard_tokens": 1000}
    with monkeypatch.context() as m:
        interrupt_after(m, 2)
        with pytest.raises(Stop):
            prepare([str(corpus)], out, "char", **char)
    if damage == "an input changed":
        (corpus / "000.txt").write_text("a different first document\n")
    else:
        for part in (out / STAGE).glob("*.part"):
            part.write_bytes(b"")
    prepare([str(corpus)], out, "char", **char)
    prepare([str(corpus)], tmp_path / "fresh", "char", **char)
    assert tree(out) == tree(tmp_path / "fresh")


def test_a_second_prepare_into_the_same_folder_is_refused_while_one_writes(tmp_path, corpus):
    out = tmp_path / "out"
    (out / STAGE).mkdir(parents=True)
    (out / STAGE / "progress.json").write_text('{"fingerprint": "the other prepare"}')  # the writer's files
    (out / STAGE / "train-00000.bin").write_bytes(b"ids")
    with open(out / STAGE / "lock", "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        before = tree(out)
        with pytest.raises(GptlabError, match="another `gptlab prepare` is writing"):
            prepare([str(corpus)], out, "char", quiet=True, workers=1)
        assert tree(out) == before  # nothing of the other writer's touched


def test_preparing_again_with_fewer_shards_leaves_no_stale_shard(tmp_path, corpus):
    out = tmp_path / "out"
    prepare([str(corpus)], out, "char", quiet=True, workers=1, shard_tokens=800)
    assert len(list(out.glob("train-*.bin"))) > 5
    prepare([str(corpus)], out, "char", quiet=True, workers=1, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert len(load_dataset(out).train) == json.loads((out / "meta.json").read_text())["train_tokens"]


def test_folders_from_before_shards_still_load(char_data):
    meta = json.loads((char_data / "meta.json").read_text())
    meta.pop("shards", None)
    (char_data / "meta.json").write_text(json.dumps(meta))
    ds = load_dataset(char_data)
    assert len(ds.train) == meta["train_tokens"] and len(ds.val) == meta["val_tokens"]


@pytest.mark.parametrize("entry, message", [
    ({"file": "../train.bin", "tokens": 5}, r"meta.json is damaged \(its train shards\); run `gptlab prepare` again"),
    ("train.bin", r"meta.json is damaged \(its train shards\); run `gptlab prepare` again"),
    ({"file": "train-00009.bin", "tokens": 5}, r"token file .*train-00009.bin is missing; run `gptlab prepare`"),
])
def test_a_damaged_manifest_is_refused_in_one_line(tmp_path, corpus, entry, message):
    out = tmp_path / "out"
    prepare([str(corpus)], out, "char", quiet=True, workers=1)
    meta = json.loads((out / "meta.json").read_text())
    meta["shards"]["train"] = [entry]
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(GptlabError, match=message):
        load_dataset(out)


def test_a_shard_whose_count_differs_from_the_manifest_is_refused(tmp_path, corpus):
    """Two shards' counts swapped in the manifest: the split's total still matches, each shard does not."""
    out = tmp_path / "out"
    prepare([str(corpus)], out, "char", quiet=True, workers=1, shard_tokens=7000)
    meta = json.loads((out / "meta.json").read_text())
    first, last = meta["shards"]["train"][0], meta["shards"]["train"][-1]
    assert first["tokens"] == 7000 > last["tokens"] > 0
    first["tokens"], last["tokens"] = last["tokens"], first["tokens"]
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(GptlabError, match=rf"train-00000.bin holds 7000 tokens and meta.json says {first['tokens']}; "
                                          "run `gptlab prepare` again"):
        load_dataset(out)


def shards_by_hand(folder: Path, split: str) -> np.ndarray:
    """A split's ids read from its files with numpy alone (the 32-byte header skipped), in the manifest's order."""
    meta = json.loads((folder / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    return np.concatenate([np.fromfile(folder / e["file"], dtype=dtype, offset=32) for e in meta["shards"][split]])


def test_every_index_of_a_sharded_split_is_the_concatenation_of_its_files(tmp_path, corpus):
    prepare([str(corpus)], tmp_path / "out", "char", quiet=True, workers=1, shard_tokens=997)
    ds = load_dataset(tmp_path / "out")
    for split in (ds.train, ds.val):
        assert isinstance(split, ShardedTokens) and len(split.shards) > 1
    whole = shards_by_hand(tmp_path / "out", "train")
    assert len(ds.train) == len(whole) and len(set(whole.tolist())) > 20
    assert [int(ds.train[i]) for i in range(len(whole))] == whole.tolist()  # each shard's first and last included
    assert [int(ds.train[i]) for i in range(-len(whole), 0)] == whole.tolist()
    for edge in ds.train.offsets[1:-1]:  # slices that start, end or cross at a boundary
        for a, b in ((edge - 1, edge), (edge, edge + 1), (edge - 3, edge + 3), (edge, edge + 997)):
            assert ds.train[a:b].tolist() == whole[a:b].tolist()
    assert shards_by_hand(tmp_path / "out", "val").tolist() == np.asarray(ds.val).tolist()


@pytest.mark.parametrize("vocab_size", [300, 70_000])
def test_a_resumed_token_file_is_cut_back_to_its_checkpoint(tmp_path, vocab_size):
    """Ids written after the checkpoint (more of them than come after the resume) are gone from the file."""
    import struct

    ids = np.random.default_rng(0).integers(0, vocab_size, 400)
    path = tmp_path / "t.bin.part"
    writer = TokenWriter(path, vocab_size)
    writer.write(ids[:100])
    writer.sync()
    writer.write(ids[100:400])  # after the checkpoint: a killed process leaves these on disk
    writer.file.close()
    again = TokenWriter(path, vocab_size, resume_at=100)
    again.write(ids[200:220])
    again.close()
    width = 2 if vocab_size <= 65536 else 4
    raw = path.read_bytes()
    assert struct.unpack("<8sIIQ", raw[:24]) == (b"GPTLABTK", 1, width, 120) and len(raw) == 32 + 120 * width
    expected = np.concatenate([ids[:100], ids[200:220]]).astype(f"<u{width}").tobytes()
    assert raw[32:] == expected and again.sha.hexdigest() == hashlib.sha256(expected).hexdigest()


def test_every_checkpoint_follows_its_shards_on_disk(tmp_path, corpus, monkeypatch):
    """When progress.json is written, every shard it names holds, flushed and fsynced, the ids it says: the
    size each file had at its last fsync is its header and its count of ids."""
    import os

    from gptlab.data import staging

    synced: dict[str, int] = {}
    checkpoints = []
    real_fsync, real_write_atomic = os.fsync, staging.write_atomic

    def fsync(fd):
        real_fsync(fd)
        synced[Path(os.readlink(f"/proc/self/fd/{fd}")).name] = os.fstat(fd).st_size

    def write_atomic(path, data):
        state = json.loads(data)
        for split, name in zip(state["splits"], ("train", "val")):
            for entry in split["closed"]:
                assert synced.get(entry["file"] + ".part") == 32 + 2 * entry["tokens"], entry
            if split["open_tokens"]:
                part = f"{name}-{len(split['closed']):05d}.bin.part"
                assert synced.get(part) == 32 + 2 * split["open_tokens"], (part, split["open_tokens"])
        checkpoints.append(state)
        real_write_atomic(path, data)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(staging, "write_atomic", write_atomic)
    prepare([str(corpus)], tmp_path / "out", "char", quiet=True, workers=1, shard_tokens=3000)
    assert len(checkpoints) > 5 and any(s["open_tokens"] for c in checkpoints for s in c["splits"])


def test_the_cli_reports_the_shards_and_trains_on_them(tmp_path, corpus, capsys):
    data, run = tmp_path / "d", tmp_path / "r"
    assert main(["prepare", str(corpus), "--out", str(data), "--shard-tokens", "3000", "--quiet"]) == 0
    assert "train and 2 val shards of at most 3,000 tokens" in capsys.readouterr().out
    assert main(["train", "--data", str(data), "--run", str(run), "--preset", "char-quick", "--max-steps", "3",
                 "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--eval-interval", "3",
                 "--eval-batches", "2", "--quiet"]) == 0
    assert main(["eval", "--run", str(run), "--data", str(data)]) == 0
    assert main(["prepare", str(corpus), "--out", str(tmp_path / "x"), "--shard-tokens", "0"]) == 2
    assert "--shard-tokens must be at least 1" in capsys.readouterr().err


CHILD = """import os, signal, sys
from gptlab import rundir
from gptlab.cli import main
from gptlab.data import encoder
encoder.UNIT_CHARS = 2000  # as the small_units fixture has it, so that the rerun's units are the same
real = rundir.fsync_dir
def fsync_dir(path):  # SIGINT right after the first progress.json is renamed into place, before its folder's fsync
    if sys.argv[1] == "interrupt" and (path / "progress.json").exists():
        os.kill(os.getpid(), signal.SIGINT)
    real(path)
rundir.fsync_dir = fsync_dir
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["foreground", "background job"])
def test_sigint_to_a_real_prepare_keeps_its_checkpoint_and_the_rerun_finishes_it(tmp_path, corpus, inherited):
    """SIGINT to a `gptlab prepare` process at the worst moment of its first checkpoint (progress.json renamed into
    place, the checkpoint not yet returned), sent by the process itself, so that it lands there every time; with
    SIGINT's default inherited, and ignored as a shell starts background jobs (prepare must restore it, as train
    does)."""
    import subprocess
    import sys

    out = tmp_path / "out"
    argv = [sys.executable, "-c", CHILD, "interrupt", "prepare", str(corpus), "--out", str(out), "--workers", "1",
            "--shard-tokens", "1000", "--quiet"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, inherited))
    assert done.returncode == 130 and "run the same command again to continue" in done.stderr, done.stderr
    progress = json.loads((out / STAGE / "progress.json").read_text())
    assert not (out / "meta.json").exists() and progress["units_done"] > 0
    for entry in progress["splits"][0]["closed"]:  # a name without .part: complete, its header's count all there
        assert len(read_tokens(out / STAGE / entry["file"])) == entry["tokens"] == 1000
    argv[3] = "finish"
    done = subprocess.run(argv[:-1], capture_output=True, text=True, timeout=300)  # not --quiet: it says it resumes
    assert done.returncode == 0 and "resuming the prepare interrupted" in done.stderr, done.stderr
    prepare([str(corpus)], tmp_path / "straight", "char", quiet=True, workers=1, shard_tokens=1000)
    assert tree(out) == tree(tmp_path / "straight") and not (out / STAGE).exists()


# ---- Ctrl-C at each step of a checkpoint ---------------------------------------------------------------------

POINTS = ["shards synced", "progress fsynced", "progress renamed", "after the rename", "folder fsynced",
          "checkpoint returned"]
ON_DISK = POINTS[3:]  # from the rename on, progress.json names the checkpoint: it must be kept


def ctrl_c_inside_checkpoint(monkeypatch, n: int, point: str) -> list[int]:
    """KeyboardInterrupt at `point` of the n-th Staging.checkpoint: in the shards' sync, in the fsync of
    progress.json's temporary file, instead of its rename, right after the rename, in the folder's fsync, or after
    the checkpoint returned (each through the call a real Ctrl-C could land in). Returns the units_done of each
    checkpoint begun, as they come."""
    import os

    from gptlab import rundir
    from gptlab.data import staging

    calls: list[int] = []
    armed = lambda here: len(calls) == n and point == here  # noqa: E731
    real = {"checkpoint": Staging.checkpoint, "sync": staging.ShardWriter.sync, "fsync": os.fsync,
            "replace": os.replace, "fsync_dir": rundir.fsync_dir}

    def checkpoint(self, units_done, writers):
        calls.append(units_done)
        real["checkpoint"](self, units_done, writers)
        if armed("checkpoint returned"):
            raise Stop()

    def sync(self):
        if armed("shards synced"):
            raise Stop()
        real["sync"](self)

    def fsync(fd):
        if armed("progress fsynced") and ".progress.json.tmp" in os.readlink(f"/proc/self/fd/{fd}"):
            raise Stop()
        real["fsync"](fd)

    def replace(src, dst):
        if Path(dst).name == "progress.json" and armed("progress renamed"):
            raise Stop()
        real["replace"](src, dst)
        if Path(dst).name == "progress.json" and armed("after the rename"):
            raise Stop()

    def fsync_dir(path):
        if armed("folder fsynced"):
            raise Stop()
        real["fsync_dir"](path)
    for target, name, fn in ((Staging, "checkpoint", checkpoint), (staging.ShardWriter, "sync", sync),
                             (os, "fsync", fsync), (os, "replace", replace), (rundir, "fsync_dir", fsync_dir)):
        monkeypatch.setattr(target, name, fn)
    return calls


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, Path]:
    """(a corpus, its uninterrupted char prepare in small units and shards of 1000)"""
    root = tmp_path_factory.mktemp("straight")
    (root / "corpus").mkdir()
    for i, text in enumerate(DOCS):
        (root / "corpus" / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(encoder, "UNIT_CHARS", 2000)
        prepare([str(root / "corpus")], root / "out", "char", quiet=True, workers=1, shard_tokens=1000)
    return root / "corpus", root / "out"


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("point", POINTS)
def test_ctrl_c_at_each_step_of_a_checkpoint_keeps_what_is_on_disk_and_resumes(tmp_path, straight, monkeypatch,
                                                                                capsys, point, n):
    corpus, reference = straight
    out, char = tmp_path / "out", {"quiet": True, "workers": 1, "shard_tokens": 1000}
    with monkeypatch.context() as m:
        begun = ctrl_c_inside_checkpoint(m, n, point)
        with pytest.raises(Stop):
            prepare([str(corpus)], out, "char", **char)
    progress = out / STAGE / "progress.json"
    assert progress.is_file() == (n > 1 or point in ON_DISK), sorted(tree(tmp_path))
    assert out.exists() == progress.is_file()  # a new folder without a checkpoint is removed whole
    if progress.is_file():
        saved = json.loads(progress.read_text())
        assert saved["units_done"] == begun[n - 1 if point in ON_DISK else n - 2]  # the last one on disk
        for split, name in zip(saved["splits"], ("train", "val")):
            for entry in split["closed"]:  # the shards it names are whole, as the reference's are
                assert (out / STAGE / entry["file"]).read_bytes() == (reference / entry["file"]).read_bytes()
            part = out / STAGE / f"{name}-{len(split['closed']):05d}.bin"  # .part, or complete since
            size = max((p.stat().st_size for p in (part, part.with_suffix(".bin.part")) if p.exists()), default=0)
            assert split["open_tokens"] == 0 or size >= 32 + 2 * split["open_tokens"]
    capsys.readouterr()
    prepare([str(corpus)], out, "char", **{**char, "quiet": False})
    assert ("resuming the prepare interrupted" in capsys.readouterr().err) == (n > 1 or point in ON_DISK)
    assert tree(out) == tree(reference)


# ---- any cut into shards reads as the plain concatenation --------------------------------------------------------

@st.composite
def cut_split(draw):
    """(ids, the cuts between shards, the vocabulary size): ids of a uint16 or uint32 vocabulary, cut anywhere."""
    vocab = draw(st.sampled_from([300, 65_536, 70_000]))
    ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=300))
    cuts = draw(st.lists(st.integers(1, max(len(ids) - 1, 1)), max_size=8, unique=True)) if len(ids) > 1 else []
    return np.asarray(ids, dtype=np.int64), sorted(cuts), vocab


@settings(max_examples=40)
@given(cut_split(), st.data())
def test_any_cut_into_shards_reads_as_the_plain_concatenation(split, data):
    import tempfile

    ids, cuts, vocab = split
    with tempfile.TemporaryDirectory() as folder:
        arrays = []
        for i, part in enumerate(np.split(ids, cuts)):
            writer = TokenWriter(Path(folder) / f"{i}.bin", vocab)
            writer.write(part)
            writer.close()
            arrays.append(read_tokens(Path(folder) / f"{i}.bin"))
        tokens, whole = ShardedTokens(arrays), ids.tolist()
        assert len(tokens) == len(whole) and np.asarray(tokens).tolist() == whole == tokens.tolist()
        assert [int(tokens[i]) for i in range(-len(whole), len(whole))] == whole + whole
        for _ in range(5):
            a, b = data.draw(st.integers(-len(whole) - 2, len(whole) + 2)), data.draw(st.integers(-len(whole) - 2,
                                                                                                 len(whole) + 2))
            step = data.draw(st.sampled_from([None, 1, 2, 3, -1, -2]))
            assert tokens[a:b:step].tolist() == whole[a:b:step], (a, b, step)
        length = data.draw(st.integers(1, len(whole)))
        starts = np.asarray(data.draw(st.lists(st.integers(0, len(whole) - length), min_size=1, max_size=6)))
        assert tokens.windows(starts, length).tolist() == [whole[s:s + length] for s in starts]
        with pytest.raises(IndexError):
            tokens[len(whole)]
        del tokens, arrays  # the memory maps, before their folder goes
