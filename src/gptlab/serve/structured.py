"""Output a program can rely on, as OpenAI's API asks for it: `response_format` (`json_object`, `json_schema`),
`logit_bias`, and `tools` / `tool_choice` with `tool_calls` in the answer. Each request field is checked here into
what its rows obey (gptlab.inference.rows.Steer: the bias and a grammar compiled by gptlab.inference.grammar); a
bad one is a 400 naming it, before any generation.

How the chat template writes tools (a model fine-tuned on conversations learns these, nothing else is special):
the tools are a system message `TOOLS_HEADER` + their functions as JSON; an assistant's tool call is its content
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a tool's result is a user message
`<tool_response>...</tool_response>`. A call is constrained by a grammar that allows only the tools' names and
arguments valid for the named tool's parameters; with tool_choice `auto`, an answer that starts with `<` is a
call (a text answer may not start with it), `required` and a named function always call, `none` never does.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from gptlab.errors import GptlabError
from gptlab.inference.grammar import JSON_OPTIONS, Grammar, compile_grammar
from gptlab.inference.rows import Steer
from gptlab.serve.api import ApiError, _json

TOOLS_HEADER = "You may call these tools. To call one, answer <tool_call>{\"name\": NAME, \"arguments\": {...}}" \
               "</tool_call>.\n"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
BIAS_LIMIT = 100.0  # OpenAI's: a bias in [-100, 100]
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names


@dataclass
class Structure:
    """What a request's output must obey, checked but not yet compiled (compiling needs the tokenizer)."""

    logit_bias: dict[int, float] | None = None
    kind: str | None = None  # a grammar.GRAMMAR_KINDS kind, or "tools"
    source: Any = None  # its schema, pattern or grammar; for tools, (functions, tool_choice)
    grammar: Grammar | None = None  # filled by `compile_structure`

    @property
    def calls_tools(self) -> bool:
        return self.kind == "tools"

    def steer(self) -> Steer | None:
        if self.logit_bias is None and self.grammar is None:
            return None
        return Steer(self.logit_bias, self.grammar)


def parse_structure(body: dict, chat: bool) -> Structure:
    """A request's logit_bias, response_format and (chat) tools / tool_choice; ApiError 400 naming the first bad
    one."""
    out = Structure(logit_bias=_logit_bias(body.get("logit_bias")))
    out.kind, out.source = _response_format(body.get("response_format"))
    if chat:
        tools = _tools(body.get("tools"), body.get("tool_choice"))
        if tools is not None:
            if out.kind is not None:
                raise ApiError(400, "tools and a response_format other than text cannot be asked for together",
                               "response_format")
            out.kind, out.source = "tools", tools
    elif body.get("tools") is not None:
        raise ApiError(400, "tools are a chat completions field (POST /v1/chat/completions)", "tools")
    return out


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "logit_bias must be an object of token id -> bias in [-100, 100]", "logit_bias")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ApiError(400, f"logit_bias keys must be token ids (\"50256\"), not {_json(key)}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
            raise ApiError(400, f"logit_bias[{key}] must be a number in [-100, 100], not {_json(bias)}", "logit_bias")
        out[int(key)] = float(bias)
    return out


def _response_format(value: Any) -> tuple[str | None, Any]:
    if value is None or value == {"type": "text"}:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return "json_object", None
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, 'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                           "response_format")
        return "json_schema", schema
    if kind in ("regex", "grammar") and isinstance(value.get(kind), str):  # extensions (vLLM's names)
        return "regex" if kind == "regex" else "lark", value[kind]
    raise ApiError(400, 'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                        '"json_schema", "json_schema": {...}} (or the extensions "regex" and "grammar")',
                   "response_format")


