"""Every answer of the completions and chat completions routes, shaped from a job's events (gptlab.serve.scheduler:
`PromptLogprobs`, `Token`, then `Done` or `Failed`): OpenAI's `text_completion` and `chat.completion` objects,
their server-sent chunks (a chat's: a role delta, content deltas, a last delta with the finish reason), the usage
(with `prompt_tokens_details.cached_tokens`), the logprobs of each, and the 499 / 500 of a job that does not end
well. Requests are checked in api.py; the routes are app.py's."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gptlab import __version__
from gptlab.serve.scheduler import Done, Event, Failed, Job, PromptLogprobs, Token
from gptlab.serve.structured import parse_calls


def completion_id(prefix: str = "cmpl-") -> str:
    return prefix + secrets.token_hex(12)


def envelope(cid: str, model: str) -> dict[str, Any]:
    """The fields every completion response and chunk starts with (system_fingerprint: this gptlab's version and
    the served model's name; it changes when either does)."""
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint(model)}


def fingerprint(model: str) -> str:
    return "fp_" + hashlib.sha256(f"gptlab {__version__} {model}".encode()).hexdigest()[:12]


def sse(data: dict) -> str:
    """One server-sent event holding `data` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(done: Done) -> dict[str, Any]:
    """OpenAI's usage object: each prompt counted once however many choices, and of its tokens those whose keys
    and values the prefix cache served (0 where none were)."""
    out = {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
           "total_tokens": done.prompt_tokens + done.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}
    if done.prediction is not None:  # a predicted output's tokens proposed and kept, proposed and refused
        out["completion_tokens_details"] = {"accepted_prediction_tokens": done.prediction[0],
                                            "rejected_prediction_tokens": done.prediction[1]}
    return out


def _failure(failed: Failed) -> dict[str, Any]:
    return {"error": {"message": failed.message, "type": "server_error", "param": None, "code": None}}


async def gather(job: Job, request: Request) -> list[Event] | Response:
    """Every event of the job up to its `Done` (the last); instead, a 499 response where the client left before
    the end (the job is cancelled), a 500 where generation failed."""
    events: list[Event] = []
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                event = None
            if loop.time() - checked >= 0.25:  # tokens may flow without a pause: look at the clock, not for a lull
                checked = loop.time()
                if await request.is_disconnected():
                    return Response(status_code=499)
            if event is None:
                continue
            if isinstance(event, Failed):
                return JSONResponse(_failure(event), 500)
            events.append(event)
            if isinstance(event, Done):
                return events
    finally:
        job.cancelled.set()


async def answer(job: Job, request: Request, shape: Callable[[list[Event]], dict[str, Any]]) -> Response:
    """The whole answer as one JSON response: `shape` of the job's events (`completion_response`,
    `chat_response`); a client that leaves before the end cancels the job."""
    events = await gather(job, request)
    if isinstance(events, Response):
        return events
    return JSONResponse(shape(events))


# ---- completions -------------------------------------------------------------------------------------------------

def _logprobs_entry(info: dict | None, offset: int) -> dict | None:
    if info is None:
        return None
    return {"tokens": [info["token"]], "token_logprobs": [info["logprob"]], "top_logprobs": [info["top"]],
            "text_offset": [offset]}


def _choice(index: int, text: str, logprobs: dict | None, reason: str | None) -> dict:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": reason}


async def completion_stream(job: Job, model: str) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, a last chunk with the usage, then [DONE]. A client that leaves
    cancels the job (its rows leave the batch at the next step)."""
    cid, req = completion_id(), job.request
    offsets = [0] * job.size
    try:
        if req.echo and req.logprobs is None:  # with logprobs, the echo waits for the prompt's logprobs
            for c in range(len(offsets)):
                text = req.prompts[c // req.n]
                offsets[c] = len(text)
                yield sse({**envelope(cid, model), "choices": [_choice(c, text, None, None)]})
        while True:
            event = await job.events.get()
            if isinstance(event, PromptLogprobs):
                p = event.prompt
                for c in range(p * req.n, (p + 1) * req.n):
                    offsets[c] = len(req.prompts[p])
                    yield sse({**envelope(cid, model), "choices": [_choice(c, req.prompts[p], event.entries, None)]})
            elif isinstance(event, Token):
                c = event.choice
                yield sse({**envelope(cid, model), "choices": [
                    _choice(c, event.text, _logprobs_entry(event.logprobs, offsets[c]), event.finish_reason)]})
                offsets[c] += len(event.text)
            elif isinstance(event, Done):
                yield sse({**envelope(cid, model), "choices": [], "usage": usage(event)})
                break
            else:
                yield sse(_failure(event))
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # finished, or the client left (the generator is closed): either way, free the rows


def completion_response(events: list[Event], job: Job, model: str) -> dict[str, Any]:
    """The `text_completion` object of a job's events (all of them, up to its `Done`): each choice's text (after
    its own prompt with echo), finish reason and logprobs (the prompt's first with echo)."""
    req = job.request
    size = job.size
    texts = [req.prompts[c // req.n] if req.echo else "" for c in range(size)]
    reasons: list[str | None] = [None] * size
    logprobs = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for _ in range(size)]
    for event in events:
        if isinstance(event, PromptLogprobs):
            for c in range(event.prompt * req.n, (event.prompt + 1) * req.n):
                for key, value in event.entries.items():
                    logprobs[c][key] += value
        elif isinstance(event, Token):
            c = event.choice
            if event.logprobs is not None:
                for key, value in _logprobs_entry(event.logprobs, len(texts[c])).items():
                    logprobs[c][key] += value
            texts[c] += event.text
            reasons[c] = event.finish_reason or reasons[c]
    choices = [_choice(c, texts[c], logprobs[c] if req.logprobs is not None else None, reasons[c])
               for c in range(size)]
    return {**envelope(completion_id(), model), "choices": choices, "usage": usage(events[-1])}


# ---- chat completions --------------------------------------------------------------------------------------------

def logprob_content(info: dict | None, token: int, ends: frozenset[int]) -> list[dict]:
    """The chat logprobs entries of one generated token: [] where none were asked for, or for the token that ends
    the turn (it is no part of the answer's content)."""
    if info is None or token in ends:
        return []
    return [{"token": info["token"], "logprob": info["logprob"], "bytes": info["bytes"],
             "top_logprobs": info["ranked"]}]


def _chunk(cid: str, model: str, index: int, delta: dict, logprobs: list[dict] | None = None,
           reason: str | None = None) -> str:
    choice = {"index": index, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs},
              "finish_reason": reason}
    return sse({**envelope(cid, model), "object": "chat.completion.chunk", "choices": [choice]})


async def chat_stream(job: Job, model: str, ends: frozenset[int]) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chat chunk format: each choice's role delta, its content deltas (with their
    logprobs), a last empty delta with its finish reason; the usage where stream_options asked for it; then
    [DONE]. A client that leaves cancels the job."""
    cid, req = completion_id("chatcmpl-"), job.request
    calling, held = may_call(job), [""] * job.size
    try:
        for c in range(job.size):
            yield _chunk(cid, model, c, {"role": "assistant"})
        while True:
            event = await job.events.get()
            if isinstance(event, Token) and calling:  # held back until the answer shows whether it is a call
                held[event.choice] += event.text
                if event.finish_reason is not None:
                    message = _message(held[event.choice], event.finish_reason, job)
                    delta = {k: v for k, v in message["message"].items() if k != "role" and v is not None}
                    for i, call in enumerate(delta.get("tool_calls", [])):
                        call["index"] = i
                    yield _chunk(cid, model, event.choice, delta)
                    yield _chunk(cid, model, event.choice, {}, None, message["finish_reason"])
            elif isinstance(event, Token):
                c, text, token, info = event.choice, event.text, event.id, event.logprobs
                entries = logprob_content(info, token, ends)
                if text or entries:
                    yield _chunk(cid, model, c, {"content": text}, entries if req.logprobs is not None else None)
                if event.finish_reason is not None:
                    yield _chunk(cid, model, c, {}, None, event.finish_reason)
            elif isinstance(event, Done):
                if req.include_usage:
                    yield sse({**envelope(cid, model), "object": "chat.completion.chunk", "choices": [],
                               "usage": usage(event)})
                break
            elif isinstance(event, Failed):
                yield sse(_failure(event))
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # finished, or the client left (the generator is closed): either way, free the rows


def may_call(job: Job) -> bool:
    """Whether the job's answers may be tool calls (tools given, tool_choice not "none")."""
    structure = job.request.structure
    return structure is not None and structure.calls_tools and structure.source[1] != "none"


