"""The OpenAI completions and chat completions requests as data: a request body checked field by field into a
`CompletionRequest` (a chat's prompt: the conversation rendered by the run's chat template, ending with the
assistant's marker), errors in OpenAI's shape, the limits a server enforces. Generation itself is scheduler.py's,
the answers' shapes responses.py's; no HTTP here (app.py)."""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from gptlab.chat import check_messages
from gptlab.config import PREFIX_CACHE_MB, SEED_LIMIT, SPECULATE, SampleConfig
from gptlab.errors import GptlabError
from gptlab.tokenizer import ROLES, chat_of


@dataclass
class Limits:
    """What one server accepts; each has a `gptlab serve` flag. Defaults: 512 new tokens a request, n <= 8,
    prompts up to the model's context (max_prompt_tokens 0), 1 MiB bodies, 16 rows decoded together, 64 requests
    waiting for a place, 10 s for in-flight requests to finish on SIGTERM, only the served model's name, a prefix
    cache of PREFIX_CACHE_MB."""

    max_tokens: int = 512
    max_n: int = 8
    max_prompt_tokens: int = 0  # 0: the model's context (block_size)
    max_body_bytes: int = 1 << 20
    max_batch: int = 16
    queue: int = 64
    grace: float = 10.0
    accept_any_model: bool = False  # any "model" is answered by the served one (clients that hard-code a name)
    prefix_cache_mb: float = PREFIX_CACHE_MB  # the exact prefix cache's budget (0: off)
    speculate: str = "off"  # every request's SampleConfig.speculate

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_n", "max_body_bytes", "max_batch", "queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GptlabError(f"--{name.replace('_', '-')} must be a positive integer, not {value!r}")
        if self.max_prompt_tokens < 0:
            raise GptlabError(f"--max-prompt-tokens must be >= 0 (0: the context), not {self.max_prompt_tokens}")
        if not (math.isfinite(self.prefix_cache_mb) and self.prefix_cache_mb >= 0):
            raise GptlabError(f"--prefix-cache-mb must be >= 0 (0 turns the cache off), not {self.prefix_cache_mb}")
        if self.speculate not in SPECULATE:
            raise GptlabError(f"--speculate must be one of {', '.join(SPECULATE)}, not {self.speculate!r}")
        if not (math.isfinite(self.grace) and self.grace >= 0):
            raise GptlabError(f"--grace must be a number of seconds >= 0, not {self.grace}")


class ApiError(Exception):
    """A refused request: HTTP `status`, and the OpenAI error object's message, type, param and code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class CompletionRequest:
    """A checked POST /v1/completions body: the prompts' texts, and the sampling settings every row shares
    (`cfg.seed` is sample 0's; sample i draws with seed + i)."""

    prompts: list[str]  # prompts sent as token ids: their text, filled by `encode_prompts` (echo shows it)
    cfg: SampleConfig
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    ids: list[list[int]] = field(default_factory=list)  # the encoded prompts, filled by `encode_prompts`
    prompt_ids: list[list[int]] | None = None  # the prompts as sent, where they were token ids
    max_tokens: int = 16  # 0: nothing generated (with echo and logprobs: the prompt's logprobs alone)
    messages: list[dict[str, str]] | None = None  # a chat completion's conversation (chat_api.encode_chat)
    include_usage: bool = True  # a stream ends with a usage chunk (chat: only with stream_options.include_usage)
    prediction: str | None = None  # OpenAI's predicted output: the text the answer is expected to be
    prediction_ids: list[int] | None = None  # its ids, filled by `encode_prompts` / `encode_chat`
    structure: Any = None  # its logit_bias, response_format and tools (serve.structured.Structure)


UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, "")}


