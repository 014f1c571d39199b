"""`gptlab serve` against a live server on 127.0.0.1: the official `openai` client (completion, stream, n > 1,
logprobs, stop), each result equal to `gptlab sample` with the same seed and settings; every error status in
OpenAI's shape; a client that leaves mid-stream or from the queue frees its place; /v1/models, /health, /metrics
(counted exactly); echo, usage and finish reasons as OpenAI gives them (an end-of-text model over GPT-2's tokenizer
for "stop" and non-ASCII prompts); `curl -N` as the serving guide shows it; SIGTERM lets an in-flight request
finish and exits 0. References come from outside the server: `gptlab sample`, the plain forward, numbers counted by
hand."""

import contextlib
import io
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers import CORPUS, eot_model, tiny_run
from prometheus_client.parser import text_string_to_metric_families

from gptlab.checkpoint import load_run
from gptlab.cli import main
from gptlab.inference.loading import prepare_for_inference
from gptlab.inference.prefix_cache import PrefixCache
from gptlab.serve.api import Limits
from gptlab.serve.app import Served, make_app
from gptlab.serve.server import load_served, start_server
from gptlab.tokenizer import GPT2Tokenizer

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "4",
        "--eval-interval", "10", "--eval-batches", "2", "--log-interval", "10", "--precision", "fp32", "--quiet"]
LIMITS = dict(max_tokens=3000, max_n=4, max_body_bytes=4096, max_batch=4, queue=1, grace=2.0)
GPTLAB = str(Path(sys.executable).parent / "gptlab")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):

    return tiny_run(tmp_path_factory.mktemp("serve"), 20, TINY)


@pytest.fixture(scope="module")
def server(run_dir):
    app = make_app(load_served(run_dir, "fp32", "cpu"), Limits(**LIMITS))
    running = start_server(app)
    running.app = app
    yield running
    running.stop()


@pytest.fixture(scope="module")
def eot_server():
    """GPT-2's tokenizer over eot_model. Default limits (batch 16, 1 MiB bodies)."""
    tokenizer = GPT2Tokenizer()
    model = eot_model(tokenizer)
    served = Served("eot", prepare_for_inference(model, "fp32"), tokenizer, model.num_params(), lambda: model)
    running = start_server(make_app(served, Limits()))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai", reason="no openai client (pip install -e '.[test]')")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def greedy(run_dir):
    """`gptlab sample`'s greedy 5-token text of each prompt the tests use: the reference outside the server."""
    texts = {}
    for prompt in ("All:", "First", "You"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["sample", "--run", str(run_dir), "--prompt", prompt, "--no-echo", "--precision", "fp32",
                         "--max-new-tokens", "5", "--temperature", "0"]) == 0
        texts[prompt] = out.getvalue().removesuffix("\n")
    assert len(set(texts.values())) == 3  # so that a choice given another prompt's text shows
    return texts


def streamed(chunks, size):
    """A stream's texts and finish reasons by choice index, and its usage."""
    texts, reasons, usage = [""] * size, [None] * size, None
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            assert choice.finish_reason in (None, "stop", "length")  # OpenAI's values
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        usage = getattr(chunk, "usage", None) or usage
    return texts, reasons, usage


