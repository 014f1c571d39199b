"""Continuous batching: one thread owns the model and runs a `RunningBatch`. Requests wait in a bounded queue; at
every step the ones that fit join the batch (prefilled, then decoded with the rest from the next step on), every row
draws its next token with its own settings and generator, and finished or cancelled rows leave at once. Each
request's events (text, token, logprobs, finish reason) go to its own asyncio queue on the server's event loop."""

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
from gptlab.textstream import Completion
from gptlab.tokenizer import Tokenizer

log = logging.getLogger(__name__)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(eq=False)
class Job:
    """One accepted request on its way through the scheduler. Events put on `events` (from the scheduler's thread,
    through `loop`): ("prompt", prompt index, its echo logprobs) where echo and logprobs are asked for, ("token",
    choice index, text, token id, logprob info or None, finish reason or None), then ("done", usage dict) or
    ("error", message)."""

    request: CompletionRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    rows: dict[Row, tuple[int, Completion]] = field(default_factory=dict)  # its rows -> (choice index, text)
    generated: int = 0
    first_token: float | None = None

    @property
    def size(self) -> int:
        return len(self.request.ids) * self.request.n

    def emit(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (the server is gone): nobody is listening
            self.cancelled.set()


@dataclass
class Metrics:
    """What /metrics reports (the scheduler updates it; reads need no lock: each value is one Python object)."""

    requests: dict[str, int] = field(default_factory=dict)  # HTTP status -> count
    tokens: int = 0
    cancelled: int = 0
    queue_depth: int = 0
    batch_rows: int = 0
    ttft: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0

    def observe_ttft(self, seconds: float) -> None:
        index = next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))
        self.ttft[index] += 1
        self.ttft_sum += seconds

    def count(self, status: int) -> None:
        self.requests[str(status)] = self.requests.get(str(status), 0) + 1

    def text(self) -> str:
        """The Prometheus text exposition format."""
        lines = ["# HELP gptlab_requests_total Completion requests answered, by HTTP status.",
                 "# TYPE gptlab_requests_total counter"]
        lines += [f'gptlab_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
        lines += ["# HELP gptlab_tokens_generated_total Tokens generated, all requests.",
                  "# TYPE gptlab_tokens_generated_total counter", f"gptlab_tokens_generated_total {self.tokens}",
                  "# HELP gptlab_requests_cancelled_total Requests whose client left before the end.",
                  "# TYPE gptlab_requests_cancelled_total counter", f"gptlab_requests_cancelled_total {self.cancelled}",
                  "# HELP gptlab_queue_depth Requests waiting for a place in the batch.",
                  "# TYPE gptlab_queue_depth gauge", f"gptlab_queue_depth {self.queue_depth}",
                  "# HELP gptlab_batch_size Sequences decoded together at the last step.",
                  "# TYPE gptlab_batch_size gauge", f"gptlab_batch_size {self.batch_rows}",
                  "# HELP gptlab_time_to_first_token_seconds From a request's arrival to its first token.",
                  "# TYPE gptlab_time_to_first_token_seconds histogram"]
        total = 0
        for bound, n in zip([*map(str, TTFT_BUCKETS), "+Inf"], self.ttft):
            total += n
            lines.append(f'gptlab_time_to_first_token_seconds_bucket{{le="{bound}"}} {total}')
        lines += [f"gptlab_time_to_first_token_seconds_sum {self.ttft_sum:.6f}",
                  f"gptlab_time_to_first_token_seconds_count {total}"]
        return "\n".join(lines) + "\n"


class Scheduler:
    """The thread that owns the model. `submit` queues a Job (False when the queue is full: the caller answers
    429); `stop` ends it: new jobs are refused, running ones get `grace` seconds to finish, then are cancelled.
    `idle` is set while no job waits or runs (the thread has nothing to do), cleared by `submit`."""

    def __init__(self, model: InferenceModel | torch.nn.Module, tokenizer: Tokenizer, max_batch: int, queue: int):
        self.batch = RunningBatch(model)
        self.model = getattr(model, "model", model)  # the nn.Module: a whole prompt's forward (prompt logprobs)
        self.tokenizer, self.max_batch, self.queue_size = tokenizer, max_batch, queue
        self.metrics = Metrics()
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
                for job in self._jobs:
                    job.emit(("error", f"generation failed: {exc}"))
                self.batch.leave(list(self.batch.rows))
                self._jobs, self._owner = [], {}
        for job in [*self._jobs, *self._waiting]:
            job.emit(("error", "the server is shutting down"))

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
        """The job's prompts' logprobs where it asks for them (echo with logprobs), then its rows in the batch; a
        job that generates nothing (max_tokens 0) is done there."""
        req = job.request
        for p, ids in enumerate(req.ids):
            if req.echo and req.logprobs is not None:
                job.emit(("prompt", p, prompt_logprobs(self.model, ids, req.logprobs, self.tokenizer)))
            if req.max_tokens == 0:
                continue
            for i, row in enumerate(self.batch.join(ids, req.cfg, req.n)):
                job.rows[row] = (p * req.n + i, Completion(self.tokenizer, req.cfg.stop))
                self._owner[row] = job
        if req.max_tokens == 0:
            prompt = sum(map(len, req.ids))
            job.emit(("done", {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}))
            return
        self._jobs.append(job)

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
        for row, token, logits in self.batch.sample():
            job = self._owner[row]
            choice, completion = job.rows[row]
            text = completion.push(token)
            if row.left <= 0 and completion.finish_reason is None:
                text += completion.close("length")
            reason = {"eot": "stop"}.get(completion.finish_reason, completion.finish_reason)
            info = top_logprobs(logits, token, job.request.logprobs, self.tokenizer) \
                if job.request.logprobs is not None else None
            job.emit(("token", choice, text, token, info, reason))
            job.generated += 1
            self.metrics.tokens += 1
            if job.first_token is None:
                job.first_token = time.perf_counter()
                self.metrics.observe_ttft(job.first_token - job.arrived)
            if reason is not None:
                finished.append(row)
                del job.rows[row], self._owner[row]
        self.batch.leave(finished)
        for job in [j for j in self._jobs if not j.rows]:
            self._jobs.remove(job)
            prompt = sum(map(len, job.request.ids))
            job.emit(("done", {"prompt_tokens": prompt, "completion_tokens": job.generated,
                               "total_tokens": prompt + job.generated}))
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


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, ids: list[int], top: int, tokenizer: Tokenizer) -> dict[str, list]:
    """OpenAI's echo logprobs of a prompt: each token's text, its log-probability given the tokens before it (None
    for the first, which has none), the `top` most likely tokens there (text -> logprob; None for the first), and
    where each token's text starts. Not rounded: summed, they are the prompt's log-likelihood."""
    logits, _ = model(torch.tensor([ids], device=next(model.parameters()).device))
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)  # (T - 1, V): position t predicts token t + 1
    chosen = logp.gather(1, torch.tensor(ids[1:], device=logp.device)[:, None])[:, 0].tolist()
    best = torch.topk(logp, top) if top else None
    tops: list[dict | None] = [None]
    for t in range(len(ids) - 1):
        tops.append(_top_dict([] if best is None else zip(best.values[t].tolist(), best.indices[t].tolist()),
                              tokenizer, digits=None))
    texts = [tokenizer.decode([i]) for i in ids]
    offsets = [0, *itertools.accumulate(len(x) for x in texts[:-1])]
    return {"tokens": texts, "token_logprobs": [None, *chosen], "top_logprobs": tops, "text_offset": offsets}