def _json(value: Any) -> str:
    """A value of a request as JSON spells it (true, null, "text"), cut to 40 characters: what refusals quote."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:39] + "…"


def check_model(body: Any, served: str, limits: Limits) -> None:
    """A request's "model": left out, null or `served` (the name /v1/models lists), any string with
    limits.accept_any_model; ApiError 400 for one that is not a string, 404 model_not_found (OpenAI's words) for
    another name."""
    model = body.get("model") if isinstance(body, dict) else None
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(400, f"model must be a string, not {_json(model)}", "model")
    if model != served and not limits.accept_any_model:
        raise ApiError(404, f"The model `{model}` does not exist or you do not have access to it.", "model",
                       "model_not_found")


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise ApiError(400, f"{name} must be a number in [{lo}, {hi}], not {_json(value)}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ApiError(400, f"{name} must be an integer in [{lo}, {hi}], not {_json(value)}", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, not {_json(value)}", name)
    return value


def _strings(body: dict, name: str, most: int, allow_empty: bool) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or len(items) > most or not all(isinstance(s, str) for s in items) \
            or (not allow_empty and not all(items)):
        kind = "a string" if allow_empty else "a non-empty string"
        raise ApiError(400, f"{name} must be {kind} or a list of 1 to {most} of them", name)
    return items


def _too_many(prompts: int, n: int, most: int) -> ApiError:
    """The 400 for prompts x n sequences past the batch (`most`), naming what to make smaller."""
    limit = f"more than this server decodes together ({most}, --max-batch)"
    if n == 1:
        return ApiError(400, f"{prompts} prompts are {limit}: send at most {most} prompts in one request", "prompt")
    if prompts == 1:
        return ApiError(400, f"n={n} sequences are {limit}: ask for n <= {most}", "n")
    return ApiError(400, f"{prompts} prompts x n={n} are {prompts * n} sequences, {limit}: send fewer prompts or "
                         "a smaller n", "prompt")


def parse_completion(body: Any, limits: Limits) -> CompletionRequest:
    """Check a decoded JSON body field by field; raises ApiError (400, naming the field) for the first bad one."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    for name, defaults in UNSUPPORTED.items():
        if body.get(name) not in defaults:
            raise ApiError(400, f"{name} is not supported by this server", name)
    if body.get("prompt") is None:  # absent or null: no sequence to decode (it would wait for nothing)
        raise ApiError(400, "prompt is required: a string or a list of strings", "prompt")
    prompt_ids = _token_prompts(body["prompt"], 64)
    prompts = [] if prompt_ids is not None else _strings(body, "prompt", 64, allow_empty=True)
    n = _integer(body, "n", 1, 1, limits.max_n)
    count = len(prompt_ids) if prompt_ids is not None else len(prompts)
    if count * n > limits.max_batch:  # it would never fit in the batch: refused, not queued for ever
        raise _too_many(count, n, limits.max_batch)
    # left out: OpenAI's default of 16, or the server's --max-tokens where that is lower (0: nothing decoded)
    max_tokens = _integer(body, "max_tokens", min(16, limits.max_tokens), 0, limits.max_tokens)
    cfg = sample_settings(body, max(1, max_tokens), limits.speculate)
    return CompletionRequest(prompts, cfg, n, _integer(body, "logprobs", None, 0, 5), _flag(body, "echo"),
                             _flag(body, "stream"), prompt_ids=prompt_ids, max_tokens=max_tokens,
                             prediction=_prediction(body))


def sample_settings(body: dict, max_new_tokens: int, speculate: str = "off") -> SampleConfig:
    """The sampling fields completions and chat completions share, checked (ApiError 400 naming the first bad one);
    a seed left out is drawn at random; `speculate` is the server's (--speculate)."""
    return SampleConfig(
        max_new_tokens=max_new_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=_integer(body, "top_k", None, 1, 1 << 31),  # an extension (the playground sends it)
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        seed=_integer(body, "seed", secrets.randbelow(SEED_LIMIT), 0, SEED_LIMIT - 1),
        stop=_strings(body, "stop", 4, allow_empty=False), speculate=speculate)


def _token_prompts(value: Any, most: int) -> list[list[int]] | None:
    """Prompts sent as token ids (a list of ids, or a list of 1 to `most` such lists); None where they are text;
    ApiError 400 for a mix of text and ids, or an empty list of ids."""
    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)

    if not isinstance(value, list) or not any(isinstance(v, (int, list)) for v in value):
        return None  # text, or nothing like ids (the text check names the problem)
    if any(v is None or (isinstance(v, list) and None in v) for v in value):  # what a harness sends for an
        raise ApiError(400, "prompt holds a null token id (an empty context's start token?): send a context, or "
                            "ids only", "prompt")  # empty context where the tokenizer has no end-of-text token
    if ids(value):
        return [value]
    if all(ids(v) for v in value) and len(value) <= most:
        return value
    raise ApiError(400, f"prompt must be a string, a list of strings, a list of token ids or a list of 1 to {most} "
                        "non-empty lists of token ids, not a mix", "prompt")


def _prediction(body: dict) -> str | None:
    """OpenAI's `prediction` ({"type": "content", "content": text or a list of {"type": "text", "text": ...}}) as
    its text; None where absent; ApiError 400 naming it where malformed."""
    value = body.get("prediction")
    if value is None:
        return None
    content = value.get("content") if isinstance(value, dict) and value.get("type") == "content" else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, 'prediction must be {"type": "content", "content": TEXT} (TEXT a string or a list of '
                            '{"type": "text", "text": ...} parts)', "prediction")
    return content


