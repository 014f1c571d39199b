"""The completions API as data (gptlab.serve.api) and the HTTP side's pieces (gptlab.serve.app) in-process: every
request field read, defaulted and bounded as OpenAI documents it (bounds inclusive, just past them refused with a
400 naming the field), the server's limits, prompts encoded against the context, errors in OpenAI's shape; then
the app through FastAPI's TestClient and its JSON/SSE writers driven by events queued by hand. Expected values are
OpenAI's documented ranges and defaults, numbers worked out by hand, and the `openai` client's own parsing."""

import asyncio
import copy
import json
import math
import re
import time

import pytest
import torch
from fastapi.testclient import TestClient
from helpers import tiny_config

from gptlab.config import SEED_LIMIT
from gptlab.errors import GptlabError
from gptlab.inference.loading import prepare_for_inference
from gptlab.model import GPT
from gptlab.serve.api import ApiError, Limits, encode_prompts, parse_chat, parse_completion
from gptlab.serve.app import Served, _read_json, make_app
from gptlab.serve.responses import (answer, chat_response, chat_stream, completion_id, completion_response,
                                    completion_stream, envelope, gather, usage)
from gptlab.serve.scheduler import Done, Failed, Job, PromptLogprobs, Token
from gptlab.serve.structured import CALL_CLOSE, CALL_OPEN, parse_structure
from gptlab.tokenizer import CharTokenizer, GPT2Tokenizer


def wide():
    """Room for 65 prompts: the prompt list's own limit (64) answers, not the batch's. (No Limits is made at import:
    a mutant of Limits must fail a test, not the collection.)"""
    return Limits(max_batch=100)


def refused(body, limits=None):
    """The ApiError parse_completion raises for `body` (it must be a 400 with a message)."""
    with pytest.raises(ApiError) as info:
        parse_completion(body, limits or wide())
    assert info.value.status == 400 and info.value.message and str(info.value) == info.value.message
    return info.value


# --- Limits ---------------------------------------------------------------------------------------------------


def test_limits_accept_their_smallest_values():
    limits = Limits(max_tokens=1, max_n=1, max_prompt_tokens=0, max_body_bytes=1, max_batch=1, queue=1, grace=0)
    assert (limits.max_tokens, limits.max_batch, limits.grace) == (1, 1, 0)
    assert Limits(grace=0.5).grace == 0.5 and Limits(max_prompt_tokens=7).max_prompt_tokens == 7


@pytest.mark.parametrize("name, flag", [("max_tokens", "--max-tokens"), ("max_n", "--max-n"),
                                        ("max_body_bytes", "--max-body-bytes"), ("max_batch", "--max-batch"),
                                        ("queue", "--queue")])
@pytest.mark.parametrize("value", [0, -3, True, 2.0, "8"])
def test_a_limit_that_is_not_a_positive_integer_names_its_flag(name, flag, value):
    with pytest.raises(GptlabError, match=f"^{flag} must be a positive integer"):
        Limits(**{name: value})


@pytest.mark.parametrize("grace", [-0.5, math.inf, math.nan])
def test_grace_must_be_a_finite_number_of_seconds(grace):
    with pytest.raises(GptlabError, match="--grace"):
        Limits(grace=grace)


def test_max_prompt_tokens_may_be_0_but_not_negative():
    with pytest.raises(GptlabError, match="--max-prompt-tokens"):
        Limits(max_prompt_tokens=-1)


# --- ApiError, ids, envelopes ---------------------------------------------------------------------------------


