"""`prepare`: text files -> token files, streamed, so that corpora larger than memory work.

The inputs are collected (corpus), read into documents and scanned (readers), split into train and val (whole
documents, or the last characters of one long text), encoded in worker processes (encoder) and written as shards
(tokenfiles) in a staging folder whose checkpoints make an interrupted prepare resumable (staging); the result is
moved into place at the end, meta.json last. Batches are drawn from the result by `batches`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from gptlab.config import PrepareConfig, build
from gptlab.data import conversations
from gptlab.data.corpus import Source, collect_sources
from gptlab.data.encoder import Piece, encode_units, units
from gptlab.data.readers import (Scan, digest, documents, joiner, kept_as_before, scan_sources, settings_before,
                                 val_documents)
from gptlab.data.staging import CHECKPOINT_UNITS, STAGE, ShardWriter, Staging
from gptlab.data.tokenfiles import SPLITS, VERSION, token_dtype
from gptlab.errors import GptlabError
from gptlab.machine import usable_cores
from gptlab.rundir import folder_kind
from gptlab.tokenizer import Tokenizer, load as load_tokenizer, train_tokenizer

if TYPE_CHECKING:
    from tqdm import tqdm

_T = TypeVar("_T")


class OtherData(GptlabError):
    """The output folder holds prepared data made from other inputs or settings, which a run may train on."""

    def __init__(self, out: Path, runs: list[Path] | None = None):
        self.out = out
        used = f", which run{'s' * (len(runs) > 1)} {', '.join(map(str, runs))} train{'s' * (len(runs) == 1)} on " \
            "(replaced, it could no longer resume them or evaluate them on their data)" if runs else ""
        super().__init__(f"{out} holds data prepared from other inputs or settings{used}; give --out another "
                         "folder, or pass --overwrite to replace it")


def _progress(sources: list[Source], desc: str, quiet: bool, total: int | None = None) -> tqdm:
    """A bar over the bytes read. The scan of compressed or Parquet inputs cannot know their total, so it shows the
    rate; the encoding pass after it is given the total the scan counted, so it shows the time left too."""
    from tqdm import tqdm

    if total is None and not any(s.packed for s in sources):
        total = sum(s.size for s in sources)
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=True if quiet else None, leave=False)


def tokenizer_of(folder: str | Path) -> Tokenizer:
    """The tokenizer of a run or a prepared data folder (or a tokenizer.json file), for `--tokenizer-from`."""
    path = Path(folder)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not path.exists() or (path.is_dir() and folder_kind(path) not in ("run", "data")):
        raise GptlabError(f"--tokenizer-from {folder} is not a gptlab run or prepared data folder; point it at "
                          "one (it must hold tokenizer.json)")
    return load_tokenizer(file)


def _interruptible(fn: Callable[[], _T]) -> _T:
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


@contextlib.contextmanager
def _sigint_raises() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt inside, even where SIGINT came ignored (a shell starts background jobs so,
    and Python then leaves it ignored), so that the staging folder keeps its checkpoint: as train's GracefulStop
    installs its handler whatever it inherited. The ignored state is restored after."""
    ignored = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def prepare_config(tokenizer: str = "char", vocab_size: int | None = None, val_paths: list[str] | None = None,
                   tokenizer_from: str | Path | None = None, **named: Any) -> PrepareConfig:
    """The PrepareConfig that `prepare`'s short form names: the tokenizer's kind, `vocab_size`, any other field by
    its name (`val_paths` for `val`; a path for `tokenizer_from`); what is not named (or None) keeps its default.
    Raises GptlabError on a setting that is out of range or unknown."""
    given = {"tokenizer": tokenizer, "vocab_size": vocab_size, "val": list(val_paths) if val_paths else None,
             "tokenizer_from": str(tokenizer_from) if tokenizer_from else None, **named}
    return build(PrepareConfig, {}, {k: v for k, v in given.items() if v is not None})


