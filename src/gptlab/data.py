"""Text files -> token files -> batches of (x, y) windows.

A token file is a 32-byte header (magic, version, bytes per token, token count) followed by the ids as uint16
when the vocabulary fits, else uint32. `prepare` streams its inputs, so corpora larger than memory work. Batches
are windows of block_size + 1 tokens cut at random offsets: x is the first block_size, y the same shifted by one,
so each window holds block_size next-token lessons. The offsets are a pure function of (seed, step, micro-step,
rank), which makes training reproducible and resumable without storing the sampler.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab.corpus import Source, collect_sources
from gptlab.encoder import Piece, encode_units, units
from gptlab.machine import usable_cores
from gptlab.errors import GptlabError
from gptlab.readers import Scan, documents, scan_sources, val_documents
from gptlab.tokenizer import Tokenizer, load as load_tokenizer, train_tokenizer

MAGIC = b"GPTLABTK"
VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")  # magic, version, bytes per token, token count, padding: 32 bytes


def folder_kind(path: str | Path) -> str | None:
    """What a folder holds, for refusing to write one kind of thing over another: "run" (a gptlab run: its
    config.json has model and train settings), "data" (a prepared data folder), "hf" (another config.json, e.g.
    a Hugging Face model), or None."""
    path = Path(path)
    if (path / "meta.json").is_file() and (path / "train.bin").is_file():
        return "data"
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return "hf"
        return "run" if isinstance(config, dict) and {"model", "train"} <= set(config) else "hf"
    return None


class TokenWriter:
    """Appends ids to a token file: the header's count is filled in by `close`."""

    def __init__(self, path: Path, vocab_size: int):
        self.path = path
        self.dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
        self.vocab_size = vocab_size
        self.count = 0
        self.sha = hashlib.sha256()
        self.file = open(path, "wb")
        self.file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, 0))

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

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.count))
        self.file.flush()
        os.fsync(self.file.fileno())
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


def _progress(sources: list[Source], desc: str, quiet: bool) -> Any:
    """A bar over the bytes read; with compressed or Parquet inputs their total is unknown, so it shows the rate."""
    from tqdm import tqdm

    total = None if any(s.packed for s in sources) else sum(s.size for s in sources)
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=True if quiet else None, leave=False)


def tokenizer_of(folder: str | Path) -> Tokenizer:
    """The tokenizer of a run or a prepared data folder (or a tokenizer.json file), for `--tokenizer-from`."""
    path = Path(folder)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not path.exists() or (path.is_dir() and folder_kind(path) not in ("run", "data")):
        raise GptlabError(f"--tokenizer-from {folder} is not a gptlab run or prepared data folder; point it at "
                          "one (it must hold tokenizer.json)")
    return load_tokenizer(file)


def _interruptible(fn: Callable[[], Any]) -> Any:
    """fn() in a worker thread, so that Ctrl-C stops the caller at once even while fn runs native code that
    never returns to Python (training a BPE tokenizer does); the abandoned worker dies with the process."""
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            result["error"] = exc
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if "error" in result:
        raise result["error"]
    return result["value"]


def _check_covers(tok: Tokenizer, chars: set[str], source: str) -> None:
    """A char tokenizer given by --tokenizer-from must know every character of the new text."""
    if tok.kind == "char":
        unseen = sorted(chars - set(tok.to_dict()["chars"]))
        if unseen:
            shown = ", ".join(repr(c) for c in unseen[:5]) + (f" and {len(unseen) - 5} more" if len(unseen) > 5 else "")
            raise GptlabError(f"the text has characters the tokenizer of {source} has never seen: {shown}; prepare "
                              "without --tokenizer-from to build a new vocabulary")


