"""Text pieces -> token ids in parallel processes, with output identical to one process. The caller reads the
documents and decides where every piece goes (train or val side, end-of-text after it or not); the pieces travel in
units of about UNIT_CHARS characters to worker processes, which only encode, and come back in order, with at most
two units per worker in flight, so memory stays flat however large the corpus is."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import queue
import signal
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from multiprocessing import connection, resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext

import numpy as np

from gptlab.errors import GptlabError
from gptlab.tokenizer import Tokenizer, from_dict

UNIT_CHARS = 1 << 20
Piece = tuple[int, str, bool]  # (side: 0 train / 1 val, text, end-of-text after it)
Unit = list[Piece]


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


def _work(tokenizer: dict, allow_special: bool, inbox: Connection, outbox: Connection) -> None:
    """A worker process: encodes the units that arrive in `inbox`, in order, and sends each result (or the
    exception it raised) to `outbox`, until None arrives. A thread keeps reading `inbox`, so that the parent's sends
    never wait for this process to finish sending a result (the cause of a deadlock with two pipes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends the workers
    tok, arrived = from_dict(tokenizer), queue.SimpleQueue()

    def read() -> None:
        try:
            while True:
                arrived.put(inbox.recv())
        except (EOFError, OSError):  # the end, or a unit cut halfway (Ctrl-C stopped the parent sending it): the
            arrived.put(None)  # parent ends this process either way
    threading.Thread(target=read, daemon=True).start()
    while (unit := arrived.get()) is not None:
        try:
            result: object = encode_unit(tok, unit, allow_special)
        except Exception as exc:  # noqa: BLE001 - the parent raises it
            result = exc
        outbox.send(result)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Ctrl-C held off while a worker process starts, so that its start is never cut halfway (the child would print
    the traceback of a half-read start), and the child starts with SIGINT blocked (it ignores Ctrl-C from its first
    instruction on, imports included: Ctrl-C is the parent's to handle); a Ctrl-C that came meanwhile is delivered
    after, to whatever handles SIGINT here."""
    resource_tracker.ensure_running()  # started now, not inside a start: its own start unblocks SIGINT after it
    came: list[int] = []
    held = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum)) if held else None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # a child inherits its parent thread's mask
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if held:
            signal.signal(signal.SIGINT, previous)  # runs a Ctrl-C still pending first: into `came`
            if came:
                signal.raise_signal(signal.SIGINT)


class _Worker:
    """One worker process with its two pipes, seen from the parent."""

    def __init__(self, context: BaseContext, tokenizer: dict, allow_special: bool):
        inbox, self.inbox = context.Pipe(duplex=False)
        self.outbox, outbox = context.Pipe(duplex=False)
        self.process = context.Process(target=_work, args=(tokenizer, allow_special, inbox, outbox), daemon=True)
        try:
            with _sigint_held():
                self.process.start()
        except OSError as exc:  # no process left, or it died before reading its start (Broken pipe)
            raise GptlabError(f"cannot start a worker process to encode the text ({exc.strerror or exc}); run the "
                              "same command again, with --workers 1 if it happens again") from None
        inbox.close()  # the child's ends: once the child has them, a send to a dead child fails instead of waiting
        outbox.close()

    def send(self, unit: Unit | None) -> None:
        try:
            self.inbox.send(unit)
        except OSError:  # the process is gone: receive() says so
            pass

    def receive(self) -> tuple[np.ndarray, np.ndarray]:
        connection.wait([self.outbox, self.process.sentinel])
        try:
            result = self.outbox.recv()
        except (EOFError, OSError):  # the process died between two messages (EOFError) or halfway through
            # sending one ("got end of file during message", OSError): either way its result never comes
            self.process.join()
            code = self.process.exitcode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            raise GptlabError(f"a worker process encoding the text {how} (out of memory?); run the same command "
                              "again to continue from the last checkpoint, with --workers 1 if it happens again"
                              ) from None
        if isinstance(result, BaseException):
            raise result
        return result


def encode_units(tok: Tokenizer, stream: Iterable[Unit], workers: int,
                 allow_special: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """encode_unit over `stream`, in order, in `workers` processes (spawned, so that nothing of the caller's state
    is inherited; unit i goes to process i mod `workers`); in this process when `workers` is 1 or the stream holds
    a single unit. A process that dies (the out-of-memory killer, a signal) raises GptlabError rather than waiting
    for its unit for ever."""
    stream = iter(stream)
    head = [u for u in (next(stream, None), next(stream, None)) if u is not None]
    if workers <= 1 or len(head) < 2:
        for unit in itertools.chain(head, stream):
            yield encode_unit(tok, unit, allow_special)
        return
    context = multiprocessing.get_context("spawn")
    pool: list[_Worker] = []
    finished = False
    try:
        tokenizer = tok.to_dict()
        pool.extend(_Worker(context, tokenizer, allow_special) for _ in range(workers))
        pending: deque[_Worker] = deque()
        for i, unit in enumerate(itertools.chain(head, stream)):
            pool[i % workers].send(unit)
            pending.append(pool[i % workers])
            if len(pending) >= 2 * workers:
                yield pending.popleft().receive()
        while pending:
            yield pending.popleft().receive()
        finished = True
    finally:
        for worker in pool:
            if finished:  # else a unit may be cut halfway (Ctrl-C): the worker ends at the pipe's end instead
                worker.send(None)
            worker.inbox.close()
        for worker in pool:
            if not finished:
                worker.process.terminate()
            worker.process.join()
            worker.outbox.close()