@_sigint_raises()
def prepare(paths: list[str], out_dir: str | Path, settings: PrepareConfig | str = "char",
            vocab_size: int | None = None, *, quiet: bool = False, overwrite: bool = False,
            **named: Any) -> dict[str, Any]:
    """Tokenize files and folders (default: the bundled Tiny Shakespeare; see corpus.collect_sources and
    readers.documents for what is read) into `out_dir`/{train,val}.bin, tokenizer.json and meta.json, as `settings`
    say (a PrepareConfig; or for short the tokenizer's kind, in place or as `tokenizer=`, with `vocab_size` and
    other fields named: see prepare_config): with a new tokenizer of kind `tokenizer` or the one of `tokenizer_from`
    (a run or data folder). Every document ends with the end-of-text token, or without one a newline goes between
    documents (readers.joiner). The validation split is the documents of `val` when given, else whole documents
    holding about val_fraction of the characters (see readers.val_documents), else the last val_fraction of them.
    Files found in folders that cannot be read are skipped and listed in the metadata (refused with `strict`).
    `workers` processes encode (default: the cores available), with the same output as one. Each split is written in
    shards of at most `shard_tokens` ids (see tokenfiles). A folder of prepared data is replaced only by the same
    data (same inputs and settings) or with `overwrite` (OtherData otherwise); one the earlier split rule made of the
    same is kept as it is (readers.kept_as_before). Everything is checked before anything is written; the files are
    written in a hidden staging folder and moved into place at the end (meta.json last), so a failure or Ctrl-C
    leaves the prepared folder as it was; the staging folder keeps the last checkpoint, and the same call again
    resumes from it. Returns the metadata; raises GptlabError on bad input or a full disk."""
    if isinstance(settings, PrepareConfig):
        if vocab_size is not None or named:
            raise TypeError("give prepare's settings as a PrepareConfig or by name, not both")
        cfg = settings
    else:
        if "tokenizer" in named:  # the short form's kind by its name, as prepare(..., tokenizer="bpe") always took it
            if settings != "char":
                raise TypeError("prepare() got the tokenizer twice: positionally and as tokenizer=")
            settings = named.pop("tokenizer")
        cfg = prepare_config(settings, vocab_size, **named)
    return _prepare(paths, Path(out_dir), cfg, quiet, overwrite)


def _prepare(paths: list[str], out: Path, cfg: PrepareConfig, quiet: bool, overwrite: bool) -> dict[str, Any]:
    """prepare(), once its settings are one PrepareConfig: check everything, then stage, encode and commit."""
    _check_out(out)
    fixed = tokenizer_of(cfg.tokenizer_from) if cfg.tokenizer_from else None
    if cfg.chat:
        return _prepare_chat(paths, out, cfg, overwrite, fixed)
    pruned: list[str] = []
    scan = _scan_inputs([paths] + ([cfg.val] if cfg.val else []), cfg, pruned, quiet, fixed)
    if fixed:
        _check_covers(fixed, scan.chars, cfg.tokenizer_from)
    held = val_documents(scan, cfg.val_fraction, cfg.seed)
    split = {"split": "characters" if held is None else "validation files" if cfg.val else "documents",
             "val_fraction": None if cfg.val else cfg.val_fraction, "seed": cfg.seed,
             "val_documents": None if held is None else int(held.sum()),
             "skipped_folders": len(pruned), "skipped_files": len(scan.skipped), "skipped": scan.skipped[:20],
             "skipped_records": len(scan.bad_records), "bad_records": scan.bad_records[:20]}
    settings = {"tokenizer": fixed.to_dict() if fixed else [cfg.tokenizer, cfg.vocab_size], "encoding": cfg.encoding,
                "text_field": cfg.text_field, "allow_special": cfg.allow_special, "shard_tokens": cfg.shard_tokens,
                "val_fraction": cfg.val_fraction, "held": digest(held),
                **({"joiner": scan.joiner} if scan.joiner else {})}
    fingerprint = _fingerprint(scan, settings)
    before = settings_before(scan, settings, cfg.val_fraction, cfg.seed)  # as gptlab split and joined them earlier
    if not overwrite and _fingerprint(scan, before) != fingerprint and _made_by(out) == _fingerprint(scan, before):
        return kept_as_before(out, settings, before, cfg.val_fraction)
    if not overwrite and is_prepared(out) and _made_by(out) != fingerprint:
        raise OtherData(out)
    with Staging(out, fingerprint) as stage:
        tok: Tokenizer = fixed or stage.tokenizer() or _interruptible(lambda: _new_tokenizer(cfg, scan))
        try:
            return stage.commit(*_encode(scan, tok, stage, cfg, held, quiet, {**split, "fingerprint": fingerprint}))
        except OSError as exc:
            raise GptlabError(f"cannot write the token files in {out}: {exc.strerror}; free some space or fix the "
                              "permissions (the prepared folder was not changed)") from None


