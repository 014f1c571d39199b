"""Output a program can rely on, through the official `openai` client against a live server on 127.0.0.1:
response_format (a Pydantic model parsed by the client, json_object), logit_bias on both routes (checked against
the unbiased logits), a tool-calling round trip (call, tool result, answer) under each tool_choice, streaming with
usage under a schema, system_fingerprint; bad schemas and tools are 400s naming the field; `gptlab sample` and
`gptlab chat`'s --json-schema / --regex / --grammar."""

import json
import re
from typing import Literal

import jsonschema
import pytest
import torch
from helpers import run_bad, trained_like
from pydantic import BaseModel, Field

from gptlab.inference.loading import prepare_for_inference
from gptlab.serve.api import Limits
from gptlab.serve.app import Served, make_app
from gptlab.serve.server import start_server
from gptlab.tokenizer import CharTokenizer, ChatTokenizer

openai = pytest.importorskip("openai", reason="no openai client (pip install -e '.[test]')")
PRINTABLE = [chr(c) for c in range(32, 127)] + ["\n"]
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10},
                                                "unit": {"enum": ["C", "F"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]


@pytest.fixture(scope="module")
def served():
    tokenizer = ChatTokenizer(CharTokenizer(PRINTABLE))
    torch.manual_seed(0)
    model = trained_like(dict(n_layer=2, n_head=2, n_embd=32, vocab_size=tokenizer.vocab_size, block_size=1024,
                              dropout=0.0))
    served = Served("json-run", prepare_for_inference(model, "fp32"), tokenizer, model.num_params(), lambda: model)
    running = start_server(make_app(served, Limits(max_tokens=200, max_batch=8)))
    yield running, tokenizer, model
    running.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


def bad_request(call):
    with pytest.raises(openai.BadRequestError) as got:
        call()
    return got.value.body


def test_a_pydantic_response_format_is_parsed_by_the_client(client):
    for seed in range(3):
        got = client.chat.completions.parse(model="json-run", messages=USER, response_format=Person, seed=seed,
                                            temperature=1.0)
        choice = got.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice.message.content
        assert got.system_fingerprint.startswith("fp_")


def test_json_object_and_a_schema_on_the_completions_route_and_streamed_with_usage(client, served):
    quote = str(served[1].encode('"')[0])
    stopped = 0
    for seed in range(4):  # json_object bounds nothing: a quote made likelier (logit_bias) ends strings sooner
        got = client.chat.completions.create(model="json-run", messages=USER, response_format={"type": "json_object"},
                                             temperature=1.0, max_tokens=200, seed=seed, logit_bias={quote: 4})
        if got.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(got.choices[0].message.content), dict)
            stopped += 1
    assert stopped >= 2
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
              "maxItems": 4}
    text = client.completions.create(model="json-run", prompt="numbers: ", max_tokens=60, temperature=0.7, seed=1,
                                     extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                         "name": "n", "schema": schema}}})
    jsonschema.validate(json.loads(text.choices[0].text), schema)
    chunks = list(client.chat.completions.create(
        model="json-run", messages=USER, stream=True, stream_options={"include_usage": True}, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(streamed), schema)
    assert chunks[-1].usage.completion_tokens == len(streamed)  # a char model: one token a character


def test_logit_bias_bans_and_forces_on_both_routes_against_the_unbiased_logits(client, served):
    free = client.completions.create(model="json-run", prompt="abc", max_tokens=1, temperature=0, logprobs=2)
    best, second = list(free.choices[0].logprobs.top_logprobs[0])  # the two likeliest, unbiased
    ids = {c: served[1].encode(c)[0] for c in PRINTABLE}
    banned = client.completions.create(model="json-run", prompt="abc", max_tokens=1, temperature=0,
                                       logit_bias={str(ids[best]): -100})
    assert banned.choices[0].text == second
    forced = client.chat.completions.create(model="json-run", messages=USER, max_tokens=5, temperature=1.0,
                                            logit_bias={str(ids["Q"]): 100})
    assert forced.choices[0].message.content == "QQQQQ"
    for bad, words in (({"x": 1}, "keys must be token ids"), ({"5": 101}, "in [-100, 100]"),
                       ({"99999": 1}, "outside the vocabulary")):
        error = bad_request(lambda: client.completions.create(model="json-run", prompt="a", logit_bias=bad))
        assert error["param"] == "logit_bias" and words in error["message"], error


def test_a_tool_call_round_trip_under_each_tool_choice(client):
    """required: a call of one of the tools, its arguments valid for that tool's parameters, finish_reason
    tool_calls; a named function: that one; then the tool's result goes back and tool_choice none answers in text."""
    tools = [WEATHER, TIME]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for seed in range(3):
        got = client.chat.completions.create(model="json-run", messages=USER, tools=tools, tool_choice="required",
                                             seed=seed, temperature=1.0)
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = client.chat.completions.create(model="json-run", messages=USER, tools=tools, temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    follow = USER + [named.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    final = client.chat.completions.create(model="json-run", messages=follow, tools=tools, tool_choice="none",
                                           max_tokens=10, temperature=1.0)
    assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)
    streamed = list(client.chat.completions.create(model="json-run", messages=USER, tools=tools, stream=True,
                                                   tool_choice="required", temperature=0))
    deltas = [c.choices[0].delta for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and streamed[-1].choices[0].finish_reason == "tool_calls"
    (call,) = deltas[0].tool_calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name in schemas


def test_a_streamed_tool_call_is_raw_chunks_of_one_id_a_role_then_the_calls_alone_then_the_reason(served):
    """The events as they go on the wire, two choices: each choice's role delta, one delta holding only its
    tool_calls (no role, no null content), an empty delta with finish_reason tool_calls; every chunk with the
    stream's one chatcmpl- id, the model's name and its choice's index."""
    import httpx

    body = {"model": "json-run", "messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required", "n": 2,
            "seed": 1, "temperature": 1.0, "stream": True}
    reply = httpx.post(served[0].url + "/v1/chat/completions", json=body, timeout=60)
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {(c["model"], c["object"]) for c in chunks} == {("json-run", "chat.completion.chunk")}
    for index in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant"} and mine[-1]["delta"] == {}
        assert [m["finish_reason"] for m in mine] == [None, None, "tool_calls"]
        (call,) = mine[1]["delta"].pop("tool_calls")
        assert mine[1]["delta"] == {} and call["index"] == 0 and call["type"] == "function"
        assert call["function"]["name"] in ("get_weather", "get_time") and json.loads(call["function"]["arguments"])
    assert len(chunks) == 6


def test_bad_response_formats_and_tools_are_400_naming_the_field(client):
    cases = [(dict(response_format={"type": "xml"}), "response_format"),
             (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
              "response_format"),
             (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
             (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
             (dict(tools=[WEATHER], response_format={"type": "json_object"}), "response_format")]
    for extra, param in cases:
        error = bad_request(lambda: client.chat.completions.create(model="json-run", messages=USER, **extra))
        assert error["param"] == param, (extra, error)


def test_a_schema_the_vocabulary_cannot_write_is_400_naming_the_characters(tmp_path):
    tokenizer = ChatTokenizer(CharTokenizer("abc :"))
    model = trained_like(dict(n_layer=1, n_head=2, n_embd=16, vocab_size=tokenizer.vocab_size, block_size=64,
                              dropout=0.0))
    served = Served("letters", prepare_for_inference(model, "fp32"), tokenizer, model.num_params(), lambda: model)
    running = start_server(make_app(served, Limits()))
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        error = bad_request(lambda: client.chat.completions.create(
            model="letters", messages=[{"role": "user", "content": "a"}], response_format={"type": "json_object"}))
        assert error["param"] == "response_format" and '"{", "}"' in error["message"], error
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
        with pytest.raises(openai.InternalServerError) as failed:  # writable at first, a dead end after "ab"
            client.completions.create(model="letters", prompt="a", max_tokens=8, temperature=0,
                                      extra_body={"response_format": {"type": "regex", "regex": "ab(é|è)"}})
        assert "the constraint allows no token this model has next" in str(failed.value)
        after = client.completions.create(model="letters", prompt="a", max_tokens=3, temperature=0)
        assert after.choices[0].finish_reason == "length"  # the server goes on serving
        for choice in ("required", "auto", "none"):  # the tools' system message cannot be written: refused
            error = bad_request(lambda: client.chat.completions.create(
                model="letters", messages=[{"role": "user", "content": "a"}], tools=[tool], tool_choice=choice))
            assert error["param"] == "tools" and "cannot write tools" in error["message"], error
    finally:
        running.stop()


def test_sample_and_chat_take_a_schema_a_regex_and_a_grammar(tmp_path, capsys):
    from helpers import chat_run, run_ok

    run = chat_run(tmp_path, chars="".join(PRINTABLE))
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "yz"]}}, "required": ["a"],
                                  "additionalProperties": False}))
    out = run_ok(capsys, "sample", "--run", str(run), "--prompt", "q", "--no-echo", "--json-schema", str(schema),
                 "--max-new-tokens", "40", "--seed", "1")
    assert json.loads(out.strip()) in ({"a": "x"}, {"a": "yz"})
    out = run_ok(capsys, "sample", "--run", str(run), "--prompt", "q", "--no-echo", "--regex", "[0-9]{3}-[a-c]",
                 "--max-new-tokens", "40")
    assert len(out.strip()) == 5 and out.strip()[3] == "-"
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "yes" | "no"\n')
    out = run_ok(capsys, "sample", "--run", str(run), "--prompt", "q", "--no-echo", "--grammar", str(grammar))
    assert out.strip() in ("yes", "no")
    schema.write_text("{oops")
    assert "the JSON schema is not JSON" in run_bad(capsys, "sample", "--run", str(run), "--json-schema", str(schema))
    assert "cannot read" in run_bad(capsys, "sample", "--run", str(run), "--grammar", str(tmp_path / "none.lark"))
    assert "not allowed with argument" in run_bad(capsys, "sample", "--run", str(run), "--regex", "a", "--grammar",
                                                  str(grammar))


