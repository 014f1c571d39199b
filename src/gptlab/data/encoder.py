"""Text pieces -> token ids in parallel processes, with output identical to one process. The caller reads the
documents and decides where every piece goes (train or val side, end-of-text after it or not); the pieces travel in
units of about UNIT_CHARS characters to worker processes, which only encode, and come back in order, with at most
two units per worker in flight, so memory stays flat however large the corpus is."""

from __future__ import annotations

import itertools
import multiprocessing
import signal
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from gptlab.tokenizer import Tokenizer, from_dict

UNIT_CHARS = 1 << 20
Piece = tuple[int, str, bool]  # (side: 0 train / 1 val, text, end-of-text after it)
Unit = list[Piece]

_worker: dict[str, object] = {}


def units(pieces: Iterable[Piece], size: int | None = None) -> Iterator[Unit]:
    """The pieces grouped in order into units of at least `size` characters (default UNIT_CHARS), the last
    one smaller."""
    size = UNIT_CHARS if size is None else size
    unit: Unit = []
    chars = 0
    for piece in pieces:
        unit.append(piece)
        chars += len(piece[1])
        if chars >= size:
            yield unit
            unit, chars = [], 0
    if unit:
        yield unit


def encode_unit(tok: Tokenizer, unit: Unit, allow_special: bool) -> tuple[np.ndarray, np.ndarray]:
    """The ids of a unit's pieces on the train side and on the val side, each in order (int32)."""
    ids: tuple[list[int], list[int]] = ([], [])
    for side, text, eot in unit:
        if text:
            ids[side].extend(tok.encode(text, allow_special))
        if eot and tok.eot_id is not None:
            ids[side].append(tok.eot_id)
    return np.asarray(ids[0], dtype=np.int32), np.asarray(ids[1], dtype=np.int32)


def _start_worker(tokenizer: dict, allow_special: bool) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends the pool
    _worker["tok"], _worker["allow_special"] = from_dict(tokenizer), allow_special


def _encode_in_worker(unit: Unit) -> tuple[np.ndarray, np.ndarray]:
    return encode_unit(_worker["tok"], unit, _worker["allow_special"])  # type: ignore[arg-type]


def encode_units(tok: Tokenizer, stream: Iterable[Unit], workers: int,
                 allow_special: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """encode_unit over `stream`, in order, in `workers` processes (spawned, so that nothing of the caller's state
    is inherited); in this process when `workers` is 1 or the stream holds a single unit."""
    stream = iter(stream)
    head = [u for u in (next(stream, None), next(stream, None)) if u is not None]
    if workers <= 1 or len(head) < 2:
        for unit in itertools.chain(head, stream):
            yield encode_unit(tok, unit, allow_special)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=(tok.to_dict(), allow_special)) as pool:
        pending: deque = deque()
        for unit in itertools.chain(head, stream):
            pending.append(pool.apply_async(_encode_in_worker, (unit,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