def _check_out(out: Path) -> None:
    """GptlabError unless `out` is new, empty, prepared data (see is_prepared), or holds the staging folder of a
    prepare stopped in it: prepare never writes over files it did not write, --overwrite or not."""
    kind = folder_kind(out)
    if kind in ("run", "hf"):
        raise GptlabError(f"{out} holds a {'gptlab run' if kind == 'run' else 'model (config.json)'}; "
                          "preparing data there would overwrite its files, so give --out a folder of its own")
    if out.exists() and not out.is_dir():
        raise GptlabError(f"--out {out} is a file; give --out a folder (new or empty) for the prepared data")
    stopped = (out / STAGE).is_dir() or (out.parent / f".{out.name}.chat-staging").is_dir()
    if not out.exists() or is_prepared(out) or stopped:
        return
    theirs = sorted(p.name for p in out.iterdir())
    if theirs:
        shown = ", ".join(theirs[:4]) + (f" and {len(theirs) - 4} more" if len(theirs) > 4 else "")
        raise GptlabError(f"{out} holds files gptlab did not write ({shown}); prepare writes only into a new or "
                          "empty folder or over data it prepared, so give --out a folder of its own (e.g. "
                          f"{out.parent / (out.name + '-gptlab')})")


def is_prepared(folder: Path) -> bool:
    """Whether `folder` holds data `gptlab prepare` wrote: token files, tokenizer.json and a meta.json of ours
    (another project's meta.json and train.bin are not)."""
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return folder_kind(folder) == "data" and (folder / "tokenizer.json").is_file() and isinstance(meta, dict) and \
        {"tokenizer", "vocab_size", "train_tokens", "val_tokens"} <= set(meta)


def _prepare_chat(paths: list[str], out: Path, cfg: PrepareConfig, overwrite: bool,
                  fixed: Tokenizer | None) -> dict[str, Any]:
    """prepare() of conversations (see conversations.py): the same folder of the same data is left as it is."""
    built = conversations.build_chat(paths, cfg, fixed)
    if is_prepared(out):
        if _made_by(out) == built.meta["fingerprint"]:
            return json.loads((out / "meta.json").read_text(encoding="utf-8"))
        if not overwrite:
            raise OtherData(out)
    try:
        return conversations.write_chat(out, built)
    except OSError as exc:
        raise GptlabError(f"cannot write the conversations' token files in {out}: {exc.strerror}; free some space "
                          "or fix the permissions") from None


def _new_tokenizer(cfg: PrepareConfig, scan: Scan) -> Tokenizer:
    """A tokenizer of kind cfg.tokenizer built from the text: the characters the scan found, or a BPE vocabulary
    trained over every document."""
    def all_chunks() -> Iterator[str]:
        for source in scan.sources:
            for doc in documents(source, cfg.encoding, cfg.text_field):
                yield from doc

    return train_tokenizer(cfg.tokenizer, [scan.chars] if cfg.tokenizer == "char" else all_chunks(), cfg.vocab_size)