def test_an_api_error_is_openais_error_object():
    error = ApiError(400, "n must be an integer", "n")
    assert (error.status, str(error), error.headers) == (400, "n must be an integer", {})
    assert error.body() == {"error": {"message": "n must be an integer", "type": "invalid_request_error",
                                      "param": "n", "code": None}}
    full = ApiError(429, "busy", type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    assert full.headers == {"Retry-After": "1"}
    assert full.body() == {"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                                     "code": "queue_full"}}


def test_completion_ids_are_cmpl_and_96_random_bits():
    ids = {completion_id() for _ in range(20)}
    assert len(ids) == 20 and all(re.fullmatch("cmpl-[0-9a-f]{24}", i) for i in ids)


def test_the_envelope_is_openais():
    before = int(time.time())
    got = envelope("cmpl-1", "run")
    assert got == {"id": "cmpl-1", "object": "text_completion", "created": got["created"], "model": "run",
                   "system_fingerprint": got["system_fingerprint"]}
    assert type(got["created"]) is int and before <= got["created"] <= time.time()
    # system_fingerprint: the same for the same backend, another for another model (or another gptlab version)
    assert re.fullmatch("fp_[0-9a-f]{12}", got["system_fingerprint"])
    assert envelope("cmpl-2", "run")["system_fingerprint"] == got["system_fingerprint"]
    assert envelope("cmpl-2", "other")["system_fingerprint"] != got["system_fingerprint"]


# --- parse_completion -----------------------------------------------------------------------------------------


def test_a_bare_prompt_gets_openais_defaults():
    req = parse_completion({"prompt": "hi"}, Limits())
    cfg = req.cfg
    assert (req.prompts, req.n, req.logprobs, req.echo, req.stream, req.ids) == (["hi"], 1, None, False, False, [])
    assert (cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k) == (16, 1.0, 1.0, None)
    assert (cfg.frequency_penalty, cfg.presence_penalty, cfg.stop) == (0.0, 0.0, [])
    assert 0 <= cfg.seed < 2**63


def test_an_unseeded_request_draws_a_fresh_seed():
    seeds = {parse_completion({"prompt": "hi"}, Limits()).cfg.seed for _ in range(5)}
    assert len(seeds) == 5  # 63 random bits each: a repeat would be a 1 in 2**60 event


def test_null_fields_mean_their_defaults():
    names = ["model", "n", "max_tokens", "temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty",
             "seed", "stop", "logprobs", "echo", "stream", "best_of", "suffix", "logit_bias"]
    req = parse_completion({"prompt": "hi", **dict.fromkeys(names)}, Limits())
    assert (req.n, req.logprobs, req.echo, req.stream, req.cfg.max_new_tokens) == (1, None, False, False, 16)
    assert (req.cfg.temperature, req.cfg.top_p, req.cfg.top_k, req.cfg.stop) == (1.0, 1.0, None, [])
    assert (req.cfg.frequency_penalty, req.cfg.presence_penalty) == (0.0, 0.0)


def test_every_field_is_read():
    req = parse_completion({"prompt": ["Où", "b"], "model": "m", "n": 2, "max_tokens": 7, "temperature": 0.5,
                            "top_p": 0.25, "top_k": 3, "frequency_penalty": -0.5, "presence_penalty": 1.5,
                            "seed": 42, "stop": ["x", "yz"], "logprobs": 2, "stream": True, "best_of": 1,
                            "suffix": "", "logit_bias": {}}, wide())
    cfg = req.cfg
    assert (req.prompts, req.n, req.logprobs, req.echo, req.stream) == (["Où", "b"], 2, 2, False, True)
    assert (cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k) == (7, 0.5, 0.25, 3)
    assert (cfg.frequency_penalty, cfg.presence_penalty, cfg.seed, cfg.stop) == (-0.5, 1.5, 42, ["x", "yz"])
    assert type(cfg.temperature) is float and type(cfg.top_p) is float  # an integer 1 is read as 1.0
    echoed = parse_completion({"prompt": "", "echo": True, "stop": "\n", "temperature": 0}, wide())
    assert (echoed.prompts, echoed.echo, echoed.stream, echoed.cfg.stop) == ([""], True, False, ["\n"])
    assert echoed.cfg.temperature == 0.0 and type(echoed.cfg.temperature) is float


# Each range as OpenAI documents it (top_k and seed: this server's), both ends inclusive.
BOUNDS = [("max_tokens", 0, 100, -1, 101), ("n", 1, 8, 0, 9), ("temperature", 0, 2, -0.01, 2.01),
          ("top_p", 1e-9, 1, 0, 1.01), ("frequency_penalty", -2, 2, -2.01, 2.01),
          ("presence_penalty", -2, 2, -2.01, 2.01), ("top_k", 1, 1 << 31, 0, (1 << 31) + 1),
          ("seed", 0, SEED_LIMIT - 1, -1, SEED_LIMIT), ("logprobs", 0, 5, -1, 6)]


@pytest.mark.parametrize("name, lo, hi, below, above", BOUNDS)
def test_each_range_is_inclusive_and_just_past_it_is_refused(name, lo, hi, below, above):
    limits = Limits(max_tokens=100, max_n=8, max_batch=8)
    for value in (lo, hi):
        req = parse_completion({"prompt": "hi", name: value}, limits)
        read = {"n": req.n, "logprobs": req.logprobs, "max_tokens": req.max_tokens}
        assert (read[name] if name in read else getattr(req.cfg, name)) == value
    for value in (below, above):
        error = refused({"prompt": "hi", name: value}, limits)
        assert error.param == name and name in error.message and repr(value) in error.message


@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty", "n", "max_tokens", "seed", "top_k"])
@pytest.mark.parametrize("value", [True, False, "1", [1], math.nan, math.inf])
def test_a_number_of_the_wrong_type_is_refused(name, value):
    assert refused({"prompt": "hi", name: value}).param == name


def test_an_integer_field_refuses_a_float():
    for name in ("n", "max_tokens", "seed", "logprobs", "top_k"):
        assert refused({"prompt": "hi", name: 2.0}).param == name


@pytest.mark.parametrize("name", ["echo", "stream"])
@pytest.mark.parametrize("value", ["yes", 1, 0, "true"])
def test_a_flag_must_be_a_boolean(name, value):
    assert refused({"prompt": "hi", name: value}).param == name


def test_a_request_without_max_tokens_gets_openais_16_or_the_servers_lower_limit():
    """`gptlab serve --max-tokens 8`: a request that leaves max_tokens out is served 8 tokens (OpenAI's default of
    16 would be over the limit; it was refused, for a field the client never sent); an explicit 9 is refused."""
    assert parse_completion({"prompt": "hi"}, Limits(max_tokens=8)).cfg.max_new_tokens == 8
    assert parse_completion({"prompt": "hi"}, Limits(max_tokens=16)).cfg.max_new_tokens == 16
    assert parse_completion({"prompt": "hi"}, Limits(max_tokens=17)).cfg.max_new_tokens == 16
    with pytest.raises(ApiError) as refusal:
        parse_completion({"prompt": "hi", "max_tokens": 9}, Limits(max_tokens=8))
    assert refusal.value.param == "max_tokens"


def test_prompts_are_a_string_or_1_to_64_strings_and_may_be_empty():
    assert parse_completion({"prompt": ["a"] * 64}, wide()).prompts == ["a"] * 64
    assert parse_completion({"prompt": ["", "é"]}, wide()).prompts == ["", "é"]
    for bad in (3, [], ["a"] * 65, [None], {"a": 1}):
        error = refused({"prompt": bad})
        assert (error.param, error.message) == ("prompt", "prompt must be a string or a list of 1 to 64 of them")
    for mixed in (["a", 1], [["a"]], [[1], []], [[1], "a"], [[1]] * 65, [True, 2]):
        error = refused({"prompt": mixed})
        assert (error.param, error.message) == ("prompt", "prompt must be a string, a list of strings, a list of "
                                                          "token ids or a list of 1 to 64 non-empty lists of token "
                                                          "ids, not a mix")


def test_prompts_may_be_token_ids_one_list_or_several():
    assert parse_completion({"prompt": [5, 0, 7]}, wide()).prompt_ids == [[5, 0, 7]]
    assert parse_completion({"prompt": [[5], [1, 2]]}, wide()).prompt_ids == [[5], [1, 2]]
    assert parse_completion({"prompt": [[3]] * 64}, wide()).prompt_ids == [[3]] * 64
    assert parse_completion({"prompt": ["5"]}, wide()).prompt_ids is None
    for null in ([None, 5], [[None, 5, 6]], [[1], [None]]):  # a harness's empty context on a model without eot
        error = refused({"prompt": null})
        assert error.param == "prompt" and error.message.startswith("prompt holds a null token id")


def test_stop_is_1_to_4_non_empty_strings():
    assert parse_completion({"prompt": "a", "stop": ["1", "2", "3", "4"]}, wide()).cfg.stop == ["1", "2", "3", "4"]
    for bad in ("", ["x", ""], ["1", "2", "3", "4", "5"], [], 7, [None]):
        error = refused({"prompt": "a", "stop": bad})
        assert (error.param, error.message) == ("stop", "stop must be a non-empty string or a list of 1 to 4 of them")


@pytest.mark.parametrize("body, param", [({}, "prompt"), ({"prompt": None, "model": "m"}, "prompt"),
                                         ({"prompt": "a", "best_of": 2}, "best_of"),
                                         ({"prompt": "a", "suffix": "x"}, "suffix")])
def test_a_missing_prompt_or_an_unsupported_field_is_named(body, param):  # (the model: check_model, below)
    assert refused(body).param == param


def test_a_body_that_is_not_an_object_is_refused_naming_nothing():
    for body in ([], "prompt", None, 3):
        assert refused(body).param is None


def test_more_sequences_than_the_batch_are_refused_naming_what_to_shrink():
    limits = Limits(max_n=8, max_batch=4)
    assert len(parse_completion({"prompt": ["a", "b"], "n": 2}, limits).prompts) == 2  # exactly the batch
    assert parse_completion({"prompt": "a", "n": 4}, limits).n == 4
    many = refused({"prompt": ["a"] * 5}, limits)
    assert many.param == "prompt" and "5 prompts are" in many.message and "(4, --max-batch)" in many.message
    wide = refused({"prompt": "a", "n": 5}, limits)
    assert wide.param == "n" and "n=5 sequences" in wide.message and "n <= 4" in wide.message
    both = refused({"prompt": ["a", "b", "c"], "n": 2}, limits)
    assert both.param == "prompt" and "3 prompts x n=2 are 6 sequences" in both.message


# --- encode_prompts -------------------------------------------------------------------------------------------

CHARS = CharTokenizer("abcdeé ")  # ids by sorted character: ' '=0, a=1, b=2, c=3, d=4, e=5, é=6


def encoded(prompts, tokenizer=CHARS, context=8, limits=None):
    limits = limits or wide()
    req = parse_completion({"prompt": prompts}, limits)
    encode_prompts(req, tokenizer, context, limits)
    return req.ids


def test_prompts_are_encoded_in_order():
    assert encoded(["bad", "é a", "c"]) == [[2, 1, 4], [6, 0, 1], [3]]


def test_a_prompt_as_long_as_the_context_is_taken_one_more_is_refused():
    assert encoded("abcdeabc") == [[1, 2, 3, 4, 5, 1, 2, 3]]
    with pytest.raises(ApiError) as info:
        encoded(["a", "abcdeabcd"])
    error = info.value
    assert (error.status, error.param, error.code) == (400, "prompt", "context_length_exceeded")
    assert "9 tokens" in error.message and "(8:" in error.message


def test_max_prompt_tokens_lowers_the_context_and_0_means_the_context():
    assert encoded("abcde", limits=Limits(max_prompt_tokens=5)) == [[1, 2, 3, 4, 5]]
    with pytest.raises(ApiError, match=r"\(5: the model's context is 8 tokens\)") as info:
        encoded("abcdea", limits=Limits(max_prompt_tokens=5))
    assert info.value.code == "context_length_exceeded"
    assert encoded("abcdeabc", limits=Limits(max_prompt_tokens=20)) == [[1, 2, 3, 4, 5, 1, 2, 3]]  # the context wins
    with pytest.raises(ApiError, match="9 tokens"):
        encoded("abcdeabcd", limits=Limits(max_prompt_tokens=20))


def test_an_empty_prompt_starts_at_end_of_text_where_the_model_has_one():
    gpt2 = GPT2Tokenizer()
    assert encoded(["", "hi"], gpt2) == [[gpt2.eot_id], gpt2.encode("hi")] == [[50256], [5303]]
    with pytest.raises(ApiError) as info:
        encoded(["a", ""])  # a char model has no start token: nothing to condition on
    assert (info.value.status, info.value.param, info.value.code) == (400, "prompt", None)
    assert "empty" in info.value.message


def test_text_the_tokenizer_cannot_encode_is_a_400_with_its_reason():
    with pytest.raises(ApiError) as info:
        encoded(["abc", "a€"])
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert "never seen" in info.value.message and "'€'" in info.value.message


# --- the app in-process: FastAPI's TestClient, the `openai` client over it -------------------------------------

NAME = 'tiny</script>"é'  # a run name that must stay data inside the playground's script


@pytest.fixture(scope="module")
def tiny():
    """A char tokenizer (non-ASCII included) and a randomly initialised 2-layer model over it (context 16)."""
    torch.manual_seed(0)
    tokenizer = CharTokenizer("abcdefghij é")
    return tokenizer, GPT(tiny_config(vocab_size=tokenizer.vocab_size)).eval()


@pytest.fixture(scope="module")
def http(tiny):
    tokenizer, model = tiny
    loads = []  # /inspect's plain model: loaded on first use, once
    served = Served(NAME, prepare_for_inference(copy.deepcopy(model), "fp32"), tokenizer, model.num_params(),
                    lambda: loads.append(1) or model)
    with TestClient(make_app(served, Limits(max_batch=4, max_body_bytes=4096))) as client:
        client.loads = loads
        yield client


@pytest.fixture(scope="module")
def openai_client(http):
    openai = pytest.importorskip("openai", reason="no openai client (pip install -e '.[test]')")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def greedy(model, tokenizer, prompt, steps):
    """Greedy text from the plain forward pass (no cache, no server)."""
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    return tokenizer.decode(ids[len(tokenizer.encode(prompt)):])


def test_only_the_documented_routes_exist(http):
    for route in ("/docs", "/redoc", "/openapi.json"):
        assert http.get(route).status_code == 404, route


def test_the_playground_names_the_model_as_a_json_string_that_cannot_end_its_script(http):
    page = http.get("/").text
    assert '"tiny<\\/script>\\"\\u00e9"' in page and "__MODEL__" not in page and page.count("</script>") == 1


def test_a_stream_tells_caches_and_proxies_not_to_hold_its_events(http):
    """Server-sent events pass a reverse proxy (nginx buffers responses unless told `X-Accel-Buffering: no`) and
    caches token by token."""
    with http.stream("POST", "/v1/completions", json={"prompt": "ab", "max_tokens": 2, "stream": True}) as response:
        body = "".join(response.iter_text())
    assert response.headers["content-type"].startswith("text/event-stream")
    assert (response.headers["cache-control"], response.headers["x-accel-buffering"]) == ("no-cache", "no")
    assert body.endswith("data: [DONE]\n\n")


def test_inspect_shows_the_last_200_characters_and_the_context_they_end_with(http):
    text = "abcdefghij" * 24 + "jihgfedcba"  # 250 characters, 250 tokens: more than the context (16)
    for _ in range(2):
        page = http.post("/inspect", json={"text": text})
        assert page.status_code == 200
        assert re.search("<title>attention: (.*?)</title>", page.text).group(1) == text[-200:]
        tokens = re.search('"tokens":(\\[.*?\\])', page.text).group(1)
        assert json.loads(tokens) == list(text[-16:])  # the last 16 tokens: the context
    assert http.loads == [1]
    error = http.post("/inspect", json={"text": "abc€"})  # the tokenizer's refusal, as a 400
    assert (error.status_code, error.json()["error"]["param"]) == (400, "text")
    assert "never seen" in error.json()["error"]["message"]


def test_a_completion_is_openais_and_the_plain_greedy_text(openai_client, tiny):
    got = openai_client.completions.create(model=NAME, prompt=["abc", "é a"], max_tokens=3, temperature=0)
    assert re.fullmatch("cmpl-[0-9a-f]{24}", got.id) and got.model == NAME and got.object == "text_completion"
    assert [c.text for c in got.choices] == [greedy(*reversed(tiny), p, 3) for p in ("abc", "é a")]
    assert [c.logprobs for c in got.choices] == [None, None]  # none asked for: none given
    assert [c.finish_reason for c in got.choices] == ["length", "length"]


# --- the model's name, and every refusal in OpenAI's shape ------------------------------------------------------

GPT4 = {"error": {"message": "The model `gpt-4` does not exist or you do not have access to it.",
                  "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}  # OpenAI's words


def test_the_name_v1_models_lists_is_served_and_any_other_is_404_model_not_found(openai_client, http):
    openai = pytest.importorskip("openai")
    [listed] = openai_client.models.list().data
    assert openai_client.completions.create(model=listed.id, prompt="abc", max_tokens=1).model == listed.id == NAME
    for call in (lambda: openai_client.completions.create(model="gpt-4", prompt="abc", max_tokens=1),
                 lambda: openai_client.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                                          "content": "a"}])):
        with pytest.raises(openai.NotFoundError) as caught:  # (the chat route: before this run's lack of a template)
            call()
        assert caught.value.status_code == 404 and caught.value.response.json() == GPT4
    for near in (NAME.upper(), NAME + " ", ""):  # names are compared exactly
        assert http.post("/v1/completions", json={"model": near, "prompt": "abc"}).status_code == 404
    for model in ({}, {"model": None}):  # no name: the one model served (curl, lm-eval's default payload)
        answer = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1, **model})
        assert answer.status_code == 200 and answer.json()["model"] == NAME
    wrong = http.post("/v1/completions", json={"prompt": "abc", "model": 3})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model"


