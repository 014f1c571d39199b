"""The text a corpus is made of: sources (files, folders, standard input, the bundled Tiny Shakespeare; gzip,
zstd and bzip2 files decompressed on the fly) and the one rule by which every command reads text (a UTF-8
byte-order mark dropped, line ends made \\n), streamed in pieces so that corpora larger than memory work."""

from __future__ import annotations

import bz2
import codecs
import fnmatch
import gzip
import io
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO

from gptlab.errors import GptlabError

BUNDLED = "tinyshakespeare"
CHUNK_BYTES = 1 << 20
COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2"}
SKIPPED_FOLDERS = {"__pycache__"}  # besides hidden ones


class UnreadableSource(GptlabError):
    """A file that is not what its name says: binary, not in the encoding, damaged compression, not JSON lines
    with the text field, not Parquet. Files found inside a folder are skipped for this; files named are refused."""


@dataclass(frozen=True)
class Source:
    """An input: a display name, a way to open its (decompressed) bytes, its size on disk, its kind ("text",
    "jsonl" or "parquet"), its path for a file, whether it was found inside a folder rather than named, and whether
    it is packed (compressed or Parquet, so that its size on disk is not the size of its text)."""

    name: str
    open: Callable[[], IO[bytes]]
    size: int
    kind: str = "text"
    path: Path | None = None
    found: bool = False
    packed: bool = False


def bundled_source() -> Source:
    """Tiny Shakespeare, shipped gzipped inside the package."""
    asset = resources.files("gptlab").joinpath("assets/tinyshakespeare.txt.gz")
    return Source(f"{BUNDLED} (bundled)", lambda: gzip.open(asset.open("rb")), 1_115_394)


def spooled_source(name: str, stream: IO[bytes]) -> Source:
    """A stream that can be read only once (standard input, a pipe) copied to an anonymous temporary file, so
    that it can be read twice like any file."""
    spool = tempfile.TemporaryFile()
    shutil.copyfileobj(stream, spool)
    size = spool.tell()

    def reopen() -> IO[bytes]:
        spool.seek(0)
        return open(spool.fileno(), "rb", closefd=False)
    return Source(name, reopen, size)


def open_file(path: Path, compression: str | None) -> IO[bytes]:
    """The bytes of `path`, decompressed by `compression` ("gzip", "zstd", "bz2" or None)."""
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "bz2":
        return bz2.open(path, "rb")
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True, closefd=True)
    return open(path, "rb")