def _encode(scan: Scan, tok: Tokenizer, stage: Staging, cfg: PrepareConfig, held: np.ndarray | None, quiet: bool,
            split: dict[str, Any]) -> tuple[list[ShardWriter], dict[str, Any]]:
    """Encode the scanned corpus into the staging folder's shards: their writers and the metadata of the result
    (`split`: how it was split, and the fingerprint), for Staging.commit."""
    workers = usable_cores() if cfg.workers is None else cfg.workers
    val_fraction, shard_tokens = cfg.val_fraction, cfg.shard_tokens
    encode = {"held": held, "encoding": cfg.encoding, "text_field": cfg.text_field, "quiet": quiet,
              "allow_special": cfg.allow_special, "workers": workers, "joiner": scan.joiner}
    split_at = int(scan.total * (1 - val_fraction))
    scanned = sum(d["bytes"] for d in scan.described)  # the encoding bar's total: its time left
    writers, written = _encode_split(scan.sources, tok, stage, split_at, shard_tokens, scanned, **encode)
    fingerprint = {"fingerprint": split.pop("fingerprint")}
    return writers, {"format_version": VERSION, "tokenizer": tok.kind, "vocab_size": tok.vocab_size,
                     "dtype": token_dtype(tok.vocab_size).name, **written, **split, "shard_tokens": shard_tokens,
                     "encoding": cfg.encoding, "text_field": cfg.text_field,
                     "documents": sum(d["documents"] for d in scan.described), "sources": scan.described,
                     **fingerprint}


def _scan_inputs(groups: list[list[str]], cfg: PrepareConfig, pruned: list[str], quiet: bool,
                 fixed: Tokenizer | None) -> Scan:
    """The scan (readers.scan_sources) of the corpus, followed by that of the validation corpus when `groups`
    names one; each must hold some text. Every source is collected before any is read. Text holding the
    end-of-text token is refused where the tokenizer has one, unless cfg.allow_special; characters are collected
    for a char tokenizer."""
    has_special = fixed.eot_id is not None if fixed else cfg.tokenizer != "char"
    refuse_special = has_special and not cfg.allow_special
    collect_chars = (fixed.kind if fixed else cfg.tokenizer) == "char"
    scans = []
    for sources, what in zip([collect_sources(g, cfg.include, cfg.exclude, pruned) for g in groups],
                             ("corpus", "validation corpus")):
        with _progress(sources, "scan", quiet) as bar:
            scans.append(scan_sources(sources, cfg.encoding, cfg.text_field, cfg.strict, bar.update, refuse_special,
                                      collect_chars))
        _check_not_empty(scans[-1], sources, what)
    scan = scans[0].joined(scans[1]) if len(scans) > 1 else scans[0]
    scan.joiner = joiner(scan, has_special)
    scan.chars.update(scan.joiner)  # a char tokenizer must spell the newline between documents
    return scan


def _fingerprint(scan: Scan, settings: dict[str, Any]) -> str:
    """What makes two prepares the same, so that one may resume the other or replace its result: the inputs'
    bytes, in order, and the settings (not the paths they were named by)."""
    what = {"version": VERSION, "sources": [d["sha256"] for d in scan.described], **settings}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _made_by(folder: Path) -> str | None:
    """The fingerprint a prepared folder's meta.json records (None for a folder from before fingerprints)."""
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta.get("fingerprint") if isinstance(meta, dict) else None


def _check_not_empty(scan: Scan, sources: list[Source], what: str) -> None:
    if scan.total == 0:
        n = len(scan.skipped)
        skipped = f"; {n} unreadable file{'s were' if n > 1 else ' was'} skipped, e.g. {scan.skipped[0]['reason']}" \
            if n else ""
        shown = ", ".join(s.name for s in sources[:5]) + (" ..." if len(sources) > 5 else "")
        raise GptlabError(f"the {what} ({shown}) is empty; give a file with text in it{skipped}")