def prepare(paths: list[str], out_dir: str | Path, tokenizer: str = "char", vocab_size: int = 1024,
            val_fraction: float = 0.1, encoding: str = "utf-8", quiet: bool = False, allow_special: bool = False,
            tokenizer_from: str | Path | None = None, text_field: str = "text", include: list[str] | None = None,
            exclude: list[str] | None = None, strict: bool = False, val_paths: list[str] | None = None,
            seed: int = 0, workers: int | None = None) -> dict[str, Any]:
    """Tokenize files and folders (default: the bundled Tiny Shakespeare; see corpus.collect_sources and
    readers.documents for what is read) into `out_dir`/{train,val}.bin, tokenizer.json and meta.json, with a new
    tokenizer of kind `tokenizer` or the one of `tokenizer_from` (a run or data folder). Every document ends with
    the end-of-text token where the tokenizer has one. The validation split is the documents of `val_paths` when
    given, else whole documents chosen by `seed` (see readers.val_documents), else (fewer than 1 / val_fraction
    documents) the last val_fraction of the characters. Files found in folders that cannot be read are skipped and
    listed in the metadata (refused with `strict`). `workers` processes encode (default: the cores available),
    with the same output as one. Everything is checked before anything is written; the files are written in
    a hidden folder and moved into place at the end (meta.json last), so a failure or Ctrl-C leaves the folder as
    it was. Returns the metadata; raises GptlabError on bad input or a full disk."""
    workers = usable_cores() if workers is None else workers
    if workers < 1:
        raise GptlabError(f"--workers must be at least 1, not {workers}")
    if not val_paths and not 0 < val_fraction < 1:
        raise GptlabError(f"val_fraction must be in (0, 1): training needs a validation split, not {val_fraction}")
    out = Path(out_dir)
    if folder_kind(out) in ("run", "hf"):
        raise GptlabError(f"{out} holds a {'gptlab run' if folder_kind(out) == 'run' else 'model (config.json)'}; "
                          "preparing data there would overwrite its files, so give --out a folder of its own")
    fixed = tokenizer_of(tokenizer_from) if tokenizer_from else None
    has_special = fixed.eot_id is not None if fixed else tokenizer != "char"
    pruned: list[str] = []
    groups = [collect_sources(paths, include, exclude, pruned)]
    if val_paths:
        groups.append(collect_sources(val_paths, include, exclude, pruned))
    scans = []
    for sources, what in zip(groups, ("corpus", "validation corpus")):
        with _progress(sources, "scan", quiet) as bar:
            scans.append(scan_sources(sources, encoding, text_field, strict, bar.update,
                                      has_special and not allow_special, (fixed.kind if fixed else tokenizer) == "char"))
        _check_not_empty(scans[-1], sources, what)
    scan = scans[0].joined(scans[1]) if val_paths else scans[0]
    if fixed:
        _check_covers(fixed, scan.chars, str(tokenizer_from))

    def all_chunks() -> Iterator[str]:
        for source in scan.sources:
            for doc in documents(source, encoding, text_field):
                yield from doc

    tok: Tokenizer = fixed or _interruptible(lambda: train_tokenizer(
        tokenizer, [scan.chars] if tokenizer == "char" else all_chunks(), vocab_size))
    held = val_documents(scan, val_fraction, seed)
    split = {"split": "characters" if held is None else "validation files" if val_paths else "documents",
             "val_fraction": None if val_paths else val_fraction, "seed": seed,
             "val_documents": None if held is None else int(held.sum()),
             "skipped_folders": len(pruned), "skipped_files": len(scan.skipped), "skipped": scan.skipped[:20]}
    encode = {"held": held, "encoding": encoding, "text_field": text_field, "quiet": quiet,
              "allow_special": allow_special, "workers": workers}
    return _write_prepared(out, scan, tok, val_fraction, split, encode)


def _check_not_empty(scan: Scan, sources: list[Source], what: str) -> None:
    if scan.total == 0:
        n = len(scan.skipped)
        skipped = f"; {n} unreadable file{'s were' if n > 1 else ' was'} skipped, e.g. {scan.skipped[0]['reason']}" \
            if n else ""
        shown = ", ".join(s.name for s in sources[:5]) + (" ..." if len(sources) > 5 else "")
        raise GptlabError(f"the {what} ({shown}) is empty; give a file with text in it{skipped}")