def sample(run_dir, capsys, prompt, n=1, **settings):
    """`gptlab sample`'s texts (without the prompt) for these settings."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, values in settings.items()
             for v in (values if isinstance(values, list) else [values])]
    capsys.readouterr()
    assert main(["sample", "--run", str(run_dir), "--prompt", prompt, "--no-echo", "--precision", "fp32",
                 "--num-samples", str(n), *flags]) == 0
    out = capsys.readouterr().out
    return [text.removesuffix("\n") for text in out.split("\n" + "-" * 40 + "\n")]


def test_a_completion_equals_gptlab_sample(client, run_dir, capsys):
    got = client.completions.create(model="run", prompt="All:", max_tokens=40, temperature=0.9, top_p=0.9,
                                    seed=7)
    assert got.choices[0].text == sample(run_dir, capsys, "All:", max_new_tokens=40, temperature=0.9, top_p=0.9,
                                         seed=7)[0]
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == 4 and got.usage.completion_tokens == 40 and got.usage.total_tokens == 44


def test_a_streamed_completion_with_n_3_equals_gptlab_sample(client, run_dir, capsys):
    texts, reasons, usage = streamed(client.completions.create(
        model="run", prompt="First", max_tokens=50, temperature=1.0, n=3, seed=11, presence_penalty=0.5,
        stream=True), 3)
    assert texts == sample(run_dir, capsys, "First", 3, max_new_tokens=50, temperature=1.0, seed=11,
                           presence_penalty=0.5)
    assert len(set(texts)) == 3 and reasons == ["length"] * 3  # 50 tokens pass the 32-token window: it slid
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 150, 155)


def test_n_and_a_list_of_prompts_index_choices_prompt_major(client, greedy):
    got = client.completions.create(model="run", prompt=["All:", "First"], max_tokens=5, temperature=0, n=2)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [greedy["All:"]] * 2 + [greedy["First"]] * 2


@pytest.mark.parametrize("stream", [False, True])
def test_usage_counts_each_prompt_once_however_many_choices(client, stream):
    got = client.completions.create(model="run", prompt=["All:", "First"], max_tokens=3, temperature=0, n=2,
                                    stream=stream)
    usage = streamed(got, 4)[2] if stream else got.usage
    # one token a character: 4 + 5 prompt tokens, each prompt counted once with n > 1 as OpenAI does
    # (openai/openai-python#155: prompt tokens do not scale with n); 2 prompts x 2 choices x 3 tokens
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (9, 12, 21)


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_are_0_without_a_prefix_cache_and_each_prompt_s_once_with_one(client, server, stream,
                                                                                  monkeypatch):
    def ask():
        got = client.completions.create(model="run", prompt=["All:", "First"], max_tokens=2, n=2, stream=stream)
        return streamed(got, 4)[2] if stream else got.usage
    assert ask().prompt_tokens_details.cached_tokens == 0  # the field is there, as OpenAI's, with nothing cached
    batch = server.app.state.scheduler.batch
    cache = PrefixCache(2 ** 20, chunk=2)  # chunks of 2: these short prompts have whole chunks to reuse
    cache.check(batch.model, batch.prepared.cache_dtype)
    monkeypatch.setattr(batch, "prefix_cache", cache)
    assert ask().prompt_tokens_details.cached_tokens == 0  # the blocks are made now
    usage = ask()  # "All:" reuses 2 of its 4 tokens, "First" 4 of 5 (whole chunks before the last token)
    assert usage.prompt_tokens_details.cached_tokens == 2 + 4 and usage.prompt_tokens == 4 + 5  # once a prompt, not n


def test_a_prompt_as_long_as_the_context_is_accepted(client, run_dir):

    prompt = CORPUS[:32]  # 32 characters, 32 tokens: the whole context, and the model still predicts the next one
    got = client.completions.create(model="run", prompt=prompt, max_tokens=1, temperature=0)
    loaded = load_run(run_dir)
    with torch.no_grad():
        logits, _ = loaded.model(torch.tensor([loaded.tokenizer.encode(prompt)]))  # the plain forward, no cache
    assert got.choices[0].text == loaded.tokenizer.decode([int(logits[0, -1].argmax())])
    assert got.usage.prompt_tokens == 32


def test_stop_strings_end_a_choice_and_are_cut(client, run_dir, capsys):
    got = client.completions.create(model="run", prompt="All:", max_tokens=200, temperature=1.0, seed=3,
                                    stop=["e", "a"])
    assert got.choices[0].finish_reason == "stop" and not {"e", "a"} & set(got.choices[0].text)
    assert got.choices[0].text == sample(run_dir, capsys, "All:", max_new_tokens=200, temperature=1.0, seed=3,
                                         stop=["e", "a"])[0]


def test_logprobs_give_each_token_its_logprob_and_the_top_alternatives(client, run_dir):
    got = client.completions.create(model="run", prompt="All:", max_tokens=8, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    loaded = load_run(run_dir)  # the first token's, from the plain forward's log-softmax
    with torch.no_grad():
        logits, _ = loaded.model(torch.tensor([loaded.tokenizer.encode("All:")]))
    first = torch.log_softmax(logits[0, -1], dim=-1).topk(3)
    expected = {loaded.tokenizer.decode([int(i)]): float(v) for v, i in zip(first.values, first.indices)}
    assert lp.top_logprobs[0] == pytest.approx(expected, abs=1e-4)
    assert "".join(lp.tokens) == got.choices[0].text and len(lp.token_logprobs) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0 and max(top.values()) == logprob and top[token] == logprob  # greedy
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(8)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompts, n", [(["All:", "First"], 2), (["All:", "First", "You"], 1)])
def test_echo_puts_each_choices_own_prompt_before_its_text(client, greedy, prompts, n, stream):
    got = client.completions.create(model="run", prompt=prompts, max_tokens=5, temperature=0, n=n, echo=True,
                                    stream=stream)
    texts = streamed(got, len(prompts) * n)[0] if stream else [c.text for c in sorted(got.choices,
                                                                                        key=lambda c: c.index)]
    assert texts == [p + greedy[p] for p in prompts for _ in range(n)]


def test_echo_keeps_non_ascii_prompts_whole(eot_server):
    prompts = ["Où est le café ?", "naïve € 日本"]
    got = httpx.post(eot_server.url + "/v1/completions", json={"prompt": prompts, "max_tokens": 1, "echo": True,
                                                                 "n": 2, "seed": 0}, timeout=30).json()
    assert [c["text"][:len(prompts[c["index"] // 2])] for c in got["choices"]] == [p for p in prompts for _ in "ab"]


@pytest.mark.parametrize("stream", [False, True])
def test_end_of_text_finishes_a_choice_with_openais_stop(eot_server, stream):
    body = {"prompt": "Où est le café ?", "max_tokens": 60, "temperature": 1.0, "seed": 1, "n": 4, "stream": stream}
    reply = httpx.post(eot_server.url + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    if stream:
        events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        choices = [c for e in events for c in e["choices"]]
    else:
        choices = reply.json()["choices"]
    reasons = {c["index"]: c["finish_reason"] for c in choices if c["finish_reason"] is not None}
    # each token ends the text with probability ~0.3: all four end by end-of-text long before 60 tokens
    assert reasons == {0: "stop", 1: "stop", 2: "stop", 3: "stop"}


def metric_values(server):
    """/metrics read by prometheus_client's own parser, as {sample name with its labels: value}."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def test_models_health_and_metrics(server, client):
    model = client.models.list().data[0]
    assert model.id == "run" and model.context_length == 32 and model.tokenizer == "char" and model.parameters > 0
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert server.app.state.scheduler.idle.wait(10)  # nothing left over from another test
    before = metric_values(server)
    client.completions.create(model="run", prompt=["All:", "First"], max_tokens=5, n=2, temperature=0)
    httpx.post(server.url + "/v1/completions", json={"prompt": "All:", "n": 0})
    after = metric_values(server)
    gauges = ("gptlab_queue_depth", "gptlab_batch_size")
    changed = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0) and k not in gauges}
    assert changed.pop("gptlab_time_to_first_token_seconds_sum") > 0
    ttft = {k: v for k, v in changed.items() if k.startswith("gptlab_time_to_first_token_seconds_bucket")}
    assert set(ttft.values()) == {1} and 'gptlab_time_to_first_token_seconds_bucket{le="+Inf"}' in ttft
    assert {k: v for k, v in changed.items() if k not in ttft} == {
        'gptlab_requests_total{status="200"}': 1, 'gptlab_requests_total{status="400"}': 1,
        "gptlab_tokens_generated_total": 20, "gptlab_time_to_first_token_seconds_count": 1}
    assert after["gptlab_queue_depth"] == 0 and after["gptlab_batch_size"] == 4  # the last step decoded all four
    assert after["gptlab_prefix_cache_hit_tokens_total"] == after["gptlab_prefix_cache_hit_ratio"] == 0  # no cache
    metrics = httpx.get(server.url + "/metrics").text
    assert "# TYPE gptlab_time_to_first_token_seconds histogram" in metrics