def _pieces(sources: list[Source], split_at: int, held: np.ndarray | None, encoding: str, text_field: str,
            bar: tqdm, chars: list[int], joiner: str = "") -> Iterator[Piece]:
    """Every document's text in pieces, each marked with its side: the documents marked in `held` go to val and
    the rest to train, or without it, characters before `split_at` go to train and the rest to val. Every document
    ends with the end-of-text token (on the side its last character is), and `joiner` follows it on that side when
    another document comes. Counts the characters of each side: the documents' own, not the joiners'."""
    position, index, end = 0, 0, None
    for source in sources:
        for doc in documents(source, encoding, text_field, lambda block: bar.update(len(block))):
            pieces = iter(doc)
            first = next(pieces, None)
            if first is None:  # an empty file: no document
                continue
            if joiner and end is not None:
                yield end, joiner, False
            side = None if held is None else int(held[index])
            index += 1
            for chunk in itertools.chain([first], pieces):
                cut = min(max(split_at - position, 0), len(chunk)) if side is None else len(chunk) * (1 - side)
                for s, piece in ((0, chunk[:cut]), (1, chunk[cut:])):
                    if piece:
                        chars[s] += len(piece)
                        yield s, piece, False
                position += len(chunk)
            end = int(position > split_at) if side is None else side
            yield end, "", True


def _encode_split(sources: list[Source], tok: Tokenizer, stage: Staging, split_at: int, shard_tokens: int,
                  scanned: int, held: np.ndarray | None, encoding: str, text_field: str, quiet: bool,
                  allow_special: bool, workers: int, joiner: str) -> tuple[list[ShardWriter], dict[str, Any]]:
    """Encode everything into the train and val shards (see `_pieces`) in `workers` processes, from the staging
    folder's checkpoint when it has one: the units before it are read again (to count characters and find the
    place) but not encoded."""
    writers, done = _writers(stage, tok, shard_tokens, quiet)
    chars = [0, 0]
    try:
        with _progress(sources, "encode", quiet, scanned) as bar:
            stream = units(_pieces(sources, split_at, held, encoding, text_field, bar, chars, joiner))
            for _ in itertools.islice(stream, done):
                pass
            for ids in encode_units(tok, stream, workers, allow_special):
                for writer, part in zip(writers, ids):
                    writer.write(part)
                done += 1
                if any(w.completed for w in writers) or done % CHECKPOINT_UNITS == 0:
                    stage.checkpoint(done, writers)
                tokens = writers[0].tokens + writers[1].tokens
                bar.set_postfix_str(f"{tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f} tokens/s", refresh=False)
    except BaseException:
        for w in writers:
            w.abandon()
        raise
    return writers, {"train_tokens": writers[0].tokens, "val_tokens": writers[1].tokens, "train_chars": chars[0],
                     "val_chars": chars[1]}


def _writers(stage: Staging, tok: Tokenizer, shard_tokens: int, quiet: bool) -> tuple[list[ShardWriter], int]:
    """The two splits' shard writers, and the units already in them: from the checkpoint when its files (the
    shards and the tokenizer they were encoded with) are whole, else new (the staging folder emptied, the tokenizer
    saved into it)."""
    if stage.progress is not None:
        try:
            saved = stage.progress["splits"]
            if not all((stage.path / e["file"]).is_file() for s in saved for e in s["closed"]):
                raise ValueError("a complete shard is missing")
            if not (stage.path / "tokenizer.json").is_file():
                raise ValueError("the tokenizer is missing")
            writers = [ShardWriter(stage.path, name, tok.vocab_size, shard_tokens, s["closed"], s["open_tokens"])
                       for name, s in zip(SPLITS, saved)]
            if not quiet:
                print(f"resuming the prepare interrupted in {stage.path}: {writers[0].tokens + writers[1].tokens:,} "
                      f"tokens already written, {sum(len(w.closed) for w in writers)} complete shards",
                      file=sys.stderr)
            return writers, int(stage.progress["units_done"])
        except (OSError, ValueError, KeyError, TypeError):
            stage.reset()
    tok.save(stage.path / "tokenizer.json")
    return [ShardWriter(stage.path, name, tok.vocab_size, shard_tokens) for name in SPLITS], 0