def test_accept_any_model_answers_every_name_as_the_served_model(tiny):
    openai = pytest.importorskip("openai")
    tokenizer, model = tiny
    served = Served("run", prepare_for_inference(copy.deepcopy(model), "fp32"), tokenizer, 0, lambda: model)
    with TestClient(make_app(served, Limits(accept_any_model=True))) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        for name in ("gpt-4", "run", "text-davinci-003"):
            got = client.completions.create(model=name, prompt="abc", max_tokens=2, temperature=0)
            assert got.model == "run" and len(got.choices[0].text) == 2  # what answered, as OpenAI names its snapshot
        wrong = http.post("/v1/completions", json={"prompt": "abc", "model": ["gpt-4"]})
        assert wrong.status_code == 400 and wrong.json()["error"]["message"] == 'model must be a string, not ["gpt-4"]'
    assert Limits().accept_any_model is False


@pytest.mark.parametrize("method, route, status, message", [
    ("GET", "/v1/nope", 404, "Invalid URL (GET /v1/nope): this server has no such route"),
    ("POST", "/v1/completion", 404, "Invalid URL (POST /v1/completion): this server has no such route"),
    ("GET", "/docs", 404, "Invalid URL (GET /docs): this server has no such route"),
    ("GET", "/v1/completions", 405, "GET is not allowed on /v1/completions; use POST"),
    ("DELETE", "/v1/models", 405, "DELETE is not allowed on /v1/models; use GET")])
