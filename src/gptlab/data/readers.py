"""Documents out of sources. A text file is one document, read by the corpus's one rule; each line of a JSON-lines
file (.jsonl / .json, optionally compressed) and each row of a Parquet file is one document, its text in the field
`text_field` (FineWeb, OpenWebText and The Stack all call it "text"). Everything streams: a document is an
iterator of text pieces, and a Parquet file is read one record batch at a time."""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.data.corpus import Source, UnreadableSource, read_chunks
from gptlab.errors import GptlabError
from gptlab.tokenizer import EOT

PARQUET_BATCH_ROWS = 1024
JOINER = "\n"  # between documents, for a tokenizer without an end-of-text token (see joiner)

log = logging.getLogger(__name__)


def documents(source: Source, encoding: str = "utf-8", text_field: str = "text",
              on_bytes: Callable[[bytes], None] | None = None,
              on_bad: Callable[[int, str], None] | None = None) -> Iterator[Iterable[str]]:
    """The documents of `source`, each an iterable of text pieces to be read to its end before the next one;
    `on_bytes` sees the bytes read (for Parquet, each text's UTF-8). Empty records are left out, and so are bad
    JSON lines (not JSON, not an object, no string in `text_field`), each told to `on_bad(line number, reason)`.

    Raises UnreadableSource when the file is not the kind its name says (see corpus.UnreadableSource)."""
    if source.kind == "text":
        yield read_chunks(source, encoding, on_bytes)
    elif source.kind == "jsonl":
        yield from _json_lines(source, encoding, text_field, on_bytes, on_bad)
    else:
        yield from _parquet(source, text_field, on_bytes)


def _json_lines(source: Source, encoding: str, text_field: str, on_bytes: Callable[[bytes], None] | None,
                on_bad: Callable[[int, str], None] | None) -> Iterator[Iterable[str]]:
    carry, number = "", 0
    for chunk in read_chunks(source, encoding, on_bytes):
        lines = (carry + chunk).split("\n")
        carry = lines.pop()  # a line longer than a chunk continues in the next one
        for line in lines:
            number += 1
            text = _record_text(source.name, number, line, text_field, on_bad)
            if text:
                yield (text,)
    text = _record_text(source.name, number + 1, carry, text_field, on_bad)
    if text:
        yield (text,)


def _record_text(name: str, number: int, line: str, text_field: str,
                 on_bad: Callable[[int, str], None] | None) -> str:
    """The text field of one JSON line; "" for a blank line and for a bad record, whose reason goes to on_bad."""
    if not line.strip():
        return ""
    try:
        record = json.loads(line)
    except ValueError:
        reason = f"{name} line {number} is not JSON"
    else:
        text = record.get(text_field) if isinstance(record, dict) else None
        if isinstance(text, str):
            return text
        if isinstance(record, dict) and text_field in record:
            reason = f"{name} line {number} has text field {text_field!r} {json.dumps(text)[:40]}, not a string"
        else:
            fields = ", ".join(list(record)[:8]) if isinstance(record, dict) else "none: not an object"
            reason = f"{name} line {number} has no text field {text_field!r} (its fields: {fields})"
    if on_bad is not None:
        on_bad(number, reason)
    return ""


