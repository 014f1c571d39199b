"""Continuous batching: one thread owns the model and runs a `RunningBatch`. Requests wait in a bounded queue; at
every step the ones that fit join the batch (prefilled, then decoded with the rest from the next step on), every row
draws its next token with its own settings and generator, and finished or cancelled rows leave at once. Each
request's events (typed: `PromptLogprobs`, `Token`, then `Done` or `Failed`) go to its own asyncio queue on the
server's event loop; the counts /metrics reports are updated here (gptlab.serve.metrics)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from gptlab.engine import Row, RunningBatch
from gptlab.inference.prepared import InferenceModel
from gptlab.serve.api import CompletionRequest
from gptlab.serve.metrics import Metrics, metrics_registry
from gptlab.textstream import Completion
from gptlab.tokenizer import Tokenizer

log = logging.getLogger(__name__)


# ---- what a job tells its answer (gptlab.serve.responses shapes them) ----------------------------------------------

@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt's echo logprobs (`prompt_logprobs`), for each of its n choices: the prompt's index and OpenAI's
    four lists (tokens, token_logprobs, top_logprobs, text_offset)."""

    prompt: int
    entries: dict[str, list]


@dataclass(frozen=True)
class Token:
    """One generated token of one choice: the text it releases ("" while a character is incomplete), its id, its
    log-probabilities (`top_logprobs`; None where none were asked for) and, on the choice's last token, the finish
    reason ("stop" or "length")."""

    choice: int
    text: str
    id: int
    logprobs: dict[str, Any] | None
    finish_reason: str | None


@dataclass(frozen=True)
class Done:
    """A job's end: the usage, each prompt counted once however many choices (`cached_tokens`: those of its prompt
    tokens whose keys and values the prefix cache served)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    prediction: tuple[int, int] | None = None  # a predicted output's tokens accepted and rejected, where one was given


@dataclass(frozen=True)
class Failed:
    """A job's end when generation failed or the server shut down first: the message for the client."""

    message: str


Event = PromptLogprobs | Token | Done | Failed


@dataclass(eq=False)
class Job:
    """One accepted request on its way through the scheduler. Events put on `events` (from the scheduler's thread,
    through `loop`): a `PromptLogprobs` per prompt where echo and logprobs are asked for, a `Token` per generated
    token, then `Done` or `Failed` (the last). `cached`: its prompts' tokens served from the prefix cache."""

    request: CompletionRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    rows: dict[Row, tuple[int, Completion]] = field(default_factory=dict)  # its rows -> (choice index, text)
    generated: int = 0
    cached: int = 0
    accepted: int = 0  # of a predicted output's tokens (its rows' Prediction), counted as each row finishes
    rejected: int = 0
    first_token: float | None = None

    @property
    def size(self) -> int:
        return len(self.request.ids) * self.request.n

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (the server is gone): nobody is listening
            self.cancelled.set()