def test_no_such_route_or_method_is_refused_in_openais_shape(http, method, route, status, message):
    response = http.request(method, route)
    assert response.status_code == status and response.json() == {"error": {
        "message": message, "type": "invalid_request_error", "param": None, "code": None}}
    if status == 405:
        assert response.headers["allow"] == message.rsplit(" ", 1)[1]


class Broken(CharTokenizer):
    def encode(self, text, allow_special=False):
        raise RuntimeError("a bug")


def test_a_bug_is_a_500_in_openais_shape(tiny):
    _, model = tiny
    served = Served("run", model, Broken("abc"), 0, lambda: model)
    client = TestClient(make_app(served, Limits()), raise_server_exceptions=False)  # as uvicorn answers: a response
    response = client.post("/tokenize", json={"prompt": "ab"})
    assert response.status_code == 500 and response.json() == {"error": {
        "message": "the server failed on this request (RuntimeError); its log has the traceback",
        "type": "server_error", "param": None, "code": None}}


@pytest.mark.parametrize("field, value, shown", [
    ("temperature", True, "a number in [0.0, 2.0], not true"), ("n", False, "an integer in [1, 8], not false"),
    ("echo", "yes", 'true or false, not "yes"'), ("stream", None, None),
    ("top_p", "é", 'a number in [1e-09, 1.0], not "é"'),
    ("max_tokens", [1, None], "an integer in [0, 512], not [1, null]"),
    ("seed", {"a": False}, f'an integer in [0, {SEED_LIMIT - 1}], not {{"a": false}}'),
    ("logprobs", 0.5, "an integer in [0, 5], not 0.5")])