def _parquet(source: Source, text_field: str, on_bytes: Callable[[bytes], None] | None) -> Iterator[Iterable[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(source.path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise UnreadableSource(f"{source.name} is not a readable Parquet file ({exc})") from None
    with table:
        schema = table.schema_arrow
        if text_field not in schema.names or not (pa.types.is_string(schema.field(text_field).type)
                                                  or pa.types.is_large_string(schema.field(text_field).type)):
            raise UnreadableSource(f"{source.name} has no text column {text_field!r} (its columns: "
                                   f"{', '.join(schema.names[:8])}); pass --text-field with the one that holds "
                                   "the text")
        batches = table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field])
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise UnreadableSource(f"{source.name} is damaged ({exc})") from None
            if batch is None:
                return
            for text in batch.column(0).to_pylist():
                if text:
                    if on_bytes is not None:
                        on_bytes(text.encode("utf-8"))
                    yield (text,)


@dataclass
class Scan:
    """What the first pass found: the readable sources, their characters and descriptions, the skipped files, and
    where the sources named as the validation corpus begin (None when there are none)."""

    sources: list[Source]
    total: int
    described: list[dict[str, Any]]
    chars: set[str]
    skipped: list[dict[str, str]]
    val_from: int | None = None
    bad_records: list[dict[str, Any]] = field(default_factory=list)  # {"path", "line", "reason"}, reading order
    lengths: array = field(default_factory=lambda: array("q"))  # each document's characters, reading order
    joiner: str = ""  # what goes between two documents (see `joiner`), once the tokenizer is known

    @property
    def documents(self) -> int:
        return len(self.lengths)

    def joined(self, val: Scan) -> Scan:
        """This scan followed by the scan of the validation corpus."""
        return Scan(self.sources + val.sources, self.total + val.total, self.described + val.described,
                    self.chars | val.chars, self.skipped + val.skipped, len(self.sources),
                    self.bad_records + val.bad_records, self.lengths + val.lengths)


def joiner(scan: Scan, end_of_text: bool) -> str:
    """What goes between two documents besides the end-of-text token: a newline for a tokenizer without one (the
    char tokenizer), so that one text does not run into the next; nothing for one document alone."""
    return "" if end_of_text or scan.documents < 2 else JOINER


def val_documents(scan: Scan, val_fraction: float, seed: int) -> np.ndarray | None:
    """Which documents, in reading order, form the validation split: those of the validation corpus when one was
    named; else whole documents in an order drawn by `seed`, each taken while it fits in what is left of
    int(val_fraction x the characters), so that the split holds about val_fraction of the text however unequal the
    documents are. None when whole documents cannot come within half of that (one book, a few long texts), and the
    corpus is then split by characters (the last val_fraction of them)."""
    held = _validation_corpus(scan)
    if held is not None:
        return held
    held = np.zeros(scan.documents, dtype=bool)
    gap = target = int(scan.total * val_fraction)
    for i in np.random.default_rng(seed).permutation(len(held)).tolist():
        if scan.lengths[i] <= gap:
            held[i] = True
            gap -= scan.lengths[i]
            if gap == 0:
                break
    return held if 0 < target <= 2 * (target - gap) else None


def val_documents_before(scan: Scan, val_fraction: float, seed: int) -> np.ndarray | None:
    """The rule of gptlab before the split aimed at a fraction of the characters, kept only to recognise the folders
    it prepared (settings_before): the validation corpus, else int(n * val_fraction) whole documents chosen by
    `seed` whatever their sizes, else None."""
    held = _validation_corpus(scan)
    if held is not None:
        return held
    held = np.zeros(scan.documents, dtype=bool)
    k = int(len(held) * val_fraction)
    if k == 0:
        return None
    held[np.random.default_rng(seed).choice(len(held), k, replace=False)] = True
    return held


def digest(held: np.ndarray | None) -> str | None:
    """What a prepare's fingerprint records of the held-out documents: the sha256 of their mask (None: none)."""
    return None if held is None else hashlib.sha256(held).hexdigest()


def settings_before(scan: Scan, settings: dict[str, Any], val_fraction: float, seed: int) -> dict[str, Any]:
    """The settings a prepare fingerprints (`settings`: today's) as gptlab made them for `scan` before the split
    aimed at a fraction of the characters and a char corpus's documents were joined by a newline: the documents
    held out by count (val_documents_before) and no joiner."""
    return {**{k: v for k, v in settings.items() if k != "joiner"},
            "held": digest(val_documents_before(scan, val_fraction, seed))}


def kept_as_before(out: Path, settings: dict[str, Any], before: dict[str, Any], val_fraction: float) -> dict[str, Any]:
    """The metadata of `out`, a folder prepared from the same inputs and settings by the earlier rule (see
    settings_before), which is kept as it is, so that runs trained on it can go on: a warning says so, what differs
    and how to prepare it anew."""
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    share = meta["val_chars"] / max(meta["train_chars"] + meta["val_chars"], 1)
    then, now = [f"held out {share:.1%} of the characters"], []
    if before["held"] != settings["held"]:
        then[0] += " (whole documents, by count)"
        now.append(f"whole documents holding about {val_fraction:g} of the characters")
    if "joiner" in settings:
        then.append("joined the documents with nothing")
        now.append("a newline between documents")
    log.warning(f"{out} was prepared from these inputs and settings by an earlier gptlab, which {' and '.join(then)}; "
                "it is kept as it is, so that the runs trained on it can go on; pass --overwrite to prepare it "
                f"again ({' and '.join(now)})")
    return meta


def _validation_corpus(scan: Scan) -> np.ndarray | None:
    """Every document from the validation corpus's first source on, when one was named."""
    if scan.val_from is None:
        return None
    held = np.zeros(scan.documents, dtype=bool)
    held[sum(d["documents"] for d in scan.described[:scan.val_from]):] = True
    return held


def scan_sources(sources: list[Source], encoding: str, text_field: str, strict: bool,
                 on_progress: Callable[[int], object], refuse_special: bool, collect_chars: bool = True) -> Scan:
    """First pass: validate every file, count documents and characters, hash the bytes and, with collect_chars
    (for a char tokenizer; it is the slowest part), collect the characters. A file found in a folder that cannot be
    read (binary, another encoding, not its kind, JSON lines of which none is a good record) is skipped unless
    `strict`; a file named is refused. A bad JSON line in a file with good ones is left out and listed in
    `bad_records`, unless `strict`, which refuses it. With refuse_special, a text holding the end-of-text marker is
    refused before anything is written."""
    scan = Scan([], 0, [], set(), [])
    for source in sources:
        bad: list[dict[str, Any]] = []

        def on_bad(line: int, reason: str, name: str = source.name) -> None:
            if strict:
                raise UnreadableSource(f"{reason}; --strict refuses a bad record (without it, bad records are "
                                       "left out and counted)")
            bad.append({"path": name, "line": line, "reason": reason})
        try:
            entry, chars, lengths = _scan_source(source, encoding, text_field, on_progress, refuse_special,
                                                 collect_chars, on_bad)
            if bad and entry["documents"] == 0:  # not one good record: not JSON lines, or the wrong field
                hint = "a .jsonl / .json file must hold one JSON object per line" if "is not JSON" in \
                    bad[0]["reason"] else "pass --text-field with the one that holds the text"
                raise UnreadableSource(f"{bad[0]['reason']}, and no line of it is a good record; {hint}")
        except UnreadableSource as exc:
            if strict or not source.found:
                raise
            scan.skipped.append({"path": source.name, "reason": str(exc)})
            continue
        scan.sources.append(source)
        scan.bad_records += bad
        scan.described.append(entry)
        scan.chars |= chars
        scan.total += entry["chars"]
        scan.lengths += lengths
    return scan


def _scan_source(source: Source, encoding: str, text_field: str, on_progress: Callable[[int], object],
                 refuse_special: bool, collect_chars: bool,
                 on_bad: Callable[[int, str], None]) -> tuple[dict[str, Any], set[str], array]:
    sha, n_chars, chars, n_bytes, lengths = hashlib.sha256(), 0, set(), [0], array("q")

    def seen(block: bytes) -> None:
        sha.update(block)
        n_bytes[0] += len(block)
        on_progress(len(block))

    for doc in documents(source, encoding, text_field, seen, on_bad):
        start = n_chars
        for chunk in doc:
            if refuse_special and EOT in chunk:
                raise GptlabError(f"{source.name} contains the text {EOT}, which this tokenizer reserves for the "
                                  "end of a document; pass --allow-special to read it as that token, or remove it")
            n_chars += len(chunk)
            if collect_chars:
                chars.update(chunk)
        if n_chars > start:  # an empty file is no document
            lengths.append(n_chars - start)
    return {"path": source.name, "documents": len(lengths), "chars": n_chars, "bytes": n_bytes[0],
            "sha256": sha.hexdigest()}, chars, lengths
