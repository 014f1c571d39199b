"""The text a corpus is made of: sources (files, folders, standard input, the bundled Tiny Shakespeare) and the
one rule by which every command reads text (a UTF-8 byte-order mark dropped, line ends made \\n), streamed in
pieces so that corpora larger than memory work."""

from __future__ import annotations

import codecs
import gzip
import io
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


def collect_sources(paths: list[str]) -> list[Source]:
    """Files named, and the files inside folders named (recursively, sorted, hidden ones skipped); "-" is standard
    input, and pipes or devices such as /dev/stdin are read once and spooled."""
    if not paths:
        return [bundled_source()]
    files: list[Path] = []
    spooled: list[Source] = []
    for raw in paths:
        path = Path(raw)
        if raw == "-" or (path.exists() and not path.is_dir() and not path.is_file()):
            with (open(sys.stdin.fileno(), "rb", closefd=False) if raw == "-" else open(path, "rb")) as stream:
                spooled.append(spooled_source("standard input" if raw == "-" else raw, stream))
        elif path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file()
                            and not any(part.startswith(".") for part in p.relative_to(path).parts))
        elif path.is_file():
            files.append(path)
        else:
            raise GptlabError(f"input {raw} does not exist; give text files or folders of text files")
    if not files and not spooled:
        raise GptlabError(f"no files found in {', '.join(paths)}; give text files or folders of text files")
    return spooled + [Source(str(p), lambda p=p: open(p, "rb"), p.stat().st_size) for p in files]


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
            block = f.read(CHUNK_BYTES)
            if on_bytes is not None and block:
                on_bytes(block)
            try:
                text = carry + decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:  # its offset counts from the bytes given to this call
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