def test_a_refused_value_is_spelled_in_json(field, value, shown):
    if shown is None:  # null: the default
        assert parse_completion({"prompt": "hi", field: value}, Limits()).stream is False
        return
    assert refused({"prompt": "hi", field: value}, Limits()).message == f"{field} must be {shown}"


def test_a_long_refused_value_is_cut_short():
    message = refused({"prompt": "hi", "temperature": "x" * 10_000}).message
    assert message == 'temperature must be a number in [0.0, 2.0], not "' + "x" * 38 + "…"


# --- the JSON and SSE writers, driven by events queued by hand (the scheduler's format: scheduler.Job) ---------

DONE = Done(prompt_tokens=3, completion_tokens=4, cached_tokens=2)
USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 2}}


def info(token, logprob):
    return {"token": token, "logprob": logprob, "top": {token: logprob, "x": -9.0}}


EVENTS = [Token(0, "ab", 1, info("ab", -0.5), None), Token(1, "c", 3, info("c", -1.0), None),
          Token(0, "é", 11, info("é", -0.25), None), Token(1, "d", 4, info("d", -2.0), "stop"),
          Token(0, "f", 6, info("f", -0.75), "length"), DONE]  # two choices of one prompt, tokens interleaved as a batch gives them


class Client:
    """The request as responses.answer sees it: is_disconnected answers from `answers` (the last one repeats); each check
    may also queue events (as if tokens arrived while the clock was looked at)."""

    def __init__(self, answers=(False,), then=()):
        self.answers, self.then, self.checks = list(answers), list(then), 0

    async def is_disconnected(self):
        self.checks += 1
        for event in self.then:
            self.job.events.put_nowait(event)
        self.then = []
        return self.answers[min(self.checks, len(self.answers)) - 1]


def job_of(body, events, prompt_ids=((1, 2),)):
    req = parse_completion(body, Limits())
    req.ids = [list(i) for i in prompt_ids]
    job = Job(req, asyncio.get_running_loop(), asyncio.Queue())
    for event in events:
        job.events.put_nowait(event)
    return job


def collected(body, events, client=None, prompt_ids=((1, 2),)):
    client = client or Client()

    async def run():
        client.job = job = job_of(body, events, prompt_ids)
        response = await asyncio.wait_for(answer(job, client, lambda events: completion_response(events, job, "run")),
                                          10)
        assert job.cancelled.is_set()  # its rows are freed whatever the outcome
        return response
    return asyncio.run(run())