def _encode_prediction(request: CompletionRequest, tokenizer) -> None:
    if request.prediction is not None:
        try:
            request.prediction_ids = tokenizer.encode(request.prediction)
        except GptlabError as exc:
            raise ApiError(400, str(exc), "prediction") from None


def encode_prompts(request: CompletionRequest, tokenizer, context: int, limits: Limits) -> None:
    """Fill request.ids (and, for prompts sent as token ids, request.prompts with their text); ApiError 400 for text
    the tokenizer cannot encode, a token id outside the vocabulary, an empty prompt on a model with no start token,
    or a prompt longer than the context (or --max-prompt-tokens)."""
    most = min(context, limits.max_prompt_tokens or context)
    _encode_prediction(request, tokenizer)
    if request.prompt_ids is not None:
        for ids in request.prompt_ids:
            outside = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
            if outside:
                raise ApiError(400, f"token id {outside[0]} is outside the vocabulary (0 to {tokenizer.vocab_size - 1})",
                               "prompt")
            _check_length(ids, most, context)
            request.ids.append(list(ids))
            request.prompts.append(tokenizer.decode(ids))
        return
    for text in request.prompts:
        try:
            ids = tokenizer.encode(text) if text else ([tokenizer.eot_id] if tokenizer.eot_id is not None else [])
        except GptlabError as exc:
            raise ApiError(400, str(exc), "prompt") from None
        if not ids:
            raise ApiError(400, "the prompt is empty and this model has no start token", "prompt")
        _check_length(ids, most, context)
        request.ids.append(ids)


def _check_length(ids: list[int], most: int, context: int) -> None:
    if len(ids) > most:
        raise ApiError(400, f"the prompt is {len(ids)} tokens, longer than this server accepts ({most}: the "
                            f"model's context is {context} tokens)", "prompt", "context_length_exceeded")


# ---- chat completions --------------------------------------------------------------------------------------------

# fields of OpenAI's chat API this server has no use for: refused where they would change the answer
CHAT_UNSUPPORTED = {"functions": (None, []), "function_call": (None, "none")}  # (tools: structured.py)
MAX_TOP_LOGPROBS = 20  # OpenAI's


def parse_chat(body: Any, limits: Limits) -> CompletionRequest:
    """Check a decoded JSON body field by field; ApiError (400, naming the field) for the first bad one. The
    messages themselves are checked with the template (`encode_chat`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    for name, defaults in CHAT_UNSUPPORTED.items():
        if body.get(name) not in defaults:
            raise ApiError(400, f"{name} is not supported by this server", name)
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
    cfg = sample_settings(body, max_tokens, limits.speculate)
    return CompletionRequest([], cfg, n, (top or 0) if logprobs else None, stream=stream, max_tokens=max_tokens,
                             messages=body.get("messages"), include_usage=_flag(options or {}, "include_usage"),
                             prediction=_prediction(body))


def encode_chat(request: CompletionRequest, tokenizer, context: int, limits: Limits) -> None:
    """Fill request.ids with the conversation's ids, as the run's chat template renders them for the next answer;
    ApiError 400 for a run without a template (how to make one), bad messages, or a conversation longer than the
    context (or --max-prompt-tokens)."""
    try:
        chat = chat_of(tokenizer)
    except GptlabError as exc:
        raise ApiError(400, str(exc), code="no_chat_template") from None
    try:
        ids = chat.render(_messages(request.messages), add_generation_prompt=True)[0]
    except GptlabError as exc:
        raise ApiError(400, str(exc), "messages") from None
    most = min(context, limits.max_prompt_tokens or context)
    if len(ids) > most:
        raise ApiError(400, f"the conversation is {len(ids)} tokens, longer than this server accepts ({most}: the "
                            f"model's context is {context} tokens); drop its oldest turns or shorten it", "messages",
                       "context_length_exceeded")
    request.ids.append(ids)
    request.prompts.append(chat.decode(ids))
    _encode_prediction(request, tokenizer)


def _messages(messages: Any) -> list[dict[str, str]]:
    """The request's messages as chat.check_messages reads a conversation (GptlabError for bad ones), an unknown
    role quoted as JSON spells it."""
    for n, message in enumerate(messages if isinstance(messages, list) else [], 1):
        if not isinstance(message, dict):
            break  # check_messages names it
        if message.get("role") not in ROLES:
            raise GptlabError(f"the conversation: message {n} has the unknown role {_json(message.get('role'))}; "
                              "use system, user or assistant")
    return check_messages(messages, "the conversation")