def error_of(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    assert not re.search(r"\b([a-z]+)\W+\1\b", body["error"]["message"])  # no word said twice in a row
    return body["error"]


@pytest.mark.parametrize("field, value", [("temperature", "hot"), ("max_tokens", -1), ("max_tokens", 3001),
                                          ("n", 5), ("top_p", 0), ("stop", [""]), ("seed", -1), ("logprobs", 6),
                                          ("prompt", 3), ("prompt", None), ("prompt", []), ("prompt", [None]),
                                          ("prompt", ["All:", 5]), ("prompt", [[5], []]), ("prompt", [-1]),
                                          ("stream", "yes"), ("best_of", 2)])
def test_a_bad_field_is_400_naming_it(server, field, value):
    body = {"model": "run", "prompt": "All:", field: value}
    assert error_of(httpx.post(server.url + "/v1/completions", json=body, timeout=10), 400)["param"] == field


def test_more_sequences_than_the_batch_decodes_is_400_at_once(server, eot_server):
    error = error_of(httpx.post(server.url + "/v1/completions", json={"prompt": ["All:", "First"], "n": 3},
                                timeout=10), 400)  # not queued: it would never fit, and wait forever
    assert "2 prompts x n=3 are 6 sequences" in error["message"] and "(4, --max-batch)" in error["message"]
    full = httpx.post(server.url + "/v1/completions", json={"prompt": ["All:", "First"], "n": 2, "max_tokens": 2},
                      timeout=30)
    assert full.status_code == 200 and len(full.json()["choices"]) == 4  # exactly the batch: taken
    many = error_of(httpx.post(eot_server.url + "/v1/completions", json={"prompt": ["hi"] * 64}, timeout=10), 400)
    assert many["param"] == "prompt" and "n=" not in many["message"]  # n is 1: the prompts are too many
    assert "64 prompts" in many["message"] and "(16, --max-batch)" in many["message"]


def test_a_body_nested_too_deep_is_400_in_openais_shape(eot_server):
    deep = b"[" * 100_000 + b"]" * 100_000
    for route in ("/v1/completions", "/inspect"):
        error = error_of(httpx.post(eot_server.url + route, content=deep, timeout=30), 400)
        assert "nested" in error["message"]


def test_a_prompt_longer_than_the_context_or_not_json_is_400(server):
    error = error_of(httpx.post(server.url + "/v1/completions", json={"prompt": "a" * 33}), 400)
    assert error["code"] == "context_length_exceeded" and "32" in error["message"]
    assert error_of(httpx.post(server.url + "/v1/completions", content=b"{nope"), 400)["param"] is None
    assert error_of(httpx.post(server.url + "/v1/completions", json={"prompt": "€"}), 400)["param"] == "prompt"


def test_an_oversized_body_is_413(server):
    error = error_of(httpx.post(server.url + "/v1/completions", json={"prompt": "a" * 5000}), 413)
    assert "4096" in error["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'
    error_of(httpx.post(server.url + "/v1/completions", content=chunks()), 413)


def test_a_key_is_required_when_set(run_dir):
    running = start_server(make_app(load_served(run_dir, "fp32", "cpu"), Limits(**LIMITS), api_key="s3cret"))
    try:
        url, good = running.url, {"Authorization": "Bearer s3cret"}
        routes = [("POST", "/v1/completions", {"prompt": "All:", "max_tokens": 2}), ("GET", "/v1/models", None),
                  ("GET", "/metrics", None), ("POST", "/inspect", {"text": "All:"}),
                  ("POST", "/tokenize", {"prompt": "All:"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
                  ("GET", "/tokenizer_info", None)]  # lm-evaluation-harness's tokenizer routes too
        for method, route, body in routes:  # every route but /health and the page, without the key or a wrong one
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                refused = httpx.request(method, url + route, json=body, headers=headers, timeout=30)
                assert error_of(refused, 401)["code"] == "invalid_api_key", route
            assert httpx.request(method, url + route, json=body, headers=good, timeout=30).status_code == 200, route
        assert httpx.get(url + "/health").status_code == 200  # liveness stays open
        assert httpx.get(url + "/").status_code == 200  # the page itself holds nothing; its requests send the key
    finally:
        running.stop()


def wait_for(condition, seconds=10.0):
    """Poll `condition` (for a process this test does not own: a subprocess's port)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


LONG = {"prompt": "All:", "max_tokens": 3000, "temperature": 1.0, "stream": True, "n": 4}  # fills the batch alone


def test_a_full_queue_is_429_with_retry_after_and_a_client_that_leaves_frees_its_place(server):
    scheduler = server.app.state.scheduler
    before = scheduler.metrics.cancelled
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=LONG) as first:
            lines = first.iter_lines()  # kept: a generator dropped would close the stream
            assert next(lines).startswith("data: ")  # decoding: the batch is full (4 rows of 4)
            with http.stream("POST", "/v1/completions", json={**LONG, "n": 1}) as second:  # answered once queued
                assert second.status_code == 200 and scheduler.metrics.queue_depth == 1
                third = http.post("/v1/completions", json={"prompt": "All:", "max_tokens": 2})
                error = error_of(third, 429)
                assert third.headers["retry-after"] == "1"
                assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")  # OpenAI's 429 shape
        # both clients left mid-stream: their rows leave the batch, nothing waits
        assert scheduler.idle.wait(10) and scheduler.batch.rows == [] and scheduler.metrics.queue_depth == 0
        assert scheduler.metrics.cancelled == before + 2 and scheduler.metrics.tokens < 4 * 3000
        ok = http.post("/v1/completions", json={"prompt": "All:", "max_tokens": 2})  # the place is free again
        assert ok.status_code == 200


def test_a_client_that_leaves_the_queue_gives_its_place_back(server):
    scheduler = server.app.state.scheduler
    before = scheduler.metrics.cancelled
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=LONG) as first:
            lines = first.iter_lines()  # kept: a generator dropped would close the stream
            assert next(lines).startswith("data: ")  # the batch is full, and stays full
            with http.stream("POST", "/v1/completions", json={**LONG, "n": 1}) as second:
                assert second.status_code == 200
                [waiting] = scheduler.waiting()
            assert waiting.cancelled.wait(10)  # its client left while it waited
            with http.stream("POST", "/v1/completions", json={**LONG, "n": 1}) as third:
                assert third.status_code == 200, third.read()  # the queue has room again
    assert scheduler.idle.wait(10) and scheduler.metrics.cancelled == before + 3


def test_a_client_that_leaves_a_plain_request_cancels_it_too(server, monkeypatch):
    scheduler, submitted = server.app.state.scheduler, threading.Event()
    submit = scheduler.submit
    monkeypatch.setattr(scheduler, "submit", lambda job: (submit(job), submitted.set())[0])
    before = scheduler.metrics.cancelled
    body = json.dumps({**LONG, "stream": False}).encode()
    host, port = server.url[7:].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        assert submitted.wait(10)  # queued (and decoding soon): now the client leaves
    assert scheduler.idle.wait(10) and scheduler.metrics.cancelled == before + 1 and scheduler.batch.rows == []


def test_curl_streams_as_the_readme_shows(server):
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "06-serving.md").read_text(encoding="utf-8")
    command = guide[guide.index("curl -N"):].split("\n```")[0].replace("localhost:8000", server.url[7:])
    command = command.replace("ROMEO:", "All:")  # the tiny corpus here has no M
    assert '"model": "char-quick"' in command  # the name `gptlab serve --run runs/char-quick` serves; here, "run"
    command = command.replace('"model": "char-quick"', '"model": "run"')
    out = subprocess.run(["bash", "-c", command.replace("\\\n", " ")], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 3
    assert json.loads(events[-2])["usage"]["completion_tokens"] > 0


def test_connections_send_each_streamed_chunk_at_once_nagles_algorithm_off(server):
    """Every connection the server accepts has TCP_NODELAY set: with Nagle's algorithm on, a streamed token written
    before the client acknowledged the chunk before waits for its delayed ACK (tens of milliseconds on Linux)."""
    host, port = server.url[7:].split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")  # kept alive: the server still holds it
        held = [c.transport.get_extra_info("socket") for c in server.server.server_state.connections]
        assert held and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in held)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_shutting_down_answers_503(run_dir):
    app = make_app(load_served(run_dir, "fp32", "cpu"), Limits(**LIMITS))
    running = start_server(app)
    try:
        app.state.scheduler.close(LIMITS["grace"])  # what SIGTERM starts: no new work while in-flight requests drain
        reply = httpx.post(running.url + "/v1/completions", json={"prompt": "All:", "max_tokens": 2}, timeout=30)
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
        assert "shutting down" in reply.json()["error"]["message"]
        health = httpx.get(running.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "shutting down"
    finally:
        running.stop()


def test_sigterm_finishes_in_flight_requests_and_exits_0(run_dir):
    port = free_port()
    proc = subprocess.Popen([GPTLAB, "serve", "--run", str(run_dir), "--port", str(port), "--precision", "fp32",
                             "--grace", "20"], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _alive(url), 60)
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "All:", "max_tokens": 300, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert "data: [DONE]" in rest  # finished within the grace period
        assert proc.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        proc.kill() if proc.poll() is None else None
        proc.stderr.close()


def test_sigterm_cancels_what_the_grace_period_cannot_finish_and_exits_0(run_dir):
    port = free_port()
    proc = subprocess.Popen([GPTLAB, "serve", "--run", str(run_dir), "--port", str(port), "--precision", "fp32",
                             "--grace", "0.5", "--max-tokens", "100000"], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _alive(url), 60)
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "All:", "max_tokens": 100000, "stream": True, "n": 4}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            rest = list(lines)
        events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert not any("usage" in e for e in events)  # never finished
        assert events[-1]["error"]["message"] == "the server is shutting down"  # cancelled at the grace's end, said
        assert proc.wait(30) == 0 and time.monotonic() - start < 15
    finally:
        proc.kill() if proc.poll() is None else None
        proc.stderr.close()


def test_accept_any_model_reaches_the_server_and_the_name_served_is_printed(run_dir, monkeypatch, capsys):
    import gptlab.serve.server

    seen = []
    monkeypatch.setattr(gptlab.serve.server, "serve_run", lambda served, sock, limits, key: seen.append((served, limits)))
    for flags in ([], ["--accept-any-model"]):
        assert main(["serve", "--run", str(run_dir), "--port", "0", "--precision", "fp32", *flags]) == 0
    assert [(served.name, limits.accept_any_model) for served, limits in seen] == [("run", False), ("run", True)]
    assert 'as the model "run"' in capsys.readouterr().err


def test_a_port_in_use_is_one_line(run_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = subprocess.run([GPTLAB, "serve", "--run", str(run_dir), "--port", str(taken.getsockname()[1])],
                             capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "try another --port" in out.stderr


def _alive(url):
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