def test_a_collected_completion_joins_each_choices_tokens_and_logprobs():
    response = collected({"prompt": "xy", "n": 2, "logprobs": 1}, EVENTS)
    body = json.loads(response.body)
    assert response.status_code == 200 and re.fullmatch("cmpl-[0-9a-f]{24}", body["id"]) and body["model"] == "run"
    assert body["object"] == "text_completion" and body["usage"] == USAGE
    assert body["choices"] == [
        {"text": "abéf", "index": 0, "finish_reason": "length",
         "logprobs": {"tokens": ["ab", "é", "f"], "token_logprobs": [-0.5, -0.25, -0.75], "text_offset": [0, 2, 3],
                      "top_logprobs": [{"ab": -0.5, "x": -9.0}, {"é": -0.25, "x": -9.0}, {"f": -0.75, "x": -9.0}]}},
        {"text": "cd", "index": 1, "finish_reason": "stop",
         "logprobs": {"tokens": ["c", "d"], "token_logprobs": [-1.0, -2.0], "text_offset": [0, 1],
                      "top_logprobs": [{"c": -1.0, "x": -9.0}, {"d": -2.0, "x": -9.0}]}}]
    openai = pytest.importorskip("openai")
    assert openai.types.Completion.model_validate(body).choices[0].logprobs.text_offset == [0, 2, 3]


def test_a_collected_echo_starts_each_choice_with_its_own_prompt():
    events = [Token(3, "a", 1, None, "length"), Token(0, "b", 2, None, "length"), DONE]
    body = json.loads(collected({"prompt": ["Où", "z"], "n": 2, "echo": True}, events,
                                prompt_ids=((1, 2), (3,))).body)
    assert [(c["index"], c["text"], c["logprobs"]) for c in body["choices"]] == [
        (0, "Oùb", None), (1, "Où", None), (2, "z", None), (3, "za", None)]


def test_an_engine_error_is_a_500_in_openais_shape():
    response = collected({"prompt": "xy"}, [Token(0, "a", 1, None, None), Failed("the model broke")])
    assert response.status_code == 500 and json.loads(response.body) == {"error": {
        "message": "the model broke", "type": "server_error", "param": None, "code": None}}


def test_a_client_that_left_is_noticed_while_nothing_arrives():
    client = Client(answers=(True,))
    assert collected({"prompt": "xy"}, [], client).status_code == 499 and client.checks == 1


def test_gather_returns_the_events_alone_through_a_lull():
    """Nothing arrives for a while (the wait times out, the client is asked), then two tokens and the end: the
    events are those three, nothing for the lull."""
    client = Client(then=[Token(0, "b", 2, None, "length"), DONE])

    async def run():
        client.job = job = job_of({"prompt": "xy"}, [Token(0, "a", 1, None, None)])
        return await asyncio.wait_for(gather(job, client), 10), job.cancelled.is_set()
    events, freed = asyncio.run(run())
    assert events == [Token(0, "a", 1, None, None), Token(0, "b", 2, None, "length"), DONE] and freed
    assert client.checks == 1


def test_the_usage_of_a_predicted_output_counts_its_tokens_accepted_and_rejected():
    assert usage(Done(3, 4, 2, prediction=(5, 1))) == {
        **USAGE, "completion_tokens_details": {"accepted_prediction_tokens": 5, "rejected_prediction_tokens": 1}}
    assert usage(DONE) == USAGE  # no prediction: no details


def test_a_lull_in_tokens_is_waited_out_while_the_client_stays():
    client = Client(then=[Token(0, "b", 2, None, "length"), DONE])
    body = json.loads(collected({"prompt": "xy"}, [Token(0, "a", 1, None, None)], client).body)
    assert client.checks == 1 and [(c["text"], c["finish_reason"]) for c in body["choices"]] == [("ab", "length")]


def streamed(body, events, prompt_ids=((1, 2),)):
    """The SSE text completion_stream writes for these events, and whether it freed the job's rows after."""
    async def run():
        job = job_of(body, events, prompt_ids)
        return [part async for part in completion_stream(job, "run")], job.cancelled.is_set()
    return asyncio.run(run())


def chunks_of(parts):
    assert all(p.startswith("data: ") and p.endswith("\n\n") and p.count("\n") == 2 for p in parts)
    return [json.loads(p[6:]) for p in parts[:-1]]


def test_a_stream_is_one_chunk_a_token_then_the_usage_then_done():
    parts, freed = streamed({"prompt": "xy", "n": 2, "logprobs": 1, "stream": True}, EVENTS)
    assert freed and parts[-1] == "data: [DONE]\n\n"
    chunks = chunks_of(parts)
    assert len({c["id"] for c in chunks}) == 1 and re.fullmatch("cmpl-[0-9a-f]{24}", chunks[0]["id"])
    assert {(c["object"], c["model"]) for c in chunks} == {("text_completion", "run")}
    def one(text, index, reason, logprob, offset):  # a chunk's choice: one token, at `offset` in its choice's text
        return [{"text": text, "index": index, "finish_reason": reason, "logprobs": {
            "tokens": [text], "token_logprobs": [logprob], "top_logprobs": [{text: logprob, "x": -9.0}],
            "text_offset": [offset]}}]
    assert [c["choices"] for c in chunks] == [one("ab", 0, None, -0.5, 0), one("c", 1, None, -1.0, 0),
                                              one("é", 0, None, -0.25, 2), one("d", 1, "stop", -2.0, 1),
                                              one("f", 0, "length", -0.75, 3), []]
    assert chunks[-1]["usage"] == USAGE and "usage" not in chunks[0]
    assert "é" in parts[2]  # UTF-8 as it is, readable in `curl -N`, not a \\u escape


