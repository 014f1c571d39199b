"""`gptlab bench serve`: concurrent clients against a `gptlab serve` it starts on loopback, beside the same kind of
requests sent one at a time. Each client streams its requests (server-sent events) and times the first token and
the whole request; the table gives tokens/s, p50 / p95 time to first token and latency, 429s and errors. With more
clients than `--max-batch` + `--queue`, the excess get 429 at once and every accepted request still completes.

`--scenario shared-prefix`: two servers in this process on the same model, one with the exact prefix cache
(gptlab.inference.prefix_cache) and one without (`prefix_cache_mb` 0), sent the same prompts: a long shared prefix
(a system prompt) followed by a suffix of each request's own. After one warm-up request each (the prefix with
another suffix), requests one at a time alternate between the two (time to first token, and the prompt tokens the
cache served, from the usage's `prompt_tokens_details.cached_tokens`), then concurrent clients, each request its
own suffix, against each server in turn (aggregate tokens/s)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gptlab.bench.timing import LoadWatch
from gptlab.config import PREFIX_CACHE_MB, ModelConfig, build, get_preset
from gptlab.errors import GptlabError
from gptlab.inference.loading import bf16_storage_possible
from gptlab.inference.prefix_cache import PROMPT_CHUNK
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
    cached: int = 0  # prompt tokens the server's prefix cache served (usage.prompt_tokens_details.cached_tokens)


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
                    out.cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except Exception as exc:  # a lost connection is a failed request, counted, never a crash of the bench
        out.error = f"{type(exc).__name__}: {exc}"
    out.latency = time.perf_counter() - start
    if out.status == 200 and not out.tokens and not out.error:
        out.error = "no usage in the stream"
    return out


async def _run_phase(url: str, phase: Phase, requests_each: int, body: dict | Callable[[int, int], dict],
                     time_limit: float) -> None:
    """`phase.clients` clients, each sending `requests_each` requests one after another (none started after
    `time_limit` seconds): `body`, with seed 1000 * client + request, or `body(client, request)`."""
    import httpx

    make = body if callable(body) else (lambda c, r: {**body, "seed": 1000 * c + r})

    limits = httpx.Limits(max_connections=phase.clients + 4, max_keepalive_connections=phase.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=max(time_limit, 60.0) * 2, limits=limits) as http:
        deadline = time.perf_counter() + time_limit

        async def client(c: int) -> None:
            for r in range(requests_each):
                if time.perf_counter() > deadline:
                    return
                phase.outcomes.append(await _one_request(http, make(c, r)))

        start = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(phase.clients)))
        phase.seconds = time.perf_counter() - start


def served_model(model: str | None, run: str | None, precision: str):
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
    served = served_model(model, run, resolve_precision(precision, device, bf16_storage_possible(device)))
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


# ---- --scenario shared-prefix ------------------------------------------------------------------------------------

def shared_prompts(vocab: int, prefix_tokens: int, suffix_tokens: int) -> Callable[[str], list[int]]:
    """Prompts as token ids: one prefix (drawn once) followed by a suffix drawn from `key` (a request's own)."""
    prefix = random.Random("shared prefix").choices(range(vocab), k=prefix_tokens)
    return lambda key: prefix + random.Random(f"suffix {key}").choices(range(vocab), k=suffix_tokens)


@dataclass
class Side:
    """One server of the shared-prefix scenario: with the prefix cache ("on") or without ("off"), its app (the
    scheduler's idle flag, the cache's stats), where it runs, its requests one at a time and its concurrent ones."""

    cache: str
    app: object
    url: str
    alone: Phase
    together: Phase

    def wait_idle(self) -> None:
        """Until its scheduler has nothing left to do: the other server never runs beside it."""
        self.app.state.scheduler.idle.wait(120)

    def blocks(self) -> int:
        cache = self.app.state.scheduler.batch.prefix_cache
        return cache.stats().blocks if cache is not None else 0


async def _alternating(sides: list[Side], prompt: Callable[[str], list[int]], body: dict, rounds: int,
                       time_limit: float) -> None:
    """One warm-up request to each side (untimed: the prefix with a suffix of its own), then `rounds` rounds of one
    request to each side, the same prompt to both, the side that goes first alternating, one request at a time."""
    import httpx

    async with contextlib.AsyncExitStack() as stack:
        http = [await stack.enter_async_context(httpx.AsyncClient(base_url=side.url, timeout=max(time_limit, 60.0) * 2))
                for side in sides]
        for side, client in zip(sides, http):
            warm = await _one_request(client, {**body, "prompt": prompt("warm-up"), "seed": 0})
            if warm.error or warm.status != 200:
                raise GptlabError(f"the warm-up request failed ({warm.status}): {warm.error}")
            await asyncio.to_thread(side.wait_idle)
        blocks = sides[0].blocks()
        print(f"warm-up: one request to each server (the prefix, another suffix); the cache then held {blocks} "
              f"block{'' if blocks == 1 else 's'} of {PROMPT_CHUNK} tokens")
        deadline = time.perf_counter() + time_limit
        for i in range(rounds):
            if time.perf_counter() > deadline:
                return
            for side, client in (zip(sides, http) if i % 2 == 0 else reversed(list(zip(sides, http)))):
                out = await _one_request(client, {**body, "prompt": prompt(f"alone {i}"), "seed": i})
                side.alone.outcomes.append(out)
                side.alone.seconds += out.latency
                await asyncio.to_thread(side.wait_idle)


def run_shared_prefix_bench(*, model: str | None = "gpt2-124M", run: str | None = None, clients: int = 8,
                            requests: int = 2, sequential: int = 4, max_tokens: int = 64, prefix_tokens: int = 768,
                            suffix_tokens: int = 64, max_batch: int = 16, queue: int = 64, precision: str = "auto",
                            time_limit: float = 60.0, prefix_cache_mb: float = PREFIX_CACHE_MB) -> list[str]:
    """Two servers on 127.0.0.1 on the same model, with the prefix cache (`prefix_cache_mb`) and without; prompts of
    `prefix_tokens` shared tokens + `suffix_tokens` of each request's own, `max_tokens` new tokens each. One warm-up
    request to each; `sequential` rounds of one request to each (alternating which goes first); then `clients`
    concurrent clients with `requests` each against each server in turn. Prints the table, the machine's load and
    the summary lines and returns those lines (the last: the concurrent clients')."""
    set_threads()
    watch = LoadWatch()
    device = torch.device("cpu")
    served = served_model(model, run, resolve_precision(precision, device, bf16_storage_possible(device)))
    context = served.model.model.config.block_size
    if prefix_tokens + suffix_tokens > context:
        raise GptlabError(f"--prefix-tokens + --suffix-tokens ({prefix_tokens} + {suffix_tokens}) must fit the "
                          f"model's context of {context} tokens")
    prompt = shared_prompts(served.tokenizer.vocab_size, prefix_tokens, suffix_tokens)
    body = {"max_tokens": max_tokens, "temperature": 1.0, "stream": True}
    sides, running = [], []
    for cache, mb in (("on", prefix_cache_mb), ("off", 0)):
        app = make_app(served, Limits(max_tokens=max_tokens, max_batch=max_batch, queue=queue, grace=1.0,
                                      prefix_cache_mb=mb))
        running.append(start_server(app))
        sides.append(Side(cache, app, running[-1].url, Phase("one at a time", 1), Phase("concurrent", clients)))
    fused = "fused native step" if served.model.fused else "torch ops"
    print(f"gptlab bench serve --scenario shared-prefix: {served.name} ({served.parameters / 1e6:.0f}M parameters, "
          f"{served.model.precision or 'fp32'}, decoded by {fused}); prompts: a {prefix_tokens}-token shared prefix + "
          f"a {suffix_tokens}-token suffix of each request's own, {max_tokens} new tokens per request, streamed; two "
          f"servers, --prefix-cache-mb {prefix_cache_mb:g} and 0 (off), each --max-batch {max_batch} --queue {queue}")
    print(f"device: {device_name(device)}; {torch.get_num_threads()} threads")
    try:
        asyncio.run(_alternating(sides, prompt, body, sequential, time_limit))
        for side in sides:
            asyncio.run(_run_phase(side.url, side.together, requests, lambda c, r: {
                **body, "prompt": prompt(f"client {c} request {r}"), "seed": 1000 * c + r}, time_limit))
            side.wait_idle()
    finally:
        for server in running:
            server.stop()
    _print_prefix_table(sides)
    print(watch.stop().report())
    lines = _prefix_summary(sides, prefix_tokens, suffix_tokens, clients * requests)
    print("\n".join(lines))
    return lines


def _print_prefix_table(sides: list[Side]) -> None:
    print(f"{'mode':<14} {'cache':<5} {'clients':>7} {'requests':>8} {'ok':>5} {'429':>5} {'errors':>6} "
          f"{'tokens':>7} {'cached p50':>10} {'seconds':>8} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'lat p50':>9}")
    for side in sides:
        for phase in (side.alone, side.together):
            ok = phase.ok
            ttft = [o.ttft for o in ok]
            print(f"{phase.name:<14} {side.cache:<5} {phase.clients:>7} {len(phase.outcomes):>8} {len(ok):>5} "
                  f"{phase.refused:>5} {phase.errors:>6} {sum(o.tokens for o in ok):>7} "
                  f"{percentile([o.cached for o in ok], 50):>10} {phase.seconds:>8.1f} {phase.tokens_per_s:>9.1f} "
                  f"{percentile(ttft, 50):>9.3f} {percentile(ttft, 95):>9.3f} "
                  f"{percentile([o.latency for o in ok], 50):>9.2f}")


def _prefix_summary(sides: list[Side], prefix_tokens: int, suffix_tokens: int, sent: int) -> list[str]:
    on, off = sides
    errors = sum(p.errors for s in sides for p in (s.alone, s.together))
    refused = sum(s.together.refused for s in sides)
    lost = sum(sent - len(s.together.outcomes) for s in sides)
    lines = [f"not sent (time limit): {lost}" if lost else "every request was sent",
             f"errors (not 429): {errors}; 429s: {refused}"]
    ttft = {s.cache: percentile([o.ttft for o in s.alone.ok], 50) for s in sides}
    cached = percentile([o.cached for o in on.alone.ok], 50)
    lines.append(f"time to first token, one request at a time (median of {len(on.alone.ok)} and "
                 f"{len(off.alone.ok)}): {ttft['on']:.3f} s with the prefix cache, {ttft['off']:.3f} s without: "
                 f"{_ratio(ttft['off'], ttft['on'])} faster; {cached} of {prefix_tokens + suffix_tokens} prompt "
                 "tokens served from the cache (median)")
    lines.append(f"{on.together.clients} concurrent clients sharing the {prefix_tokens}-token prefix: "
                 f"{on.together.tokens_per_s:.1f} tokens/s with the prefix cache, {off.together.tokens_per_s:.1f} "
                 f"without: {_ratio(on.together.tokens_per_s, off.together.tokens_per_s)}")
    return lines


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"
