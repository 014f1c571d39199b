"""`gptlab bench serve`: concurrent clients against a `gptlab serve` it starts on loopback, beside the same kind of
requests sent one at a time. Each client streams its requests (server-sent events) and times the first token and
the whole request; the table gives tokens/s, p50 / p95 time to first token and latency, 429s and errors. With more
clients than `--max-batch` + `--queue`, the excess get 429 at once and every accepted request still completes."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import torch

from gptlab.bench.timing import LoadWatch
from gptlab.config import ModelConfig, build, get_preset
from gptlab.errors import GptlabError
from gptlab.inference.loading import bf16_storage_possible
from gptlab.runtime import device_name, resolve_precision, set_threads
from gptlab.serve.api import Limits
from gptlab.serve.app import make_app
from gptlab.serve.server import load_served, start_server


@dataclass
class Outcome:
    """One request as a client saw it."""

    status: int
    tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    error: str = ""


@dataclass
class Phase:
    """All requests of one mode (one at a time, or concurrent clients)."""

    name: str
    clients: int
    seconds: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200 and not o.error]

    @property
    def refused(self) -> int:
        return sum(o.status == 429 for o in self.outcomes)

    @property
    def errors(self) -> int:
        return len(self.outcomes) - len(self.ok) - self.refused

    @property
    def tokens_per_s(self) -> float:
        return sum(o.tokens for o in self.ok) / self.seconds if self.seconds else 0.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


async def _one_request(http, body: dict) -> Outcome:
    start = time.perf_counter()
    out = Outcome(0)
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            out.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"]["message"]
                elif chunk["choices"] and not out.ttft:
                    out.ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # a lost connection is a failed request, counted, never a crash of the bench
        out.error = f"{type(exc).__name__}: {exc}"
    out.latency = time.perf_counter() - start
    if out.status == 200 and not out.tokens and not out.error:
        out.error = "no usage in the stream"
    return out


async def _run_phase(url: str, phase: Phase, requests_each: int, body: dict, time_limit: float) -> None:
    import httpx

    limits = httpx.Limits(max_connections=phase.clients + 4, max_keepalive_connections=phase.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=max(time_limit, 60.0) * 2, limits=limits) as http:
        deadline = time.perf_counter() + time_limit

        async def client(c: int) -> None:
            for r in range(requests_each):
                if time.perf_counter() > deadline:
                    return
                phase.outcomes.append(await _one_request(http, {**body, "seed": 1000 * c + r}))

        start = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(phase.clients)))
        phase.seconds = time.perf_counter() - start


def _model(model: str | None, run: str | None, precision: str):
    """A Served: a run's model, or a GPT-2-124M-shaped one with random weights and GPT-2's tokenizer."""
    from gptlab.inference.loading import prepare_for_inference
    from gptlab.model import GPT
    from gptlab.serve.app import Served
    from gptlab.tokenizer import GPT2Tokenizer

    if run is not None:
        return load_served(run, precision, torch.device("cpu"))
    if model != "gpt2-124M":
        raise GptlabError(f"--model must be gpt2-124M (or give --run), not {model!r}")
    torch.manual_seed(0)
    gpt = GPT(build(ModelConfig, {**get_preset("gpt2").model, "dropout": 0.0}, {}))
    parameters = gpt.num_params()
    return Served("gpt2-124M-random", prepare_for_inference(gpt, precision), GPT2Tokenizer(), parameters,
                  lambda: gpt)  # /inspect's model: the bench never asks for it


def _prompt(tokenizer, tokens: int) -> str:
    """A prompt of about `tokens` tokens that any tokenizer can encode (its own decoded ids)."""
    text = tokenizer.decode([i % tokenizer.vocab_size for i in range(2 * tokens)])  # ids may merge when re-encoded
    lo, hi = 1, len(text)  # the longest prefix of at most `tokens` tokens (one character at least), by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tokenizer.encode(text[:mid])) <= tokens else (lo, mid - 1)
    return text[:lo]


def _row(phase: Phase) -> str:
    ok = phase.ok
    ttft, latency = [o.ttft for o in ok], [o.latency for o in ok]
    return (f"{phase.name:<14} {phase.clients:>7} {len(phase.outcomes):>8} {len(ok):>5} {phase.refused:>5} "
            f"{phase.errors:>6} {sum(o.tokens for o in ok):>7} {phase.seconds:>8.1f} {phase.tokens_per_s:>9.1f} "
            f"{percentile(ttft, 50):>9.3f} {percentile(ttft, 95):>9.3f} {percentile(latency, 50):>9.2f} "
            f"{percentile(latency, 95):>9.2f}")


def run_serve_bench(*, model: str | None = "gpt2-124M", run: str | None = None, clients: int = 8,
                    requests: int = 2, sequential: int = 4, max_tokens: int = 128, prompt_tokens: int = 16,
                    max_batch: int = 16, queue: int = 64, precision: str = "auto",
                    time_limit: float = 60.0) -> list[str]:
    """Start a server on 127.0.0.1 (a free port) in this process, send `sequential` requests one at a time, then
    `clients` concurrent clients with `requests` each (no new request after `time_limit` seconds per phase);
    print the table, the machine's load and the summary lines, and return those lines (the last: the headline)."""
    set_threads()
    watch = LoadWatch()
    device = torch.device("cpu")
    served = _model(model, run, resolve_precision(precision, device, bf16_storage_possible(device)))
    body = {"prompt": _prompt(served.tokenizer, prompt_tokens), "max_tokens": max_tokens, "temperature": 1.0,
            "stream": True}
    limits = Limits(max_tokens=max_tokens, max_batch=max_batch, queue=queue, grace=1.0)
    running = start_server(make_app(served, limits))
    fused = "fused native step" if served.model.fused else "torch ops"
    print(f"gptlab bench serve: {served.name} ({served.parameters / 1e6:.0f}M parameters, "
          f"{served.model.precision or 'fp32'}, decoded by {fused}) at {running.url}; prompt ~{prompt_tokens} tokens, "
          f"{max_tokens} new tokens per request, streamed; server --max-batch {max_batch} --queue {queue}")
    print(f"device: {device_name(device)}; {torch.get_num_threads()} threads")
    try:
        alone = Phase("one at a time", 1)
        asyncio.run(_run_phase(running.url, alone, sequential, body, time_limit))
        together = Phase("concurrent", clients)
        asyncio.run(_run_phase(running.url, together, requests, body, time_limit))
    finally:
        running.stop()
    print(f"{'mode':<14} {'clients':>7} {'requests':>8} {'ok':>5} {'429':>5} {'errors':>6} {'tokens':>7} "
          f"{'seconds':>8} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p95':>9} {'lat p50':>9} {'lat p95':>9}")
    print(_row(alone))
    print(_row(together))
    print(watch.stop().report())
    lines = _summary(alone, together, clients * requests, max_batch, queue)
    print("\n".join(lines))
    return lines


def _summary(alone: Phase, together: Phase, sent: int, max_batch: int, queue: int) -> list[str]:
    lost = sent - len(together.outcomes)
    lines = [f"not sent (time limit): {lost}" if lost else "every request was sent",
             f"errors (not 429): {together.errors + alone.errors}"]
    if together.refused:
        accepted = len(together.outcomes) - together.refused
        lines.append(f"{together.refused} of {len(together.outcomes)} requests refused with 429 (Retry-After): "
                     f"they came while the batch ({max_batch} rows) and the queue ({queue}) were full; {accepted} "
                     f"accepted, {len(together.ok)} completed")
    ratio = together.tokens_per_s / alone.tokens_per_s if alone.tokens_per_s else float("nan")
    p95 = percentile([o.latency for o in together.ok], 95)
    lines.append(f"{together.clients} concurrent clients: {together.tokens_per_s:.1f} tokens/s, {ratio:.1f}x one "
                 f"client's {alone.tokens_per_s:.1f}; p95 latency {p95:.2f} s; "
                 f"{len(together.ok)} of {len(together.outcomes)} requests completed")
    return lines