def file_source(path: Path, found: bool = False) -> Source:
    """A file as a source, its kind and compression told by its name: NAME.jsonl / NAME.json (JSON lines),
    NAME.parquet, anything else text; each but Parquet optionally followed by .gz, .zst or .bz2."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    compression = COMPRESSION.get(suffixes[-1]) if suffixes else None
    inner = (suffixes[-2] if len(suffixes) > 1 else "") if compression else (suffixes[-1] if suffixes else "")
    kind = "jsonl" if inner in (".jsonl", ".json") else "parquet" if inner == ".parquet" and not compression \
        else "text"
    return Source(str(path), lambda: open_file(path, compression), path.stat().st_size, kind, path, found,
                  packed=compression is not None or kind == "parquet")


def folder_files(folder: Path, pruned: list[str] | None = None) -> list[Path]:
    """The files inside `folder`, recursively, sorted by path; hidden files and folders and __pycache__ skipped
    (the folders skipped appended to `pruned` when given)."""
    found = []
    for root, dirs, names in os.walk(folder):
        if pruned is not None:
            pruned += sorted(str(Path(root) / d) for d in dirs if d.startswith(".") or d in SKIPPED_FOLDERS)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_FOLDERS]
        found += [Path(root) / n for n in names if not n.startswith(".") and (Path(root) / n).is_file()]
    return sorted(found)


def _wanted(path: Path, base: Path, include: list[str], exclude: list[str]) -> bool:
    """Whether a file passes the --include / --exclude globs, each matched against its path below the folder
    named and against its bare name."""
    rel = path.relative_to(base).as_posix() if base != path else path.name

    def hit(pattern: str) -> bool:
        return fnmatch.fnmatchcase(rel, pattern) or fnmatch.fnmatchcase(path.name, pattern)
    return (not include or any(map(hit, include))) and not any(map(hit, exclude))


def collect_sources(paths: list[str], include: list[str] | None = None, exclude: list[str] | None = None,
                    pruned: list[str] | None = None) -> list[Source]:
    """Files named, and the files inside folders named (see `folder_files`; the hidden and __pycache__ folders
    skipped are appended to `pruned` when given), kept when they pass the `include` and `exclude` globs; "-" is
    standard input, and pipes or devices such as /dev/stdin are read once and spooled."""
    if not paths:
        return [bundled_source()]
    include, exclude = include or [], exclude or []
    files: list[tuple[Path, bool]] = []
    spooled: list[Source] = []
    for raw in paths:
        path = Path(raw)
        if raw == "-" or (path.exists() and not path.is_dir() and not path.is_file()):
            with (open(sys.stdin.fileno(), "rb", closefd=False) if raw == "-" else open(path, "rb")) as stream:
                spooled.append(spooled_source("standard input" if raw == "-" else raw, stream))
        elif path.is_dir():
            files += [(p, True) for p in folder_files(path, pruned) if _wanted(p, path, include, exclude)]
        elif path.is_file():
            if _wanted(path, path, include, exclude):
                files.append((path, False))
        else:
            raise GptlabError(f"input {raw} does not exist; give text files or folders of text files")
    if not files and not spooled:
        globs = " that pass --include / --exclude" if include or exclude else ""
        raise GptlabError(f"no files{globs} found in {', '.join(paths)}; give text files or folders of text files")
    return spooled + [file_source(p, found) for p, found in files]


def text_decoder(encoding: str) -> io.IncrementalNewlineDecoder:
    """The one rule for reading text everywhere (prepare, eval, prompt files): a UTF-8 byte-order mark at the
    start is dropped, and Windows (\\r\\n) and old Mac (\\r) line ends become \\n."""
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        raise GptlabError(f"unknown text encoding {encoding!r}; try utf-8, latin-1 or cp1252") from None
    inner = codecs.getincrementaldecoder("utf-8-sig" if name == "utf-8" else name)(errors="strict")
    return io.IncrementalNewlineDecoder(inner, translate=True)


def read_text(path: str | Path, encoding: str = "utf-8") -> str:
    """The whole text of a file, read by the rule of `text_decoder`; GptlabError when it is missing, not text or
    not in `encoding`."""
    path = Path(path)
    if not path.is_file():
        raise GptlabError(f"{path} does not exist" if not path.exists() else f"{path} is not a file")
    return "".join(read_chunks(Source(str(path), lambda: open(path, "rb"), path.stat().st_size), encoding))


def read_chunks(source: Source, encoding: str = "utf-8",
                on_bytes: Callable[[bytes], None] | None = None) -> Iterator[str]:
    """The text of `source` in pieces of about 1 MiB that end at a line break where one exists.

    Raises GptlabError naming the file and byte offset when the bytes are not valid in `encoding`."""
    decoder = text_decoder(encoding)
    offset, carry = 0, ""
    with source.open() as f:
        while True:
            try:
                block = f.read(CHUNK_BYTES)
            except (OSError, EOFError, ValueError) + _zstd_errors() as exc:
                raise UnreadableSource(f"{source.name} could not be decompressed ({exc}); it is damaged or not "
                                       "the kind of file its name says") from None
            if on_bytes is not None and block:
                on_bytes(block)
            try:
                text = carry + decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                # exc.start counts from exc.object, the bytes the codec was given: they end with this block but may
                # begin in the block before (a character cut between blocks) or after a dropped byte-order mark
                bad = offset + len(block) - len(exc.object) + exc.start
                raise UnreadableSource(f"{source.name} is not valid {encoding}: bad byte at offset {bad}; "
                                       "pass --encoding with the file's real encoding (e.g. latin-1)") from None
            if "\x00" in text:
                raise UnreadableSource(f"{source.name} looks like a binary file (a NUL byte near offset "
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


def _zstd_errors() -> tuple[type[Exception], ...]:
    try:
        import zstandard
    except ImportError:
        return ()
    return (zstandard.ZstdError,)
