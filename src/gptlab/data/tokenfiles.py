"""Token files: their format, and a split's shards read as one stream.

A token file is a 32-byte header (magic, version, bytes per token, token count) followed by the ids as uint16
when the vocabulary fits, else uint32. A split (train or val) is one or more token files, its shards, of at most
`shard_tokens` ids each, cut at counts alone: read in order they are one stream of ids, so a window may run from
one shard into the next and a sharded split trains exactly as the same split in one file would. meta.json lists
each split's shards (file, tokens, sha256); a split of one shard is `train.bin` / `val.bin`, as before shards.
Writing them, resumably, is staging.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from gptlab.errors import GptlabError

MAGIC = b"GPTLABTK"
VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")  # magic, version, bytes per token, token count, padding: 32 bytes
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class TokenWriter:
    """Appends ids to a token file: the header's count is filled in by `close`."""

    def __init__(self, path: Path, vocab_size: int, resume_at: int | None = None):
        """A new file at `path`, or with `resume_at` the existing one cut back to its first `resume_at` ids."""
        self.path = path
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self.count = 0
        self.sha = hashlib.sha256()
        if resume_at is None:
            self.file = open(path, "wb")
            self.file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, 0))
            return
        self.file = open(path, "r+b")
        end = HEADER.size + resume_at * self.dtype.itemsize
        if self.file.read(8) != MAGIC or os.path.getsize(path) < end:
            self.file.close()
            raise ValueError(f"{path} is shorter than its checkpoint")
        self.file.seek(HEADER.size)
        left = resume_at * self.dtype.itemsize
        while left:
            block = self.file.read(min(left, 1 << 24))
            self.sha.update(block)
            left -= len(block)
        self.file.truncate(end)
        self.file.seek(end)
        self.count = resume_at

    def write(self, ids: list[int] | np.ndarray) -> None:
        if len(ids) == 0:
            return
        array = np.asarray(ids, dtype=np.int64)
        if array.min() < 0 or array.max() >= self.vocab_size:  # a tokenizer bug, never the user's input
            raise ValueError(f"token id outside the vocabulary of {self.vocab_size}")
        body = array.astype(self.dtype).tobytes()
        self.sha.update(body)
        self.file.write(body)
        self.count += len(ids)

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.count))
        self.sync()
        self.file.close()


def read_tokens(path: str | Path) -> np.ndarray:
    """The ids in a token file, memory-mapped; raises GptlabError when the file is missing or damaged."""
    path = Path(path)
    if not path.is_file():
        raise GptlabError(f"token file {path} is missing; run `gptlab prepare` first")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size or head[:8] != MAGIC:
        raise GptlabError(f"{path} is not a gptlab token file; run `gptlab prepare` to make one")
    _, version, itemsize, count = HEADER.unpack(head)
    if version != VERSION or itemsize not in (2, 4):
        raise GptlabError(f"{path} has token-file version {version} / width {itemsize}, which this gptlab cannot read")
    if size != HEADER.size + itemsize * count:
        raise GptlabError(f"{path} is truncated or damaged: the header says {count} tokens but the file holds "
                          f"{(size - HEADER.size) // itemsize}; run `gptlab prepare` again")
    if count == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype=np.uint16 if itemsize == 2 else np.uint32, mode="r", offset=HEADER.size,
                     shape=(count,))


class ShardedTokens:
    """A split held in several token files, read as one stream of ids: memory-mapped, nothing loaded until a
    slice is asked for. Supports len(), slices, np.asarray and the windows a batch is cut from."""

    def __init__(self, shards: list[np.ndarray]):
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(s) for s in shards])  # where each shard starts in the stream
        self.dtype = shards[0].dtype

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: slice | int) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            index = int(index) + len(self) if index < 0 else int(index)
            shard = int(np.searchsorted(self.offsets, index, "right")) - 1
            if not 0 <= index < len(self):
                raise IndexError(f"token {index} is outside a split of {len(self)}")
            return self.shards[shard][index - self.offsets[shard]]
        picked = range(*index.indices(len(self)))
        if not picked:
            return np.zeros(0, dtype=self.dtype)
        at, stop = min(picked[0], picked[-1]), max(picked[0], picked[-1]) + 1  # the span it is taken from
        parts = []
        shard = int(np.searchsorted(self.offsets, at, "right")) - 1
        while at < stop:
            end = min(stop, int(self.offsets[shard + 1]))
            parts.append(self.shards[shard][at - self.offsets[shard]:end - self.offsets[shard]])
            at, shard = end, shard + 1
        joined = np.concatenate(parts)
        return joined if picked.step == 1 else joined[::picked.step]  # a negative step starts from its last

    def __array__(self, dtype: npt.DTypeLike = None, copy: bool | None = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)

    def tolist(self) -> list[int]:
        return self[:].tolist()

    def astype(self, dtype: npt.DTypeLike) -> np.ndarray:
        return self[:].astype(dtype)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length): the ids from each start on, across shard boundaries where a window crosses one.
        Windows inside one shard are gathered from it in one indexing, as from a single file; only the few that
        cross a boundary are sliced one by one."""
        starts = np.asarray(starts, dtype=np.int64)
        shard = np.searchsorted(self.offsets, starts, "right") - 1
        out = np.empty((len(starts), length), dtype=self.dtype)
        inside = starts + length <= self.offsets[shard + 1]
        for i in np.unique(shard[inside]):
            rows = np.flatnonzero(inside & (shard == i))
            out[rows] = self.shards[i][(starts[rows] - self.offsets[i])[:, None] + np.arange(length)]
        for row in np.flatnonzero(~inside):
            out[row] = self[int(starts[row]):int(starts[row]) + length]
        return out


def read_split(folder: Path, meta: dict[str, Any], split: str) -> np.ndarray | ShardedTokens:
    """A split of a prepared folder by its manifest (or `SPLIT.bin` in folders from before shards)."""
    listed = meta.get("shards", {}).get(split) if isinstance(meta.get("shards"), dict) else None
    if listed is None:
        return read_tokens(folder / f"{split}.bin")
    if not isinstance(listed, list) or not listed or not all(isinstance(e, dict) and _bare(e.get("file"))
                                                             for e in listed):
        raise GptlabError(f"{folder / 'meta.json'} is damaged (its {split} shards); run `gptlab prepare` again")
    arrays = [read_tokens(folder / e["file"]) for e in listed]
    for array, entry in zip(arrays, listed):
        if len(array) != entry.get("tokens"):
            raise GptlabError(f"{folder / entry['file']} holds {len(array)} tokens and meta.json says "
                              f"{entry.get('tokens')}; run `gptlab prepare` again")
    return arrays[0] if len(arrays) == 1 else ShardedTokens(arrays)


def data_files(folder: Path) -> list[str]:
    """The token files a prepared folder's meta.json names (none when it has no readable meta.json)."""
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(meta, dict):
        return []
    shards = meta.get("shards") if isinstance(meta.get("shards"), dict) else {}
    names = [e.get("file") for split in SPLITS for e in (shards.get(split) or []) if isinstance(e, dict)] \
        if shards else [f"{split}.bin" for split in SPLITS]
    return [n for n in names if _bare(n)]


def _bare(name: Any) -> bool:
    """Whether a manifest's file entry is a plain file name in the folder (no path, nothing to climb out by)."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name
