"""Writing token files resumably: a split's shards, and `prepare`'s staging folder with its checkpoints.

`prepare` writes into `OUT/.prepare-partial`. The shard being written is `NAME.part` and becomes `NAME` only once
complete (its header count filled in and flushed to disk), so no file looks complete that is not. Whenever a shard
completes (and every CHECKPOINT_UNITS units of text), progress.json records a checkpoint: how many units of the
input are in the shards, and each split's complete shards and the length of its open one. An interrupted prepare
keeps that folder; the same command again (same inputs, by content hash, and settings) truncates the open shards
to the checkpoint and goes on from there, with the same result as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import numpy as np

from gptlab.errors import GptlabError
from gptlab.rundir import write_atomic
from gptlab.data.tokenfiles import SPLITS, TokenWriter, data_files
from gptlab.tokenizer import Tokenizer, load as load_tokenizer

STAGE = ".prepare-partial"
CHECKPOINT_UNITS = 64  # units of ~1M characters between checkpoints when no shard completes

log = logging.getLogger(__name__)


class ShardWriter:
    """One split's shards in the staging folder: ids go to the open shard (NAME.part), which is closed and renamed
    to NAME when it holds shard_tokens ids; the next id opens a new one."""

    def __init__(self, folder: Path, split: str, vocab_size: int, shard_tokens: int,
                 closed: list[dict[str, Any]] | None = None, open_tokens: int = 0):
        self.folder, self.split, self.vocab_size, self.shard_tokens = folder, split, vocab_size, shard_tokens
        self.closed: list[dict[str, Any]] = list(closed or [])
        self.completed = False  # a shard completed since the last checkpoint
        self.writer: TokenWriter | None = None
        if open_tokens:
            if not self._part().exists() and (folder / self._name()).exists():  # completed after the checkpoint
                os.replace(folder / self._name(), self._part())
            self.writer = TokenWriter(self._part(), vocab_size, resume_at=open_tokens)

    def _name(self) -> str:
        return f"{self.split}-{len(self.closed):05d}.bin"

    def _part(self) -> Path:
        return self.folder / (self._name() + ".part")

    @property
    def tokens(self) -> int:
        return sum(e["tokens"] for e in self.closed) + (self.writer.count if self.writer else 0)

    def write(self, ids: np.ndarray) -> None:
        at = 0
        while at < len(ids):
            if self.writer is None:
                self.writer = TokenWriter(self._part(), self.vocab_size)
            take = min(len(ids) - at, self.shard_tokens - self.writer.count)
            self.writer.write(ids[at:at + take])
            at += take
            if self.writer.count == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        assert self.writer is not None
        self.writer.close()
        os.replace(self._part(), self.folder / self._name())
        self.closed.append({"file": self._name(), "tokens": self.writer.count, "sha256": self.writer.sha.hexdigest()})
        self.writer, self.completed = None, True

    def state(self) -> dict[str, Any]:
        """What a checkpoint records of this split (after `sync`)."""
        return {"closed": self.closed, "open_tokens": self.writer.count if self.writer else 0}

    def sync(self) -> None:
        if self.writer is not None:
            self.writer.sync()
        self.completed = False

    def finish(self) -> list[dict[str, Any]]:
        """Close the open shard (a split with no ids at all still gets one, empty) and return the manifest."""
        if self.writer is not None or not self.closed:  # a writer is only ever opened to write ids into it
            if self.writer is None:
                self.writer = TokenWriter(self._part(), self.vocab_size)
            self._close_shard()
        return self.closed

    def abandon(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(OSError):
                self.writer.file.close()


class Staging:
    """prepare's staging folder OUT/.prepare-partial, held under a lock while one prepare writes it. On entering,
    `progress` is the checkpoint to resume from when the folder holds one for the same `fingerprint` (None
    otherwise: the folder is emptied). `commit` moves the result into OUT; leaving without a commit keeps the
    folder when it holds a checkpoint (to resume from) and removes it otherwise, with OUT itself if it was new."""

    def __init__(self, out: Path, fingerprint: str):
        self.out, self.path, self.fingerprint = out, out / STAGE, fingerprint
        self.progress: dict[str, Any] | None = None
        self.created = not out.exists()
        self.committed = False
        self.lock: TextIO | None = None

    def __enter__(self) -> Staging:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self.path.mkdir(exist_ok=True)
            self._lock()
            self.progress = self._read_progress()
            if self.progress is None:
                self.reset()
        except OSError as exc:
            self._abandon()
            raise GptlabError(f"cannot create output folder {self.out}: {exc.strerror}") from None
        return self

    def _lock(self) -> None:
        self.lock = open(self.path / "lock", "a+")
        try:
            import fcntl

            fcntl.flock(self.lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no advisory locks on this platform: one prepare at a time is then the user's care
            pass
        except OSError:
            self.lock.close()
            self.lock = None
            raise GptlabError(f"another `gptlab prepare` is writing {self.out} right now; wait for it to finish, or "
                              "give --out another folder") from None

    def _read_progress(self) -> dict[str, Any] | None:
        try:
            progress = json.loads((self.path / "progress.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(progress, dict) or progress.get("fingerprint") != self.fingerprint:
            return None
        return progress

    def reset(self) -> None:
        """Forget the checkpoint (its files do not match it) and start over."""
        self.progress = None
        for item in self.path.iterdir():
            if item.name != "lock":
                shutil.rmtree(item) if item.is_dir() else item.unlink()

    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer the interrupted prepare built (so a resumed one need not train it again)."""
        if self.progress is None or not (self.path / "tokenizer.json").is_file():
            return None
        return load_tokenizer(self.path / "tokenizer.json")

    def checkpoint(self, units_done: int, writers: list[ShardWriter]) -> None:
        """Record that the first `units_done` units of the input are in the shards: flushed to disk first."""
        for w in writers:
            w.sync()
        state = {"fingerprint": self.fingerprint, "units_done": units_done, "splits": [w.state() for w in writers]}
        write_atomic(self.path / "progress.json", json.dumps(state).encode())  # fsynced, renamed, folder fsynced
        self.progress = state

    def commit(self, writers: list[ShardWriter], meta: dict[str, Any]) -> dict[str, Any]:
        """Close the shards and move them, tokenizer.json and meta.json (with the manifest, last) into OUT; old
        token files that the new manifest does not name are removed. Returns the metadata written."""
        (self.path / "progress.json").unlink(missing_ok=True)  # from here a crash starts over, never half-resumes
        self.progress = None  # ... and a failure below does not say "run it again to continue"
        shards: dict[str, list[dict[str, Any]]] = {}
        for w in writers:
            entries = w.finish()
            if len(entries) == 1:
                os.replace(self.path / entries[0]["file"], self.path / f"{w.split}.bin")
                entries[0]["file"] = f"{w.split}.bin"
            shards[w.split] = entries
        meta = {**meta, "shards": shards}
        for split in SPLITS:
            if len(shards[split]) == 1:  # the whole-split hash, as folders from before shards have it
                meta[f"{split}_sha256"] = shards[split][0]["sha256"]
        (self.path / "meta.json").write_text(json.dumps(meta, indent=2))
        new = [e["file"] for split in SPLITS for e in shards[split]]
        old = data_files(self.out)
        (self.out / "meta.json").unlink(missing_ok=True)  # a half-replaced folder is never taken for a prepared one
        for name in old:
            if name not in new:
                (self.out / name).unlink(missing_ok=True)
        for name in new + ["tokenizer.json", "meta.json"]:
            os.replace(self.path / name, self.out / name)
        self.committed = True
        return meta

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        # what is on disk decides, not self.progress: a Ctrl-C inside `checkpoint` can land after progress.json
        # was renamed into place and before this object heard of it
        progress = None if self.committed else self._read_progress()
        if progress is not None and progress.get("units_done", 0) > 0:
            shards = sum(len(s["closed"]) for s in progress["splits"])
            kept = f"{self.path} keeps {shards} complete shard{'s' * (shards != 1)} and the checkpoint; run the " \
                "same command again to continue from there"
            if isinstance(exc, KeyboardInterrupt) and not exc.args:  # said in Ctrl-C's own one line
                exc.args = (kept,)
            else:
                log.warning(f"prepare stopped: {kept}")
            self._unlock()
        else:
            self._abandon()

    def _unlock(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def _abandon(self) -> None:
        self._unlock()
        shutil.rmtree(self.path, ignore_errors=True)
        if self.created and not self.committed:
            shutil.rmtree(self.out, ignore_errors=True)
