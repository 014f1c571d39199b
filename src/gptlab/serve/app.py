"""The HTTP side: a FastAPI app over one Scheduler. Routes: POST /v1/completions and POST /v1/chat/completions
(JSON or server-sent events), GET /v1/models, /health, /metrics (Prometheus text), / (the playground page) and
/inspect (the attention page of a text). Errors are OpenAI's shape; no request field ever names a file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException

from gptlab.errors import GptlabError
from gptlab.inference.prefix_cache import PrefixCache
from gptlab.inference.prepared import InferenceModel
from gptlab.serve.api import (
    ApiError,
    CompletionRequest,
    Limits,
    check_model,
    encode_chat,
    encode_prompts,
    parse_chat,
    parse_completion,
)
from gptlab.serve.responses import answer, chat_response, chat_stream, completion_response, completion_stream
from gptlab.serve.scheduler import Job, Scheduler
from gptlab.serve.structured import check_tools_writable, compile_structure, parse_structure, tool_messages
from gptlab.tokenizer import CHAT_TEMPLATE, EOT, ChatTokenizer, Tokenizer


@dataclass
class Served:
    """What a server serves: a name, the InferenceModel, its tokenizer, the parameter count, and how to get a plain
    fp32 copy of the model for /inspect (loaded on first use)."""

    name: str
    model: InferenceModel
    tokenizer: Tokenizer
    parameters: int
    plain_model: Callable[[], torch.nn.Module]


def make_app(served: Served, limits: Limits, api_key: str | None = None) -> FastAPI:
    """The app, with its scheduler started with the app and stopped (within limits.grace) with it: completions,
    the pages and every refusal (a route's, no such route 404, a wrong method 405, a bug 500) in OpenAI's error
    shape; every route but /health and / asks for `api_key` when one is set."""
    scheduler = Scheduler(served.model, served.tokenizer, limits.max_batch, limits.queue,
                          PrefixCache.of_mb(limits.prefix_cache_mb))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop, limits.grace)

    app = FastAPI(title="gptlab", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler

    @app.exception_handler(ApiError)
    async def refuse(request: Request, exc: ApiError) -> JSONResponse:
        """Every route's refusal, in OpenAI's error shape (completions counts its own in the metrics first)."""
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def refuse_route(request: Request, exc: HTTPException) -> JSONResponse:
        return await refuse(request, _route_error(request, exc))

    @app.exception_handler(Exception)
    async def fail(request: Request, exc: Exception) -> JSONResponse:
        """A bug: a 500 in OpenAI's shape (the server's log has the traceback: Starlette raises it on)."""
        return await refuse(request, ApiError(500, f"the server failed on this request ({type(exc).__name__}); "
                                                   "its log has the traceback", type="server_error"))

    check_key = _key_check(api_key)
    _add_completions(app, served, limits, scheduler, check_key)
    _add_chat(app, served, limits, scheduler, check_key)
    _add_pages(app, served, limits, scheduler, check_key)
    _add_tokenizer_routes(app, served, limits, check_key)
    return app


def _route_error(request: Request, exc: HTTPException) -> ApiError:
    """Starlette's router's refusals (the only HTTPExceptions here) as ApiErrors: a method the route does not take
    (405, with its Allow header), no such route (404, in OpenAI's words)."""
    method, path = request.method, request.url.path
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        return ApiError(405, f"{method} is not allowed on {path}; use {allow}", headers={"Allow": allow})
    return ApiError(exc.status_code, f"Invalid URL ({method} {path}): this server has no such route")


def _key_check(api_key: str | None) -> Callable[[Request], None]:
    """What a route calls first: ApiError 401 unless the request carries `api_key` (nothing when it is None)."""
    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
    return check_key


def _add_completions(app: FastAPI, served: Served, limits: Limits, scheduler: Scheduler,
                     check_key: Callable[[Request], None]) -> None:
    """POST /v1/completions: the request checked and queued (429 when the queue is full, 503 while shutting
    down), answered as JSON or as server-sent events; every answer counted in the metrics by its status."""
    context = served.model.config.block_size

    def prepare(body: Any) -> CompletionRequest:
        check_model(body, served.name, limits)
        req = parse_completion(body, limits)
        req.structure = parse_structure(body, chat=False)
        encode_prompts(req, served.tokenizer, context, limits)
        compile_structure(req.structure, served.tokenizer)
        return req

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        job = await _take(request, limits, scheduler, check_key, prepare)
        if job.request.stream:
            return _event_stream(completion_stream(job, served.name))
        return await answer(job, request, lambda events: completion_response(events, job, served.name))


def _add_chat(app: FastAPI, served: Served, limits: Limits, scheduler: Scheduler,
              check_key: Callable[[Request], None]) -> None:
    """POST /v1/chat/completions: the conversation rendered by the run's chat template, then queued, decoded and
    counted as a completion is; answered in the chat API's shapes."""
    context = served.model.config.block_size
    ends = served.tokenizer.end_ids

    def prepare(body: Any) -> CompletionRequest:
        check_model(body, served.name, limits)
        req = parse_chat(body, limits)
        req.structure = structure = parse_structure(body, chat=True)
        if structure.calls_tools:
            req.messages = tool_messages(req.messages, structure.source[0])
            check_tools_writable(req.messages, served.tokenizer)
        encode_chat(req, served.tokenizer, context, limits)
        compile_structure(structure, served.tokenizer)
        return req

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        job = await _take(request, limits, scheduler, check_key, prepare)
        if job.request.stream:
            return _event_stream(chat_stream(job, served.name, ends))
        return await answer(job, request, lambda events: chat_response(events, job, served.name, ends))


async def _take(request: Request, limits: Limits, scheduler: Scheduler, check_key: Callable[[Request], None],
                prepare: Callable[[Any], CompletionRequest]) -> Job:
    """The request's key and body checked, `prepare`d into a CompletionRequest and queued as a Job (429 when the
    queue is full, 503 while shutting down); every answer counted in the metrics by its status."""
    try:
        check_key(request)
        req = prepare(await _read_json(request, limits.max_body_bytes))
        job = Job(req, asyncio.get_running_loop(), asyncio.Queue())
        if not scheduler.submit(job):
            if scheduler.closing:
                raise ApiError(503, "the server is shutting down", type="server_error")
            raise ApiError(429, f"the queue is full ({limits.queue} requests waiting); retry shortly",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    except ApiError as exc:
        scheduler.metrics.count(exc.status)
        raise
    scheduler.metrics.count(200)
    return job


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _add_pages(app: FastAPI, served: Served, limits: Limits, scheduler: Scheduler,
               check_key: Callable[[Request], None]) -> None:
    """GET /v1/models, /health, /metrics (Prometheus text), / (the playground page) and POST /inspect (the
    attention page of a text)."""
    context = served.model.config.block_size
    inspector = _Inspector(served)
    page = resources.files("gptlab.serve").joinpath("playground.html").read_text(encoding="utf-8")
    playground_page = page.replace("__MODEL__", json.dumps(served.name).replace("</", "<\\/")).replace(
        "__CHAT__", json.dumps(isinstance(served.tokenizer, ChatTokenizer)))  # the Chat tab: runs with a template

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_key(request)
        return JSONResponse({"object": "list", "data": [{
            "id": served.name, "object": "model", "created": 0, "owned_by": "gptlab", "context_length": context,
            "tokenizer": served.tokenizer.kind, "parameters": served.parameters}]})

    @app.get("/health")
    async def health() -> Response:
        if scheduler.closing:
            return JSONResponse({"status": "shutting down"}, 503)
        return JSONResponse({"status": "ok", "model": served.name})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        check_key(request)
        return PlainTextResponse(generate_latest(scheduler.registry), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def playground() -> Response:
        return HTMLResponse(playground_page)

    @app.post("/inspect")
    async def inspect(request: Request) -> Response:
        check_key(request)
        body = await _read_json(request, limits.max_body_bytes)
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str) or not text:
            raise ApiError(400, "text must be a non-empty string", "text")
        return HTMLResponse(await asyncio.to_thread(inspector.page, text))


def _add_tokenizer_routes(app: FastAPI, served: Served, limits: Limits,
                          check_key: Callable[[Request], None]) -> None:
    """POST /tokenize, POST /detokenize and GET /tokenizer_info in the shapes lm-evaluation-harness's remote
    tokenizer reads (vLLM's), under the same API key as the other routes."""
    context = served.model.config.block_size

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        check_key(request)
        body = await _read_json(request, limits.max_body_bytes)
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise ApiError(400, "prompt must be a string", "prompt")
        try:  # the end-of-text string is the end-of-text token, as Hugging Face's tokenizers read it
            ids = served.tokenizer.encode(text, allow_special=True)
        except GptlabError as exc:
            raise ApiError(400, str(exc), "prompt") from None
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": context})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        check_key(request)
        body = await _read_json(request, limits.max_body_bytes)
        ids = body.get("tokens") if isinstance(body, dict) else None
        vocab = served.tokenizer.vocab_size
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
                                                for i in ids):
            raise ApiError(400, f"tokens must be a list of token ids (0 to {vocab - 1})", "tokens")
        return JSONResponse({"prompt": served.tokenizer.decode(ids)})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        check_key(request)
        eos = EOT if served.tokenizer.eot_id is not None else None  # always the key: null without one
        chat = isinstance(served.tokenizer, ChatTokenizer)  # its template and markers, so that clients render alike
        return JSONResponse({"tokenizer_class": served.tokenizer.kind, "eos_token": eos, "bos_token": eos,
                             "pad_token": None, "model_max_length": context, "vocab_size": served.tokenizer.vocab_size,
                             "chat_template": CHAT_TEMPLATE if chat else None,
                             "chat_tokens": dict(served.tokenizer.special_ids) if chat else {}})


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON; ApiError 413 past `limit` bytes (read no further), 400 when it is not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {declared} bytes, more than this server accepts ({limit}, "
                            "--max-body-bytes)", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body is more than this server accepts ({limit} bytes, --max-body-bytes)",
                           code="body_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the body is not valid JSON") from None
    except RecursionError:  # the decoder recurses once per level of arrays and objects
        raise ApiError(400, "the body's JSON is nested too deeply; a request needs a few levels at most") from None


class _Inspector:
    """The attention page of a text, from a plain copy of the model loaded on first use (the served one is packed
    for decoding); one page at a time."""

    def __init__(self, served: Served):
        self.served, self._model, self._lock = served, None, threading.Lock()

    def page(self, text: str) -> str:
        from gptlab.errors import GptlabError
        from gptlab.inspect.page import attention_page
        from gptlab.inspect.trace import token_labels, trace

        tokenizer = self.served.tokenizer
        with self._lock:
            if self._model is None:
                self._model = self.served.plain_model()
            try:
                ids = tokenizer.encode(text)[-self._model.config.block_size:]
                tr = trace(self._model, ids)
                return attention_page(tr, token_labels(tokenizer, ids), text[-200:])
            except GptlabError as exc:
                raise ApiError(400, str(exc), "text") from None