def test_a_streamed_echo_sends_each_choices_prompt_first():
    events = [Token(1, "a", 1, None, "length"), Token(0, "b", 2, None, "length"), DONE]
    parts, _ = streamed({"prompt": ["Où", "z"], "echo": True, "stream": True}, events, prompt_ids=((1, 2), (3,)))
    assert '"Où"' in parts[0]
    assert {(c["object"], c["model"], c["id"][:5]) for c in chunks_of(parts)} == {("text_completion", "run", "cmpl-")}
    assert [[(c["index"], c["text"], c["logprobs"], c["finish_reason"]) for c in chunk["choices"]]
            for chunk in chunks_of(parts)] == [[(0, "Où", None, None)], [(1, "z", None, None)],
                                               [(1, "a", None, "length")], [(0, "b", None, "length")], []]


def test_a_streamed_echo_with_logprobs_sends_each_prompt_with_its_logprobs_to_each_of_its_choices():
    """With logprobs the echo waits for the prompt's logprobs (PromptLogprobs events, in the order the scheduler scores
    the prompts): each of the prompt's n choices gets its prompt text with those entries, then its tokens."""
    first = {"tokens": ["O", "ù"], "token_logprobs": [None, -1.5], "top_logprobs": [None, {"ù": -1.5}],
             "text_offset": [0, 1]}
    second = {"tokens": ["z"], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    events = [PromptLogprobs(1, second), PromptLogprobs(0, first), Token(3, "a", 1, None, "length"),
              Token(0, "b", 2, None, "length"), DONE]
    parts, freed = streamed({"prompt": ["Où", "z"], "echo": True, "stream": True, "logprobs": 1, "n": 2}, events,
                            prompt_ids=((1, 2), (3,)))
    assert freed and parts[-1] == "data: [DONE]\n\n"
    chunks = chunks_of(parts)  # the prompts' chunks too carry the completion's one id and the model's name
    assert len({c["id"] for c in chunks}) == 1 and re.fullmatch("cmpl-[0-9a-f]{24}", chunks[0]["id"])
    assert {(c["object"], c["model"]) for c in chunks} == {("text_completion", "run")}
    assert [[(c["index"], c["text"], c["logprobs"], c["finish_reason"]) for c in chunk["choices"]]
            for chunk in chunks][:4] == [[(2, "z", second, None)], [(3, "z", second, None)],
                                         [(0, "Où", first, None)], [(1, "Où", first, None)]]
    token_chunks = [chunk["choices"][0] for chunk in chunks[4:6]]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in token_chunks] == [(3, "a", "length"),
                                                                                   (0, "b", "length")]


def test_an_echo_with_logprobs_in_one_response_gives_each_prompt_s_logprobs_to_each_of_its_choices():
    """The same events as above, not streamed: each of a prompt's n choices starts with that prompt's text and
    its logprobs entries (the scheduler scores the second prompt first), then its own tokens' entries."""
    first = {"tokens": ["O", "ù"], "token_logprobs": [None, -1.5], "top_logprobs": [None, {"ù": -1.5}],
             "text_offset": [0, 1]}
    second = {"tokens": ["z"], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    events = [PromptLogprobs(1, second), PromptLogprobs(0, first), Token(3, "a", 1, info("a", -0.5), "length"),
              Token(0, "b", 2, info("b", -2.0), "length"), DONE]
    body = json.loads(collected({"prompt": ["Où", "z"], "echo": True, "logprobs": 1, "n": 2}, events,
                                prompt_ids=((1, 2), (3,))).body)
    def entries(start, token, logprob, offset):
        return {key: start[key] + [value] for key, value in (("tokens", token), ("token_logprobs", logprob), (
            "top_logprobs", {token: logprob, "x": -9.0}), ("text_offset", offset))}
    assert [(c["index"], c["text"], c["logprobs"]) for c in body["choices"]] == [
        (0, "Oùb", entries(first, "b", -2.0, 2)), (1, "Où", first), (2, "z", second),
        (3, "za", entries(second, "a", -0.5, 1))]
    assert body["usage"] == USAGE


def test_an_engine_error_ends_a_stream_in_openais_shape_then_done():
    parts, freed = streamed({"prompt": "xy", "stream": True}, [Token(0, "a", 1, None, None),
                                                               Failed("the server is shutting down")])
    assert freed and parts[-1] == "data: [DONE]\n\n" and len(parts) == 3
    assert chunks_of(parts)[-1] == {"error": {"message": "the server is shutting down", "type": "server_error",
                                              "param": None, "code": None}}


def chat_streamed(body, events):
    """The SSE text chat_stream writes for these events (token 9 ends the turn), and whether it freed the rows."""
    async def run():
        req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True, **body}, Limits())
        req.ids = [[1, 2]]
        job = Job(req, asyncio.get_running_loop(), asyncio.Queue())
        for event in events:
            job.events.put_nowait(event)
        return [part async for part in chat_stream(job, "run", frozenset({9}))], job.cancelled.is_set()
    return asyncio.run(run())


def chat_info(token, logprob):
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "ranked": [], "top": {}}