def _message(text: str, reason: str | None, job: Job) -> dict[str, Any]:
    """A choice's message and finish reason: a tool call's (`tool_calls`, no content, "tool_calls") where the
    answer is one, else the text's."""
    calls = parse_calls(text) if may_call(job) and reason == "stop" else None
    if calls is not None:
        return {"message": {"role": "assistant", "content": None, "tool_calls": calls}, "finish_reason": "tool_calls"}
    return {"message": {"role": "assistant", "content": text}, "finish_reason": reason}


def chat_response(events: list[Event], job: Job, model: str, ends: frozenset[int]) -> dict[str, Any]:
    """The `chat.completion` object of a job's events (all of them, up to its `Done`, the last)."""
    req = job.request
    texts, reasons = [""] * job.size, [None] * job.size
    content: list[list[dict]] = [[] for _ in range(job.size)]
    for event in events:
        if isinstance(event, Token):
            c, text, token, info = event.choice, event.text, event.id, event.logprobs
            texts[c] += text
            content[c] += logprob_content(info, token, ends)
            reasons[c] = event.finish_reason or reasons[c]
    choices = [{"index": c, **_message(texts[c], reasons[c], job),
                "logprobs": {"content": content[c]} if req.logprobs is not None else None} for c in range(job.size)]
    return {**envelope(completion_id("chatcmpl-"), model), "object": "chat.completion", "choices": choices,
            "usage": usage(events[-1])}
