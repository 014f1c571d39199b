"""`gptlab serve` against a live server on 127.0.0.1: the official `openai` client (completion, stream, n > 1,
logprobs, stop), each result equal to `gptlab sample` with the same seed and settings; every error status in
OpenAI's shape; a client that leaves mid-stream frees its place; /v1/models, /health, /metrics; `curl -N` as the
README shows it; SIGTERM lets an in-flight request finish and exits 0."""

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gptlab.cli import main
from gptlab.serve import Limits, load_served, make_app, start_server

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "4",
        "--eval-interval", "10", "--eval-batches", "2", "--log-interval", "10", "--precision", "fp32", "--quiet"]
LIMITS = dict(max_tokens=3000, max_n=4, max_body_bytes=4096, max_batch=4, queue=1, grace=2.0)
GPTLAB = str(Path(sys.executable).parent / "gptlab")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from conftest import tiny_run

    return tiny_run(tmp_path_factory.mktemp("serve"), 20, TINY)


@pytest.fixture(scope="module")
def server(run_dir):
    app = make_app(load_served(run_dir, "fp32", "cpu"), Limits(**LIMITS))
    running = start_server(app)
    running.app = app
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai", reason="no openai client (pip install -e '.[test]')")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


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
    texts, reasons, usage = ["", "", ""], [None] * 3, None
    for chunk in client.completions.create(model="run", prompt="First", max_tokens=50, temperature=1.0, n=3,
                                           seed=11, presence_penalty=0.5, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        usage = getattr(chunk, "usage", None) or usage
    assert texts == sample(run_dir, capsys, "First", 3, max_new_tokens=50, temperature=1.0, seed=11,
                           presence_penalty=0.5)
    assert len(set(texts)) == 3 and reasons == ["length"] * 3  # 50 tokens pass the 32-token window: it slid
    assert usage.completion_tokens == 150


def test_n_and_a_list_of_prompts_index_choices_prompt_major(client):
    got = client.completions.create(model="run", prompt=["All:", "First"], max_tokens=5, temperature=0, n=2)
    alone = [client.completions.create(model="run", prompt=p, max_tokens=5, temperature=0).choices[0].text
             for p in ("All:", "First")]
    assert alone[0] != alone[1]  # so that the order below shows
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [alone[0], alone[0], alone[1], alone[1]]


def test_stop_strings_end_a_choice_and_are_cut(client, run_dir, capsys):
    got = client.completions.create(model="run", prompt="All:", max_tokens=200, temperature=1.0, seed=3,
                                    stop=["e", "a"])
    assert got.choices[0].finish_reason == "stop" and not {"e", "a"} & set(got.choices[0].text)
    assert got.choices[0].text == sample(run_dir, capsys, "All:", max_new_tokens=200, temperature=1.0, seed=3,
                                         stop=["e", "a"])[0]


def test_logprobs_give_each_token_its_logprob_and_the_top_alternatives(client):
    got = client.completions.create(model="run", prompt="All:", max_tokens=8, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert "".join(lp.tokens) == got.choices[0].text and len(lp.token_logprobs) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0 and max(top.values()) == logprob and top[token] == logprob  # greedy
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(8)]


def test_echo_puts_the_prompt_before_the_text(client):
    got = client.completions.create(model="run", prompt="All:", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model="run", prompt="All:", max_tokens=3, temperature=0)
    assert got.choices[0].text == "All:" + plain.choices[0].text


def test_models_health_and_metrics(server, client):
    model = client.models.list().data[0]
    assert model.id == "run" and model.context_length == 32 and model.tokenizer == "char" and model.parameters > 0
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("gptlab_requests_total{status=\"200\"}", "gptlab_tokens_generated_total", "gptlab_queue_depth",
                 "gptlab_batch_size", "gptlab_time_to_first_token_seconds_count"):
        assert name in metrics
    assert "# TYPE gptlab_time_to_first_token_seconds histogram" in metrics


def error_of(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("field, value", [("temperature", "hot"), ("max_tokens", 0), ("max_tokens", 3001),
                                          ("n", 5), ("top_p", 0), ("stop", [""]), ("seed", -1), ("logprobs", 6),
                                          ("prompt", 3), ("stream", "yes"), ("best_of", 2)])
def test_a_bad_field_is_400_naming_it(server, field, value):
    body = {"model": "run", "prompt": "All:", field: value}
    assert error_of(httpx.post(server.url + "/v1/completions", json=body), 400)["param"] == field


def test_a_prompt_longer_than_the_context_or_not_json_is_400(server):
    error = error_of(httpx.post(server.url + "/v1/completions", json={"prompt": "a" * 33}), 400)
    assert error["code"] == "context_length_exceeded" and "32" in error["message"]
    assert error_of(httpx.post(server.url + "/v1/completions", content=b"{nope"), 400)["param"] is None
    assert error_of(httpx.post(server.url + "/v1/completions", json={"prompt": "€"}), 400)["param"] == "prompt"
    both = {"prompt": "All:", "echo": True, "logprobs": 2}
    assert error_of(httpx.post(server.url + "/v1/completions", json=both), 400)["param"] == "echo"


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
        url = running.url
        assert error_of(httpx.post(url + "/v1/completions", json={"prompt": "All:"}), 401)["code"] == "invalid_api_key"
        bad = {"Authorization": "Bearer wrong"}
        error_of(httpx.post(url + "/v1/completions", json={"prompt": "All:"}, headers=bad), 401)
        error_of(httpx.get(url + "/v1/models"), 401)
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.post(url + "/v1/completions", json={"prompt": "All:", "max_tokens": 2}, headers=good).json()[
            "choices"][0]["finish_reason"] == "length"
        assert httpx.get(url + "/health").status_code == 200  # liveness stays open
    finally:
        running.stop()


def wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_full_queue_is_429_with_retry_after_and_a_client_that_leaves_frees_its_place(server):
    scheduler = server.app.state.scheduler
    long = {"prompt": "All:", "max_tokens": 3000, "temperature": 1.0, "stream": True, "n": 4}  # fills the batch
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=long) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # decoding: the batch is full (4 rows of 4)
            with http.stream("POST", "/v1/completions", json={**long, "n": 1}):  # waits: the queue is full
                wait_for(lambda: scheduler.metrics.queue_depth == 1)
                third = http.post("/v1/completions", json={"prompt": "All:", "max_tokens": 2})
                error = error_of(third, 429)
                assert third.headers["retry-after"] == "1" and error["type"] == "rate_limit_error"
                before = scheduler.metrics.cancelled
        # both clients left mid-stream: their rows leave the batch, nothing waits
        wait_for(lambda: scheduler.batch.rows == [] and scheduler.metrics.queue_depth == 0)
        assert scheduler.metrics.cancelled >= before + 1 and scheduler.metrics.tokens < 4 * 3000
        ok = http.post("/v1/completions", json={"prompt": "All:", "max_tokens": 2})  # the place is free again
        assert ok.status_code == 200


def test_a_client_that_leaves_a_plain_request_cancels_it_too(server):
    scheduler = server.app.state.scheduler
    before = scheduler.metrics.cancelled
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "All:", "max_tokens": 3000, "temperature": 1.0,
                                                         "n": 4}, timeout=0.3)
    wait_for(lambda: scheduler.metrics.cancelled == before + 1 and scheduler.batch.rows == [])


def test_curl_streams_as_the_readme_shows(server):
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    command = readme[readme.index("curl -N"):].split("\n```")[0].replace("localhost:8000", server.url[7:])
    command = command.replace("ROMEO:", "All:")  # the tiny corpus here has no M
    out = subprocess.run(["bash", "-c", command.replace("\\\n", " ")], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 3
    assert json.loads(events[-2])["usage"]["completion_tokens"] > 0


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
