"""Text files -> token files -> batches of (x, y) windows.

A token file is a 32-byte header (magic, version, bytes per token, token count) followed by the ids as uint16
when the vocabulary fits, else uint32. `prepare` streams its inputs, so corpora larger than memory work. Batches
are windows of block_size + 1 tokens cut at random offsets: x is the first block_size, y the same shifted by one,
so each window holds block_size next-token lessons. The offsets are a pure function of (seed, step, micro-step,
rank), which makes training reproducible and resumable without storing the sampler.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from gptlab.errors import GptlabError
from gptlab.tokenizer import Tokenizer, load as load_tokenizer, train_tokenizer

MAGIC = b"GPTLABTK"
VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")  # magic, version, bytes per token, token count, padding: 32 bytes
BUNDLED = "tinyshakespeare"
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Source:
    """A text input: a display name and a way to open its bytes."""

    name: str
    open: Callable[[], IO[bytes]]
    size: int


def bundled_source() -> Source:
    """Tiny Shakespeare, shipped gzipped inside the package."""
    asset = resources.files("gptlab").joinpath("assets/tinyshakespeare.txt.gz")
    return Source(f"{BUNDLED} (bundled)", lambda: gzip.open(asset.open("rb")), 1_115_394)


def collect_sources(paths: list[str]) -> list[Source]:
    """Files named, and the files inside folders named (recursively, sorted, hidden ones skipped)."""
    if not paths:
        return [bundled_source()]
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file()
                            and not any(part.startswith(".") for part in p.relative_to(path).parts))
        elif path.is_file():
            files.append(path)
        else:
            raise GptlabError(f"input {raw} does not exist; give text files or folders of text files")
    if not files:
        raise GptlabError(f"no files found in {', '.join(paths)}; give text files or folders of text files")
    return [Source(str(p), lambda p=p: open(p, "rb"), p.stat().st_size) for p in files]


def read_chunks(source: Source, encoding: str = "utf-8",
                on_bytes: Callable[[bytes], None] | None = None) -> Iterator[str]:
    """The text of `source` in pieces of about 1 MiB that end at a line break where one exists.

    Raises GptlabError naming the file and byte offset when the bytes are not valid in `encoding`."""
    try:
        decoder = codecs.getincrementaldecoder(encoding)(errors="strict")
    except LookupError:
        raise GptlabError(f"unknown text encoding {encoding!r}; try utf-8, latin-1 or cp1252") from None
    offset, carry = 0, ""
    with source.open() as f:
        while True:
            block = f.read(CHUNK_BYTES)
            if on_bytes is not None and block:
                on_bytes(block)
            try:
                text = carry + decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                raise GptlabError(f"{source.name} is not valid {encoding}: bad byte at offset {offset + exc.start}; "
                                  "pass --encoding with the file's real encoding (e.g. latin-1)") from None
            if "\x00" in text:
                raise GptlabError(f"{source.name} looks like a binary file (a NUL byte near offset "
                                  f"{offset + block.find(0) if 0 in block else offset}); give a text file")
            offset += len(block)
            if not block:
                if text:
                    yield text
                return
            cut = text.rfind("\n") + 1
            if cut == 0:
                cut = len(text)
            carry = text[cut:]
            if cut:
                yield text[:cut]


class TokenWriter:
    """Appends ids to a token file written atomically: a temp file, then rename once the header is final."""

    def __init__(self, path: Path, vocab_size: int):
        self.path = path
        self.dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
        self.vocab_size = vocab_size
        self.count = 0
        self.sha = hashlib.sha256()
        self.tmp = path.with_name(path.name + ".tmp")
        self.file = open(self.tmp, "wb")
        self.file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, 0))

    def write(self, ids: list[int]) -> None:
        if not ids:
            return
        array = np.asarray(ids, dtype=np.int64)
        assert array.min() >= 0 and array.max() < self.vocab_size, "token id outside the vocabulary"
        body = array.astype(self.dtype).tobytes()
        self.sha.update(body)
        self.file.write(body)
        self.count += len(ids)

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.count))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)


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


def _progress(total: int, desc: str, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=True if quiet else None, leave=False)


def _scan(sources: list[Source], encoding: str, quiet: bool) -> tuple[int, list[dict[str, Any]], set[str]]:
    """First pass: validate the encoding, count characters, hash the bytes and collect the characters."""
    total, described, chars = 0, [], set()
    with _progress(sum(s.size for s in sources), "scan", quiet) as bar:
        for source in sources:
            sha, n_chars = hashlib.sha256(), 0

            def seen(block: bytes, sha=sha) -> None:
                sha.update(block)
                bar.update(len(block))

            for chunk in read_chunks(source, encoding, seen):
                n_chars += len(chunk)
                chars.update(chunk)
            described.append({"path": source.name, "chars": n_chars, "sha256": sha.hexdigest()})
            total += n_chars
    return total, described, chars


def prepare(paths: list[str], out_dir: str | Path, tokenizer: str = "char", vocab_size: int = 1024,
            val_fraction: float = 0.1, encoding: str = "utf-8", quiet: bool = False) -> dict[str, Any]:
    """Tokenize text files (default: the bundled Tiny Shakespeare) into `out_dir`/{train,val}.bin, tokenizer.json
    and meta.json. The first (1 - val_fraction) of the characters, in file order, become the training split.
    Returns the metadata; raises GptlabError on bad input."""
    if not 0 <= val_fraction < 1:
        raise GptlabError(f"val_fraction must be in [0, 1), not {val_fraction}")
    sources = collect_sources(paths)
    total, described, chars = _scan(sources, encoding, quiet)
    if total == 0:
        raise GptlabError(f"the corpus ({', '.join(s.name for s in sources)}) is empty; give a file with text in it")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GptlabError(f"cannot create output folder {out}: {exc.strerror}") from None

    def all_chunks() -> Iterator[str]:
        for source in sources:
            yield from read_chunks(source, encoding)

    tok: Tokenizer = train_tokenizer(tokenizer, [chars] if tokenizer == "char" else all_chunks(), vocab_size)
    split_at = int(total * (1 - val_fraction))
    written = _encode_split(sources, tok, out, split_at, encoding, quiet)
    tok.save(out / "tokenizer.json")
    meta = {"format_version": VERSION, "tokenizer": tok.kind, "vocab_size": tok.vocab_size,
            "dtype": "uint16" if tok.vocab_size <= 1 << 16 else "uint32", **written,
            "train_chars": split_at, "val_chars": total - split_at,
            "val_fraction": val_fraction, "encoding": encoding, "sources": described}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def _encode_split(sources: list[Source], tok: Tokenizer, out: Path, split_at: int, encoding: str,
                  quiet: bool) -> dict[str, Any]:
    """Second pass: encode everything, sending characters before `split_at` to train.bin and the rest to val.bin.
    Documents are joined with the end-of-text token where the tokenizer has one."""
    writers = [TokenWriter(out / "train.bin", tok.vocab_size), TokenWriter(out / "val.bin", tok.vocab_size)]
    position = 0
    with _progress(sum(s.size for s in sources), "encode", quiet) as bar:
        for n, source in enumerate(sources):
            if n and tok.eot_id is not None:
                writers[position >= split_at].write([tok.eot_id])
            for chunk in read_chunks(source, encoding, lambda block: bar.update(len(block))):
                end = position + len(chunk)
                if position < split_at < end:
                    writers[0].write(tok.encode(chunk[:split_at - position]))
                    writers[1].write(tok.encode(chunk[split_at - position:]))
                else:
                    writers[position >= split_at].write(tok.encode(chunk))
                position = end
    for w in writers:
        w.close()
    return {"train_tokens": writers[0].count, "val_tokens": writers[1].count,
            "train_sha256": writers[0].sha.hexdigest(), "val_sha256": writers[1].sha.hexdigest()}


@dataclass
class Dataset:
    """A prepared data folder: the two splits, the tokenizer and the metadata."""

    path: Path
    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    meta: dict[str, Any]

    def fingerprint(self) -> str:
        """sha256 of the metadata, which holds the sha256 of both token files: changes whenever the data does."""
        return hashlib.sha256(json.dumps(self.meta, sort_keys=True).encode()).hexdigest()


def load_dataset(data_dir: str | Path) -> Dataset:
    """The prepared data in `data_dir`; raises GptlabError when it is missing or damaged."""
    path = Path(data_dir)
    if not (path / "meta.json").is_file():
        raise GptlabError(f"{path} is not a prepared data folder (no meta.json); run `gptlab prepare --out {path}`")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GptlabError(f"{path / 'meta.json'} is damaged; run `gptlab prepare` again") from None
    return Dataset(path, read_tokens(path / "train.bin"), read_tokens(path / "val.bin"),
                   load_tokenizer(path / "tokenizer.json"), meta)


def batch_generator(seed: int, step: int, micro: int = 0, rank: int = 0) -> torch.Generator:
    """A generator seeded from (seed, step, micro-step, rank) alone: any batch can be redrawn at any time."""
    mixed = int.from_bytes(hashlib.blake2b(f"{seed}/{step}/{micro}/{rank}".encode(), digest_size=8).digest(), "little")
    return torch.Generator().manual_seed(mixed & 0x7FFF_FFFF_FFFF_FFFF)


def get_batch(tokens: np.ndarray, batch_size: int, block_size: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` random windows: x (B, T) and y (B, T) = x shifted left by one, as int64."""
    if len(tokens) < block_size + 1:
        raise GptlabError(f"the split has {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}; "
                          "use a longer corpus or a smaller --block-size")
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator).numpy()
    windows = torch.from_numpy(tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int64))  # (B, T+1)
    return windows[:, :-1], windows[:, 1:]
