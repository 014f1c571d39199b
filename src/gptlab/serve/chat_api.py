"""The OpenAI chat completions API as data: a POST /v1/chat/completions body checked into a `CompletionRequest`
(its prompt: the conversation rendered by the run's chat template, ending with the assistant's marker), and the
chat shapes of the answer: a `chat.completion` object, or `chat.completion.chunk` events (a role delta, content
deltas, a last delta with the finish reason). Generation itself is the completions' (scheduler.py); no HTTP here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from gptlab.chat import check_messages
from gptlab.errors import GptlabError
from gptlab.serve.api import (ApiError, CompletionRequest, Limits, _flag, _integer, _too_many, completion_id, envelope,
                              sample_settings, sse)
from gptlab.tokenizer import chat_of

# fields of OpenAI's chat API this server has no use for: refused where they would change the answer
UNSUPPORTED = {"tools": (None, []), "functions": (None, []), "logit_bias": (None, {}),
               "tool_choice": (None, "none"), "function_call": (None, "none")}
MAX_TOP_LOGPROBS = 20  # OpenAI's


def parse_chat(body: Any, limits: Limits) -> CompletionRequest:
    """Check a decoded JSON body field by field; ApiError (400, naming the field) for the first bad one. The
    messages themselves are checked with the template (`encode_chat`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    for name, defaults in UNSUPPORTED.items():
        if body.get(name) not in defaults:
            raise ApiError(400, f"{name} is not supported by this server", name)
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported by this server", "response_format")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    n = _integer(body, "n", 1, 1, limits.max_n)
    if n > limits.max_batch:  # it would never fit in the batch: refused, not queued for ever
        raise _too_many(1, n, limits.max_batch)
    max_tokens = _integer(body, "max_completion_tokens", None, 1, limits.max_tokens)
    if max_tokens is None:  # left out: as many as the server gives (the answer ends at the end of its turn)
        max_tokens = _integer(body, "max_tokens", limits.max_tokens, 1, limits.max_tokens)
    logprobs = _flag(body, "logprobs")
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and stream):
        raise ApiError(400, "stream_options must be an object, and only with stream: true", "stream_options")
    cfg = sample_settings(body, max_tokens)
    return CompletionRequest([], cfg, n, (top or 0) if logprobs else None, stream=stream, max_tokens=max_tokens,
                             messages=body.get("messages"), include_usage=_flag(options or {}, "include_usage"))


def encode_chat(request: CompletionRequest, tokenizer, context: int, limits: Limits) -> None:
    """Fill request.ids with the conversation's ids, as the run's chat template renders them for the next answer;
    ApiError 400 for a run without a template (how to make one), bad messages, or a conversation longer than the
    context (or --max-prompt-tokens)."""
    try:
        chat = chat_of(tokenizer)
    except GptlabError as exc:
        raise ApiError(400, str(exc), code="no_chat_template") from None
    try:
        ids = chat.render(check_messages(request.messages, "messages"), add_generation_prompt=True)[0]
    except GptlabError as exc:
        raise ApiError(400, str(exc), "messages") from None
    most = min(context, limits.max_prompt_tokens or context)
    if len(ids) > most:
        raise ApiError(400, f"the conversation is {len(ids)} tokens, longer than this server accepts ({most}: the "
                            f"model's context is {context} tokens); drop its oldest turns or shorten it", "messages",
                       "context_length_exceeded")
    request.ids.append(ids)
    request.prompts.append(chat.decode(ids))


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


async def chat_stream(job, model: str, ends: frozenset[int]) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chat chunk format: each choice's role delta, its content deltas (with their
    logprobs), a last empty delta with its finish reason; the usage where stream_options asked for it; then
    [DONE]. A client that leaves cancels the job."""
    cid, req = completion_id("chatcmpl-"), job.request
    try:
        for c in range(job.size):
            yield _chunk(cid, model, c, {"role": "assistant"})
        while True:
            event = await job.events.get()
            if event[0] == "token":
                _, c, text, token, info, reason = event
                entries = logprob_content(info, token, ends)
                if text or entries:
                    yield _chunk(cid, model, c, {"content": text}, entries if req.logprobs is not None else None)
                if reason is not None:
                    yield _chunk(cid, model, c, {}, None, reason)
            elif event[0] == "done":
                if req.include_usage:
                    yield sse({**envelope(cid, model), "object": "chat.completion.chunk", "choices": [],
                               "usage": event[1]})
                break
            else:
                yield sse({"error": {"message": event[1], "type": "server_error", "param": None, "code": None}})
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # finished, or the client left (the generator is closed): either way, free the rows


def chat_response(events: list[tuple], job, model: str, ends: frozenset[int]) -> dict[str, Any]:
    """The `chat.completion` object of a job's events (all of them, up to its "done")."""
    req = job.request
    texts, reasons = [""] * job.size, [None] * job.size
    content: list[list[dict]] = [[] for _ in range(job.size)]
    usage = None
    for event in events:
        if event[0] == "token":
            _, c, text, token, info, reason = event
            texts[c] += text
            content[c] += logprob_content(info, token, ends)
            reasons[c] = reason or reasons[c]
        elif event[0] == "done":
            usage = event[1]
    choices = [{"index": c, "message": {"role": "assistant", "content": texts[c]},
                "logprobs": {"content": content[c]} if req.logprobs is not None else None,
                "finish_reason": reasons[c]} for c in range(job.size)]
    return {**envelope(completion_id("chatcmpl-"), model), "object": "chat.completion", "choices": choices,
            "usage": usage}