def test_chat_answers_obey_the_constraint(tmp_path, capsys):
    """`gptlab chat --regex`: each answer of the conversation matches (the Chat the verb runs, fed two turns)."""
    from gptlab.checkpoint import load_run
    from gptlab.cli.chat_verbs import Chat
    from gptlab.config import SampleConfig
    from gptlab.inference.grammar import compile_grammar
    from gptlab.inference.rows import Steer
    from helpers import chat_run

    loaded = load_run(chat_run(tmp_path, chars="".join(PRINTABLE)))
    steer = Steer(grammar=compile_grammar("regex", "(yes|no), [0-9]{2}", loaded.tokenizer))
    chat = Chat(loaded.model.eval(), loaded.tokenizer, SampleConfig(max_new_tokens=20, temperature=1.0, seed=3), 64,
                steer=steer)
    for line in ("hi", "again"):
        chat.turn(line)
    answers = [m["content"] for m in chat.turns if m["role"] == "assistant"]
    assert len(answers) == 2 and all(re.fullmatch("(yes|no), [0-9]{2}", a) for a in answers), answers
    capsys.readouterr()


def test_regex_and_grammar_extensions_and_the_fields_edges(client):
    """vLLM's response_format extensions on the completions route; tools on the completions route, a tool message
    whose content is not text, an assistant message with text and a call, and arguments that are not JSON."""

    got = client.completions.create(model="json-run", prompt="code: ", max_tokens=20, temperature=1.0, seed=2,
                                    extra_body={"response_format": {"type": "regex", "regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", got.choices[0].text) and got.choices[0].finish_reason == "stop"
    got = client.completions.create(model="json-run", prompt="ok? ", max_tokens=20, temperature=1.0, seed=2,
                                    extra_body={"response_format": {"type": "grammar",
                                                                    "grammar": 'start: "yes" | "no"'}})
    assert got.choices[0].text in ("yes", "no")
    error = bad_request(lambda: client.completions.create(model="json-run", prompt="a",
                                                          extra_body={"tools": [WEATHER]}))
    assert error["param"] == "tools" and "chat completions field" in error["message"]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Oslo", "unit": "C"}'}}
    history = USER + [{"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "5 C"}]}]
    final = client.chat.completions.create(model="json-run", messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=5, temperature=1.0)
    assert final.choices[0].message.tool_calls is None
    broken = {**call, "function": {"name": "get_weather", "arguments": "{not json"}}
    error = bad_request(lambda: client.chat.completions.create(
        model="json-run", messages=USER + [{"role": "assistant", "content": None, "tool_calls": [broken]}],
        tools=[WEATHER]))
    assert error["param"] == "messages" and "not JSON" in error["message"]


def test_a_text_answer_under_auto_streams_as_content(client, served):
    """tool_choice auto on an untrained model: whichever it writes, the stream says it once complete (a call as one
    tool_calls delta, a text as one content delta), with the finish reason that goes with it."""
    for seed in range(4):
        chunks = list(client.chat.completions.create(model="json-run", messages=USER, tools=[WEATHER], stream=True,
                                                     temperature=1.0, seed=seed, max_tokens=40))
        deltas = [c.choices[0].delta for c in chunks if c.choices and (c.choices[0].delta.content or
                                                                        c.choices[0].delta.tool_calls)]
        reason = chunks[-1].choices[0].finish_reason
        assert len(deltas) == 1
        if deltas[0].tool_calls:
            assert reason == "tool_calls"
        else:
            assert reason in ("stop", "length") and not deltas[0].content.startswith("<")


def test_the_structured_fields_are_checked_at_their_edges():
    """parse_structure / compile_structure without a server: logit_bias at -100 and 100 and past them, keys that
    are not ids; function names of 64 characters and 65, a trailing newline; tool_choice's shapes; none compiles no
    grammar; the bias's ids against the vocabulary (the last id and one past it)."""
    from gptlab.serve.api import ApiError
    from gptlab.serve.structured import compile_structure, parse_structure

    def refused(body, chat=True):
        with pytest.raises(ApiError) as got:
            parse_structure(body, chat)
        return got.value.param

    assert parse_structure({"logit_bias": {"5": -100, "7": 100}}, False).logit_bias == {5: -100.0, 7: 100.0}
    assert parse_structure({"logit_bias": {}}, False).logit_bias is None
    for bad in ({"5": 100.5}, {"5": -101}, {"5": True}, {"-1": 3}, {"x": 1}, {"5": "1"}, [1]):
        assert refused({"logit_bias": bad}, chat=False) == "logit_bias"
    tool = {"type": "function", "function": {"name": "a" * 64}}
    assert parse_structure({"tools": [tool]}, True).source[1] == "auto"
    for name in ("a" * 65, "f\n", "", "sp ace", 3):
        assert refused({"tools": [{"type": "function", "function": {"name": name}}]}) == "tools"
    assert refused({"tools": [tool], "tool_choice": {"type": "function", "function": "a"}}) == "tool_choice"
    assert refused({"tools": [tool], "tool_choice": "sometimes"}) == "tool_choice"
    assert refused({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}) == "tools"
    assert refused({"tools": [{"type": "code", "function": {"name": "f"}}]}) == "tools"
    assert parse_structure({"tools": [], "tool_choice": "auto"}, True).kind is None
    assert parse_structure({"tool_choice": "none"}, True).kind is None  # "none" needs no tools, "required" does
    assert refused({"tool_choice": "required"}) == "tool_choice"
    assert refused({"tools": [tool], "tool_choice": {"function": {"name": "a" * 64}}}) == "tool_choice"  # no type
    chars = ChatTokenizer(CharTokenizer(PRINTABLE))
    none = parse_structure({"tools": [tool], "tool_choice": "none"}, True)
    compile_structure(none, chars)
    assert none.calls_tools and none.grammar is None and none.steer() is None
    last = parse_structure({"logit_bias": {str(chars.vocab_size - 1): 1}}, False)
    compile_structure(last, chars)
    assert last.steer().logit_bias == {chars.vocab_size - 1: 1.0}
    with pytest.raises(ApiError, match="outside the vocabulary"):
        compile_structure(parse_structure({"logit_bias": {str(chars.vocab_size): 1}}, False), chars)


def test_tool_calls_and_results_are_written_in_the_conversation_as_the_guide_says():
    """tool_messages, worked out by hand: the tools' system message first, an assistant's calls after its text, a
    tool's result as a user message; arguments left out are {}; a malformed call is a 400 naming messages."""
    from gptlab.serve.api import ApiError
    from gptlab.serve.structured import TOOLS_HEADER, parse_calls, tool_messages

    functions = [{"name": "f", "description": "", "parameters": {"type": "object"}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"id": "c2", "type": "function", "function": {"name": "g"}}]
    got = tool_messages([{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "Sure.", "tool_calls": calls},
                         {"role": "tool", "tool_call_id": "c1", "content": "42"},
                         {"role": "tool", "tool_call_id": "c2", "content": {"ok": True}}], functions)
    assert got == [
        {"role": "system", "content": TOOLS_HEADER + '[{"name":"f","description":"","parameters":{"type":"object"}}]'},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": 'Sure.<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>'
                                         '<tool_call>{"name":"g","arguments":{}}</tool_call>'},
        {"role": "user", "content": "<tool_response>42</tool_response>"},
        {"role": "user", "content": '<tool_response>{"ok": true}</tool_response>'}]
    assert tool_messages([{"role": "user", "content": "hi"}], None) == [{"role": "user", "content": "hi"}]
    assert tool_messages("not a list", functions) == "not a list"  # left for the template's own check
    for bad in ({"function": "f"}, {"function": {"arguments": "{}"}}, "call", {"function": {"name": 3}}):
        with pytest.raises(ApiError) as refused:
            tool_messages([{"role": "assistant", "content": None, "tool_calls": [bad]}], functions)
        assert refused.value.param == "messages" and refused.value.status == 400
        assert refused.value.message.startswith("an assistant message's tool_calls must be")
    (call,) = parse_calls('<tool_call>{"name":"f","arguments":{"x":[1,2]}}</tool_call>')
    assert call["type"] == "function" and call["function"] == {"name": "f", "arguments": '{"x": [1, 2]}'}
    assert parse_calls("plain text") is None and parse_calls("<tool_call>{oops</tool_call>") is None
    assert parse_calls('<tool_call>{"name":"f","arguments":{}}') is None  # not closed: not a call
    assert parse_calls('<toolXcall>{"name":"f","arguments":{}}</tool_call>') is None  # not opened either
    assert re.fullmatch("call_[0-9a-f]{24}", call["id"])  # OpenAI's ids: call_ and 24 characters


def test_refusals_are_400s_quoting_what_was_refused_and_every_tool_may_be_called():
    """Each refusal of the structured fields is a 400 whose message quotes the refused value; a call of any of the
    tools (not only the first) is a sentence of the tools' grammar, a named one's only of its own; a function with
    no parameters takes an object; a description reaches the conversation; a schema llguidance refuses in a tool's
    parameters names tools."""
    from gptlab.inference.grammar import compile_grammar
    from gptlab.serve.api import ApiError
    from gptlab.serve.structured import compile_structure, parse_structure, tool_grammar, tool_messages

    def refused(body, chat=True):
        with pytest.raises(ApiError) as got:
            parse_structure(body, chat)
        assert got.value.status == 400 and isinstance(got.value.message, str), got.value.message
        return got.value.message

    tool = {"type": "function", "function": {"name": "f"}}
    assert '"sometimes"' in refused({"tools": [tool], "tool_choice": "sometimes"})
    assert '"nope"' in refused({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    g = {"type": "function", "function": {"name": "g"}}
    assert "none of the request's tools (f, g)" in refused({"tools": [tool, g], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}})
    assert '"bad name"' in refused({"tools": [{"type": "function", "function": {"name": "bad name"}}]})
    assert "tool f" in refused({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]})
    assert "tools must be a list" in refused({"tools": [{"type": "code"}]})
    assert '"required"' in refused({"tool_choice": "required"})
    chars = ChatTokenizer(CharTokenizer(PRINTABLE))
    with pytest.raises(ApiError) as got:
        compile_structure(parse_structure({"logit_bias": {str(chars.vocab_size): 1}}, False), chars)
    assert got.value.message == (f"logit_bias token id {chars.vocab_size} is outside the vocabulary (0 to "
                                 f"{chars.vocab_size - 1})")
    bogus = parse_structure({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "bogus"}}}], "tool_choice": "required"}, True)
    with pytest.raises(ApiError) as got:
        compile_structure(bogus, chars)
    assert got.value.param == "tools" and "not valid" in got.value.message
    functions = [{"name": "one", "description": "the first", "parameters": {"type": "object"}},
                 {"name": "two", "description": "", "parameters": {"type": "object", "properties": {}}}]
    assert '"description":"the first"' in tool_messages([], functions)[0]["content"]
    for choice, accepted in (("required", {"one", "two"}), ({"type": "function", "function": {"name": "two"}},
                                                             {"two"})):
        grammar = compile_grammar("lark", tool_grammar(functions, choice), chars)
        for name in ("one", "two"):
            matcher = grammar.start().matcher
            ids = chars.encode(f'<tool_call>{{"name":"{name}","arguments":{{}}}}</tool_call>')
            assert (matcher.validate_tokens(ids) == len(ids)) is (name in accepted), (choice, name)
    bare = parse_structure({"tools": [{"type": "function", "function": {"name": "f"}}]}, True).source[0][0]
    assert bare["parameters"] == {"type": "object", "properties": {}} and bare["description"] == ""