def _write_prepared(out: Path, scan: Scan, tok: Tokenizer, val_fraction: float, split: dict[str, Any],
                    encode: dict[str, Any]) -> dict[str, Any]:
    """Second pass: encode into a hidden staging folder inside `out`, then move the files into place."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GptlabError(f"cannot create output folder {out}: {exc.strerror}") from None
    stage = out / f".prepare-{os.getpid()}"
    committed = False
    try:
        stage.mkdir()
        split_at = int(scan.total * (1 - val_fraction))
        written = _encode_split(scan.sources, tok, stage, split_at, **encode)
        tok.save(stage / "tokenizer.json")
        meta = {"format_version": VERSION, "tokenizer": tok.kind, "vocab_size": tok.vocab_size,
                "dtype": "uint16" if tok.vocab_size <= 1 << 16 else "uint32", **written, **split,
                "encoding": encode["encoding"], "text_field": encode["text_field"],
                "documents": sum(d["documents"] for d in scan.described), "sources": scan.described}
        (stage / "meta.json").write_text(json.dumps(meta, indent=2))
        (out / "meta.json").unlink(missing_ok=True)  # a half-replaced folder is never taken for a prepared one
        for name in ("train.bin", "val.bin", "tokenizer.json", "meta.json"):
            os.replace(stage / name, out / name)
        committed = True
        return meta
    except OSError as exc:
        raise GptlabError(f"cannot write the token files in {out}: {exc.strerror}; free some space or fix the "
                          "permissions (nothing was changed)") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if created and not committed:
            shutil.rmtree(out, ignore_errors=True)


def _pieces(sources: list[Source], split_at: int, held: np.ndarray | None, encoding: str, text_field: str,
            bar: Any, chars: list[int]) -> Iterator[Piece]:
    """Every document's text in pieces, each marked with its side: the documents marked in `held` go to val and
    the rest to train, or without it, characters before `split_at` go to train and the rest to val. Every document
    ends with the end-of-text token (on the side its last character is). Counts the characters of each side."""
    position, index = 0, 0
    for source in sources:
        for doc in documents(source, encoding, text_field, lambda block: bar.update(len(block))):
            pieces = iter(doc)
            first = next(pieces, None)
            if first is None:  # an empty file: no document
                continue
            side = None if held is None else int(held[index])
            index += 1
            for chunk in itertools.chain([first], pieces):
                cut = min(max(split_at - position, 0), len(chunk)) if side is None else len(chunk) * (1 - side)
                for s, piece in ((0, chunk[:cut]), (1, chunk[cut:])):
                    if piece:
                        chars[s] += len(piece)
                        yield s, piece, False
                position += len(chunk)
            yield int(position > split_at) if side is None else side, "", True


def _encode_split(sources: list[Source], tok: Tokenizer, out: Path, split_at: int, held: np.ndarray | None,
                  encoding: str, text_field: str, quiet: bool, allow_special: bool, workers: int) -> dict[str, Any]:
    """Encode everything into train.bin and val.bin (see `_pieces`) in `workers` processes."""
    writers = [TokenWriter(out / "train.bin", tok.vocab_size), TokenWriter(out / "val.bin", tok.vocab_size)]
    chars = [0, 0]
    try:
        with _progress(sources, "encode", quiet) as bar:
            stream = units(_pieces(sources, split_at, held, encoding, text_field, bar, chars))
            for ids in encode_units(tok, stream, workers, allow_special):
                for writer, part in zip(writers, ids):
                    writer.write(part)
                tokens = writers[0].count + writers[1].count
                bar.set_postfix_str(f"{tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f} tokens/s", refresh=False)
    except BaseException:
        for w in writers:
            with contextlib.suppress(OSError):
                w.file.close()
        raise
    for w in writers:
        w.close()
    return {"train_tokens": writers[0].count, "val_tokens": writers[1].count, "train_chars": chars[0],
            "val_chars": chars[1], "train_sha256": writers[0].sha.hexdigest(), "val_sha256": writers[1].sha.hexdigest()}


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
    if not isinstance(meta, dict):
        raise GptlabError(f"{path / 'meta.json'} is damaged; run `gptlab prepare` again")
    train, val = read_tokens(path / "train.bin"), read_tokens(path / "val.bin")
    if (meta.get("train_tokens"), meta.get("val_tokens")) != (len(train), len(val)):
        raise GptlabError(f"the token files in {path} do not match its meta.json ({len(train)} / {len(val)} tokens, "
                          f"meta.json says {meta.get('train_tokens')} / {meta.get('val_tokens')}); run `gptlab "
                          "prepare` again")
    return Dataset(path, train, val, load_tokenizer(path / "tokenizer.json"), meta)


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