class Scheduler:
    """The thread that owns the model. `submit` queues a Job (False when the queue is full: the caller answers
    429); `stop` ends it: new jobs are refused, running ones get `grace` seconds to finish, then are cancelled.
    `idle` is set while no job waits or runs (the thread has nothing to do), cleared by `submit`."""

    def __init__(self, model: InferenceModel | torch.nn.Module, tokenizer: Tokenizer, max_batch: int, queue: int,
                 prefix_cache: PrefixCache | None = None):
        self.batch = RunningBatch(model, prefix_cache)
        self.tokenizer, self.max_batch, self.queue_size = tokenizer, max_batch, queue
        self.metrics = Metrics()
        self.registry = metrics_registry(self.metrics, self.batch)  # what /metrics exposes
        self._waiting: deque[Job] = deque()
        self._jobs: list[Job] = []  # in the batch
        self._owner: dict[Row, Job] = {}  # each row in the batch -> its job
        self._wake = threading.Condition()
        self._closing = False
        self._deadline = float("inf")
        self.idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gptlab-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Queue `job`; False (the caller answers 429) when `queue` jobs already wait that the batch cannot take
        now (jobs that arrive together and fit in the batch never count against the queue)."""
        with self._wake:
            if self._closing or self._beyond_the_batch() >= self.queue_size:
                return False
            self._waiting.append(job)
            self.idle.clear()
            self.metrics.queue_depth = len(self._waiting)
            self._wake.notify()
        return True

    def waiting(self) -> list[Job]:
        """The jobs waiting for a place in the batch, first come first."""
        with self._wake:
            return list(self._waiting)

    def _beyond_the_batch(self) -> int:
        """How many waiting jobs would still wait if the batch took all it has room for now (under the lock)."""
        return len(self._waiting) - self._fitting()

    def _fitting(self) -> int:
        """How many waiting jobs, first come first served, the batch has room for now (a cancelled one takes none;
        under the lock)."""
        rows, count = len(self.batch.rows), 0
        for job in self._waiting:
            size = 0 if job.cancelled.is_set() else job.size
            if rows + size > self.max_batch:
                break
            rows, count = rows + size, count + 1
        return count

    def close(self, grace: float) -> None:
        """Refuse new jobs from now on and give running and waiting ones `grace` seconds to finish; the first call
        sets the deadline (a shutdown signal's, before the server stops: `gptlab.serve.server.serve_run`)."""
        with self._wake:
            if not self._closing:
                self._closing = True
                self._deadline = time.monotonic() + grace
            self._wake.notify()

    def stop(self, grace: float) -> None:
        """`close(grace)`, then wait for the jobs to finish or be cancelled at the deadline."""
        self.close(grace)
        self._thread.join(max(self._deadline - time.monotonic(), 0) + 5)

    @property
    def closing(self) -> bool:
        return self._closing

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._wake:
                while not self._waiting and not self._jobs and not self._closing:
                    self.idle.set()
                    self._wake.wait()
                if self._closing and (time.monotonic() >= self._deadline or not (self._waiting or self._jobs)):
                    break
                joining = self._admit()
            try:
                for job in joining:
                    self._start(job)
                self._drop_cancelled()
                if self.batch.rows:
                    self._step()
                elif not joining:
                    time.sleep(0.005)  # nothing to decode (what was waiting had been cancelled): do not spin
            except Exception as exc:  # a bug must not leave clients waiting forever: fail the jobs, keep serving
                log.exception("the scheduler failed a step")
                for job in [*self._jobs, *(j for j in joining if j not in self._jobs)]:  # joining: those starting
                    job.emit(Failed(f"generation failed: {exc}"))
                self.batch.leave(list(self.batch.rows))
                self._jobs, self._owner = [], {}
        for job in [*self._jobs, *self._waiting]:
            job.emit(Failed("the server is shutting down"))

    def _admit(self) -> list[Job]:
        """Waiting jobs that fit in the batch now, first come first served (under the lock)."""
        joining = []
        for _ in range(self._fitting()):
            job = self._waiting.popleft()
            if job.cancelled.is_set():  # its client left while it waited
                self.metrics.cancelled += 1
            else:
                joining.append(job)
        self.metrics.queue_depth = len(self._waiting)
        return joining

    def _start(self, job: Job) -> None:
        """The job's prompts' logprobs where it asks for them (echo with logprobs), then its rows in the batch (the
        tokens the prefix cache served counted once a prompt: its n rows share one prefill); a job that generates
        nothing (max_tokens 0) is done there."""
        req = job.request
        for p, ids in enumerate(req.ids):
            echo = req.echo and req.logprobs is not None
            if req.max_tokens == 0:
                if echo:
                    job.emit(PromptLogprobs(p, prompt_logprobs(self.batch.prompt_logits(ids), ids, req.logprobs,
                                                               self.tokenizer)))
                continue
            rows = self.batch.join(ids, req.cfg, req.n, prompt_logits=echo,  # with them, no block is reused
                                   prediction=req.prediction_ids,
                                   steer=req.structure.steer() if req.structure is not None else None)
            if echo:
                job.emit(PromptLogprobs(p, prompt_logprobs(rows[0].prompt_logits, ids, req.logprobs,
                                                           self.tokenizer)))
            job.cached += rows[0].cached
            for i, row in enumerate(rows):
                job.rows[row] = (p * req.n + i, Completion(self.tokenizer, req.cfg.stop))
                self._owner[row] = job
        if req.max_tokens == 0:
            prompt = sum(map(len, req.ids))
            job.emit(Done(prompt, 0))
            return
        self._jobs.append(job)

    def _fail_dead_ends(self) -> None:
        """A job with a row whose grammar allowed no token the model has ends with that row's error (its other
        rows leave too: one answer, whole or failed)."""
        for job in [j for j in self._jobs if any(row.error for row in j.rows)]:
            error = next(row.error for row in job.rows if row.error)
            job.emit(Failed(error))
            self.batch.leave(list(job.rows))
            for row in job.rows:
                del self._owner[row]
            self._jobs.remove(job)

    def _drop_cancelled(self) -> None:
        gone = [job for job in self._jobs if job.cancelled.is_set()]
        for job in gone:
            self.batch.leave(list(job.rows))
            for row in job.rows:
                del self._owner[row]
            self._jobs.remove(job)
            self.metrics.cancelled += 1

    def _step(self) -> None:
        self.metrics.batch_rows = len(self.batch.rows)
        finished = []
        drawn = self.batch.sample()
        last = {row: i for i, (row, _, _) in enumerate(drawn)}  # a row's last token now (of several: speculation)
        for i, (row, token, logits) in enumerate(drawn):
            job = self._owner.get(row)
            if job is None:  # a row that drew several tokens at once and stopped (a stop string) before its last
                continue
            choice, completion = job.rows[row]
            text = completion.push(token)
            if row.left <= 0 and last[row] == i and completion.finish_reason is None and not row.error:
                text += completion.close("stop" if row.finish else "length")  # (a grammar complete: "stop")
            reason = {"eot": "stop"}.get(completion.finish_reason, completion.finish_reason)
            info = top_logprobs(logits, token, job.request.logprobs, self.tokenizer) \
                if job.request.logprobs is not None else None
            job.emit(Token(choice, text, token, info, reason))
            job.generated += 1
            self.metrics.tokens += 1
            if job.first_token is None:
                job.first_token = time.perf_counter()
                self.metrics.observe_ttft(job.first_token - job.arrived)
            if reason is not None:
                finished.append(row)
                del job.rows[row], self._owner[row]
                predicted = row.lookup.prediction if row.lookup is not None else None
                if predicted is not None:
                    job.accepted, job.rejected = job.accepted + predicted.accepted, job.rejected + predicted.rejected
        self._fail_dead_ends()
        self.batch.leave(finished)
        for job in [j for j in self._jobs if not j.rows]:
            self._jobs.remove(job)
            prompt = sum(map(len, job.request.ids))
            predicted = (job.accepted, job.rejected) if job.request.prediction_ids is not None else None
            job.emit(Done(prompt, job.generated, job.cached, predicted))
        self.batch.advance()


def top_logprobs(logits: torch.Tensor, token: int, top: int, tokenizer: Tokenizer) -> dict[str, Any]:
    """The chosen token's log-probability under the model (temperature 1, no filters) and the `top` most likely
    tokens' (text -> logprob, as completions give them; "ranked": most likely first, each with its bytes, as chat
    completions give them)."""
    logp = torch.log_softmax(logits[0].float(), dim=-1)
    best = torch.topk(logp, min(top, logp.numel())) if top else None
    pairs = [] if best is None else list(zip(best.values.tolist(), best.indices.tolist()))
    ranked = [{"token": tokenizer.decode([i]), "logprob": round(v, 5), "bytes": list(tokenizer.decode_bytes([i]))}
              for v, i in pairs]
    return {"token": tokenizer.decode([token]), "logprob": round(float(logp[token]), 5),
            "top": _top_dict(pairs, tokenizer, 5), "bytes": list(tokenizer.decode_bytes([token])), "ranked": ranked}


def _top_dict(pairs, tokenizer: Tokenizer, digits: int | None) -> dict[str, float]:
    """(logprob, id) pairs, most likely first, as OpenAI's text -> logprob; two tokens that print alike (byte
    pieces of one character) keep the likelier one's logprob, so the dict's largest value is the real maximum."""
    out: dict[str, float] = {}
    for value, i in pairs:
        out.setdefault(tokenizer.decode([int(i)]), value if digits is None else round(value, digits))
    return out


def prompt_logprobs(logits: torch.Tensor, ids: list[int], top: int, tokenizer: Tokenizer) -> dict[str, list]:
    """OpenAI's echo logprobs of a prompt from its logits (T, V) (the prompt pass's: `RunningBatch.prompt_logits`, `join`'s): each
    token's text, its log-probability given the tokens before it (None for the first, which has none), the `top`
    most likely tokens there (text -> logprob; None for the first), and where each token's text starts. Not
    rounded: summed, they are the prompt's log-likelihood."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)  # (T - 1, V): position t predicts token t + 1
    chosen = logp.gather(1, torch.tensor(ids[1:], device=logp.device)[:, None])[:, 0].tolist()
    best = torch.topk(logp, top) if top else None
    tops: list[dict | None] = [None]
    for t in range(len(ids) - 1):
        tops.append(_top_dict([] if best is None else zip(best.values[t].tolist(), best.indices[t].tolist()),
                              tokenizer, digits=None))
    texts = [tokenizer.decode([i]) for i in ids]
    offsets = [0, *itertools.accumulate(len(x) for x in texts[:-1])]
    return {"tokens": texts, "token_logprobs": [None, *chosen], "top_logprobs": tops, "text_offset": offsets}