def _tools(tools: Any, choice: Any) -> tuple[list[dict], Any] | None:
    """The functions (name, description, parameters) and tool_choice ("auto" where left out); None where the request
    has no tools."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, f"tool_choice {_json(choice)} needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" and
                                               isinstance(t.get("function"), dict) for t in tools):
        raise ApiError(400, 'tools must be a list of {"type": "function", "function": {"name": ..., "parameters": '
                            '{...}}}', "tools")
    functions = [_function(t["function"]) for t in tools]
    names = [f["name"] for f in functions]
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise ApiError(400, f"tool_choice names {_json(name)}, which is none of the request's tools "
                                f"({', '.join(names)})", "tool_choice")
    elif choice not in ("auto", "none", "required"):
        raise ApiError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                            f'{{"name": ...}}}}, not {_json(choice)}', "tool_choice")
    return functions, choice


def _function(spec: dict) -> dict:
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ApiError(400, f"a tool's function name must be 1 to 64 letters, digits, _ or -, not {_json(name)}",
                       "tools")
    parameters = spec.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ApiError(400, f"the parameters of tool {name} must be a JSON schema object", "tools")
    return {"name": name, "description": spec.get("description", ""), "parameters": parameters}


# ---- compiling for the served tokenizer --------------------------------------------------------------------------

def compile_structure(structure: Structure, tokenizer: Any) -> None:
    """Check the bias's ids against the vocabulary and compile the grammar (ApiError 400 naming what is wrong)."""
    if structure.logit_bias:
        outside = [i for i in structure.logit_bias if i >= tokenizer.vocab_size]
        if outside:
            raise ApiError(400, f"logit_bias token id {outside[0]} is outside the vocabulary (0 to "
                                f"{tokenizer.vocab_size - 1})", "logit_bias")
    if structure.kind is None:
        return
    param = "tools" if structure.calls_tools else "response_format"
    try:
        if structure.calls_tools:
            functions, choice = structure.source
            if choice != "none":
                structure.grammar = compile_grammar("lark", tool_grammar(functions, choice), tokenizer)
        else:
            structure.grammar = compile_grammar(structure.kind, structure.source, tokenizer)
    except GptlabError as exc:
        raise ApiError(400, str(exc), param) from None


def tool_grammar(functions: list[dict], choice: Any) -> str:
    """The Lark grammar of an answer under tool_choice `choice`: a call of one of `functions` (a named one only,
    where choice names it), or, with "auto", a text answer that does not start with "<"."""
    if isinstance(choice, dict):
        functions = [f for f in functions if f["name"] == choice["function"]["name"]]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS}  # compact JSON
    rules = [f"call: {json.dumps(CALL_OPEN)} call_body {json.dumps(CALL_CLOSE)}",
             f"call_body: %json {json.dumps(schema)}"]
    if choice == "auto":
        return "\n".join(["start: call | text", r"text: /[^<][\s\S]*/ | """, *rules])
    return "\n".join(["start: call", *rules])


# ---- the conversation and the answer -----------------------------------------------------------------------------

def tool_messages(messages: Any, functions: list[dict] | None) -> Any:
    """OpenAI's messages with tool calls and results written as the chat template writes them (above), the tools'
    system message first where the request has tools; anything else is left for the template's checks."""
    if not isinstance(messages, list):
        return messages
    out = [{"role": "system", "content": TOOLS_HEADER + json.dumps(functions, separators=(",", ":"))}] \
        if functions else []
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "tool":
            content = message.get("content")
            content = content if isinstance(content, str) else json.dumps(content)
            message = {"role": "user", "content": RESULT_OPEN + content + RESULT_CLOSE}
        elif isinstance(message, dict) and message.get("role") == "assistant" and message.get("tool_calls"):
            message = {"role": "assistant", "content": (message.get("content") or "") +
                       "".join(_written_call(c) for c in message["tool_calls"])}
        out.append(message)
    return out


def check_tools_writable(messages: list[dict], tokenizer: Any) -> None:
    """ApiError 400 naming tools where the run's vocabulary cannot write the tools' system message (a char model
    that never saw braces): its chat template has no way to write them."""
    try:
        tokenizer.encode(messages[0]["content"])
    except GptlabError as exc:
        raise ApiError(400, f"this run cannot write tools in its chat template: {exc}", "tools") from None


def _written_call(call: Any) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, "an assistant message's tool_calls must be {\"type\": \"function\", \"function\": "
                            "{\"name\": ..., \"arguments\": JSON text}}", "messages")
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        raise ApiError(400, f"the arguments of the tool call {function['name']} are not JSON", "messages") from None
    return CALL_OPEN + json.dumps({"name": function["name"], "arguments": arguments}, separators=(",", ":")) + CALL_CLOSE


def parse_calls(text: str) -> list[dict] | None:
    """The tool calls an answer's text makes (OpenAI's tool_calls entries), None where it makes none."""
    if not text.startswith(CALL_OPEN) or not text.endswith(CALL_CLOSE):
        return None
    try:
        call = json.loads(text[len(CALL_OPEN):-len(CALL_CLOSE)])
    except json.JSONDecodeError:
        return None
    return [{"id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]