def test_response_format_and_logit_bias_shapes_at_their_edges():
    """{"type": "text"} is the default (no grammar); a response_format that is not an object, a json_schema without
    its schema, an extension without its text; a logit_bias that is not an object: each a 400 naming the field and
    quoting what it got; a description given reaches the function."""
    from gptlab.serve.api import ApiError
    from gptlab.serve.structured import parse_structure

    assert parse_structure({"response_format": {"type": "text"}}, True).kind is None
    assert parse_structure({"response_format": None}, True).kind is None
    for bad in ("json", {"type": "json_schema"}, {"type": "json_schema", "json_schema": "s"},
                {"type": "json_schema", "json_schema": {"name": "n"}}, {"type": "regex"},
                {"type": "grammar", "grammar": 3},
                {"type": "text", "extra": 1}, {"kind": "text"}):
        with pytest.raises(ApiError) as got:
            parse_structure({"response_format": bad}, True)
        assert (got.value.status, got.value.param) == (400, "response_format") and got.value.message, bad
    with pytest.raises(ApiError) as got:
        parse_structure({"logit_bias": [["5", 1]]}, False)
    assert (got.value.status, got.value.param) == (400, "logit_bias")
    for bias, quoted in (({"x1": 1}, '"x1"'), ({"5": "big"}, '"big"')):
        with pytest.raises(ApiError) as got:
            parse_structure({"logit_bias": bias}, False)
        assert quoted in got.value.message and got.value.status == 400
    described = {"type": "function", "function": {"name": "f", "description": "does f"}}
    assert parse_structure({"tools": [described]}, True).source[0][0]["description"] == "does f"