def test_a_chat_stream_sends_logprobs_of_its_content_only_and_only_when_asked():
    """The token that ends the turn releases no text and gets no logprobs entry, so no chunk; without logprobs in
    the request every chunk's logprobs is null."""
    events = [Token(0, "a", 1, chat_info("a", -0.5), None), Token(0, "", 9, chat_info("<|end|>", -0.1), "stop"), DONE]
    parts, freed = chat_streamed({"logprobs": True}, events)
    assert freed and parts[-1] == "data: [DONE]\n\n"
    entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    assert [c["choices"] for c in chunks_of(parts)] == [
        [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [entry]}, "finish_reason": None}],
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]]
    parts, _ = chat_streamed({}, [Token(0, "a", 1, None, None), Token(0, "", 9, None, "stop"), DONE])
    assert [c["choices"][0]["logprobs"] for c in chunks_of(parts)] == [None, None, None]


def test_an_engine_error_ends_a_chat_stream_in_openais_shape_then_done():
    parts, freed = chat_streamed({}, [Token(0, "a", 1, None, None), Failed("the server is shutting down")])
    assert freed and parts[-1] == "data: [DONE]\n\n" and len(parts) == 4
    chunks = chunks_of(parts)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant"}, {"content": "a"}]
    assert chunks[-1] == {"error": {"message": "the server is shutting down", "type": "server_error", "param": None,
                                    "code": None}}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CALL_TEXT = CALL_OPEN + '{"name": "f", "arguments": {}}' + CALL_CLOSE


def chat_answered(body, text, reason):
    """chat_response's object for one choice that wrote `text` and ended with `reason`."""
    async def run():
        req = parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, Limits())
        req.ids, req.structure = [[1, 2]], parse_structure(body, chat=True)  # as the chat route sets them
        return chat_response([Token(0, text, 1, None, reason), DONE], Job(req, asyncio.get_running_loop(),
                                                                          asyncio.Queue()), "run", frozenset({9}))
    return asyncio.run(run())


def test_a_chat_answer_is_a_tool_call_only_where_tools_were_given_and_it_stopped_on_a_whole_call():
    called = chat_answered({"tools": [TOOL]}, CALL_TEXT, "stop")
    assert re.fullmatch("chatcmpl-[0-9a-f]{24}", called["id"]) and called["object"] == "chat.completion"
    assert called["model"] == "run" and called["usage"] == USAGE
    (choice,) = called["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "f", "arguments": "{}"}]
    for body, reason in (({}, "stop"), ({"tools": [TOOL], "tool_choice": "none"}, "stop"),
                         ({"tools": [TOOL]}, "length")):  # no tools, tools refused, or cut off: the text as written
        (choice,) = chat_answered(body, CALL_TEXT, reason)["choices"]
        assert choice == {"index": 0, "message": {"role": "assistant", "content": CALL_TEXT}, "finish_reason": reason,
                          "logprobs": None}, body


# --- request bodies -------------------------------------------------------------------------------------------


class Body:
    """A request body as _read_json reads it: headers, and the chunks as they arrive."""

    def __init__(self, chunks, length=None):
        self.chunks, self.read = chunks, 0
        self.headers = {} if length is None else {"content-length": str(length)}

    async def stream(self):
        for chunk in self.chunks:
            self.read += len(chunk)
            yield chunk


def read(body, limit):
    return asyncio.run(_read_json(body, limit))


def too_large(body, limit):
    with pytest.raises(ApiError) as info:
        read(body, limit)
    assert (info.value.status, info.value.code, info.value.param) == (413, "body_too_large", None)
    assert f"{limit}" in info.value.message and "--max-body-bytes" in info.value.message
    return info.value


CHUNKS = [b'{"prompt": ', '"Où'.encode(), b' est"', b', "n": 2}']  # 11 + 4 ("ù" is 2 bytes) + 5 + 9 = 29 bytes


def test_a_body_of_exactly_the_limit_is_read_across_its_chunks():
    assert sum(map(len, CHUNKS)) == 29
    assert read(Body(CHUNKS), 29) == {"prompt": "Où est", "n": 2}  # no Content-Length: counted as it arrives
    assert read(Body(CHUNKS, length=29), 29) == {"prompt": "Où est", "n": 2}


def test_one_byte_past_the_limit_is_413_as_it_arrives():
    body = Body(CHUNKS)
    too_large(body, 28)
    assert body.read == 29  # it stopped at the chunk that passed the limit


def test_a_declared_length_past_the_limit_is_413_before_reading():
    body = Body([b"{}"], length=5000)
    assert "5000 bytes" in too_large(body, 4096).message and body.read == 0
    assert read(Body([b"{}"], length="nope"), 4096) == {}  # not a number: counted as it arrives


@pytest.mark.parametrize("raw, says", [(b"{nope", "not valid JSON"), (b'"\xff"', "not valid JSON"),
                                       (b"", "not valid JSON"), (b"[" * 100_000, "nested")])
def test_a_body_that_is_not_json_is_400(raw, says):
    with pytest.raises(ApiError) as info:
        read(Body([raw]), 1 << 20)
    assert (info.value.status, info.value.param, info.value.code) == (400, None, None) and says in info.value.message


def test_the_key_guards_the_api_but_not_health(tiny):
    tokenizer, model = tiny
    served = Served("run", prepare_for_inference(copy.deepcopy(model), "fp32"), tokenizer, 0, lambda: model)
    with TestClient(make_app(served, Limits(), api_key="s3cret")) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            refused = client.get("/v1/models", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert refused.json()["error"]["type"] == "invalid_request_error" and refused.json()["error"]["message"]
        assert client.get("/v1/models", headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/health").status_code == 200
