"""POST /v1/chat/completions of `gptlab serve` against a live server on 127.0.0.1, through the official `openai`
client: each answer equals an outside reference, the plain forward (no cache) sampled by hand (tests/helpers.py's
reference sampler, one uniform number a step from a generator seeded as documented) over the ids transformers'
`apply_chat_template` gives for the same messages with the run's exported tokenizer; greedy and seeded, n > 1,
stop strings, logprobs against the plain forward's log-softmax, streamed chunks in the chat shape; errors in
OpenAI's shape; /tokenizer_info's template rendered by jinja2 gives the ids the answers are drawn from; the
playground's Chat tab in headless Chromium (absent for a run without a template)."""

import io
import json
import re
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from helpers import chat_run, reference_greedy, reference_probs, reference_window, tiny_config
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from gptlab.checkpoint import load_run
from gptlab.config import SampleConfig
from gptlab.hf.hf_tokenizer import write_tokenizer_files
from gptlab.inference.loading import prepare_for_inference
from gptlab.model import GPT
from gptlab.serve.api import MAX_TOP_LOGPROBS, Limits
from gptlab.serve.app import Served, make_app
from gptlab.serve.server import load_served, start_server
from gptlab.tokenizer import CharTokenizer

openai = pytest.importorskip("openai", reason="no openai client (pip install -e '.[test]')")
LIMITS = dict(max_tokens=60, max_n=4, max_batch=8, queue=8)
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
TWO_TURNS = [{"role": "user", "content": "Hi, who are you?"}, {"role": "assistant", "content": "A small model."},
             {"role": "user", "content": "Say more."}]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """chat_run's run, its plain model, and its tokenizer exported and loaded by transformers (offline)."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("chat")
    run = chat_run(root, end_logit=2.0)  # answers of a few to a few dozen tokens
    loaded = load_run(run)
    (root / "hf").mkdir()
    write_tokenizer_files(root / "hf", loaded.tokenizer, loaded.model.config.block_size)
    hf = transformers.AutoTokenizer.from_pretrained(str(root / "hf"), local_files_only=True)
    ends = {hf.convert_tokens_to_ids(m) for m in ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>")}
    return SimpleNamespace(run=run, plain=loaded.model.eval(), hf=hf, ends=ends)  # a marker ends the turn too


@pytest.fixture(scope="module")
def server(chat):
    running = start_server(make_app(load_served(chat.run, "fp32", "cpu"), Limits(**LIMITS)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def plain_server():
    """A run without a chat template: a random model over a char tokenizer."""
    tokenizer = CharTokenizer("abcdefghij :")
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=tokenizer.vocab_size)).eval()
    served = Served("plain", prepare_for_inference(model, "fp32"), tokenizer, model.num_params(), lambda: model)
    running = start_server(make_app(served, Limits()))
    yield running
    running.stop()


def prompt_ids(chat, messages):
    """transformers' ids of the conversation, ending with the assistant's marker."""
    return list(chat.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@torch.no_grad()
def reference(chat, messages, temperature=1.0, seed=0, max_tokens=60, stop=()):
    """(answer, finish reason, ids drawn, end of turn included): the plain forward over the documented window each
    step, greedy by hand (reference_greedy) or drawn from reference_probs' distribution by one uniform number of a
    generator seeded with `seed` placed in its cumulative sum (next_token's documented draw)."""
    prompt, drawn = prompt_ids(chat, messages), []
    cfg = SampleConfig(max_new_tokens=max_tokens, temperature=temperature, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    block = chat.plain.config.block_size
    for _ in range(max_tokens):
        logits = chat.plain(torch.tensor([reference_window(prompt, drawn, block)]))[0][0, -1]
        if temperature == 0:
            token = reference_greedy(logits, prompt, drawn, cfg, block)
        else:
            probs, _ = reference_probs(logits.double().numpy(), np.zeros(len(logits)), cfg)
            token = int(np.searchsorted(np.cumsum(probs), torch.rand(1, generator=generator).item(), side="right"))
        drawn.append(token)
        if token in chat.ends:
            return chat.hf.decode(drawn[:-1]), "stop", drawn
        text = chat.hf.decode(drawn)
        hits = [text.index(s) for s in stop if s in text]
        if hits:
            return text[:min(hits)], "stop", drawn
    return chat.hf.decode(drawn), "length", drawn


def test_a_seeded_chat_completion_equals_the_plain_forward_sampled_by_hand(chat, client):
    got = client.chat.completions.create(model="chat-run", messages=TWO_TURNS, seed=2, temperature=1.0)
    text, reason, drawn = reference(chat, TWO_TURNS, seed=2)
    assert len(text) >= 3  # an answer of several tokens, so that a wrong step shows
    assert got.object == "chat.completion" and len(got.choices) == 1
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == text
    assert got.choices[0].finish_reason == reason == "stop"  # the end of turn, as OpenAI names it
    usage = got.usage  # the end-of-turn token is generated, so counted
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids(chat, TWO_TURNS)), len(drawn))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0  # no prefix cache: none served from it


def test_greedy_and_max_tokens_equal_the_reference(chat, client):
    for messages in (HELLO, TWO_TURNS):
        got = client.chat.completions.create(model="chat-run", messages=messages, temperature=0, max_tokens=40)
        text, reason, _ = reference(chat, messages, temperature=0, max_tokens=40)
        assert (got.choices[0].message.content, got.choices[0].finish_reason) == (text, reason)
    assert len(reference(chat, HELLO, seed=3)[0]) > 3  # the limits below cut this answer
    for limit in ({"max_completion_tokens": 3}, {"max_tokens": 3}, {"max_tokens": 50, "max_completion_tokens": 3}):
        got = client.chat.completions.create(model="chat-run", messages=HELLO, seed=3, **limit)
        assert got.choices[0].message.content == reference(chat, HELLO, seed=3, max_tokens=3)[0], limit
        assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 3


def test_n_choices_are_drawn_with_seed_plus_i(chat, client):
    got = client.chat.completions.create(model="chat-run", messages=HELLO, n=3, seed=1)
    texts = [c.message.content for c in sorted(got.choices, key=lambda c: c.index)]
    expected = [reference(chat, HELLO, seed=1 + i) for i in range(3)]
    assert texts == [t for t, _, _ in expected] and len(set(texts)) == 3
    assert got.usage.completion_tokens == sum(len(d) for _, _, d in expected)
    assert got.usage.prompt_tokens == len(prompt_ids(chat, HELLO))  # each conversation counted once


def test_a_stop_string_ends_the_answer_and_is_cut(chat, client):
    full = reference(chat, HELLO, seed=3)[0]
    stop = full[5:7]  # two characters inside the answer
    got = client.chat.completions.create(model="chat-run", messages=HELLO, seed=3, stop=[stop, "§"])
    text, reason, _ = reference(chat, HELLO, seed=3, stop=[stop, "§"])
    assert text == full[:full.index(stop)] and reason == "stop"
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (text, "stop")


@pytest.mark.parametrize("temperature, seed", [(0, 0), (1.0, 3)])
def test_logprobs_are_the_plain_forwards_log_softmax_in_the_chat_shape(chat, client, temperature, seed):
    got = client.chat.completions.create(model="chat-run", messages=HELLO, temperature=temperature, seed=seed,
                                         logprobs=True, top_logprobs=3)
    prompt, (_, _, drawn) = prompt_ids(chat, HELLO), reference(chat, HELLO, temperature, seed)
    content = got.choices[0].logprobs.content
    assert len(content) == len(drawn) - 1  # every token of the answer; the end of turn is no part of it
    with torch.no_grad():
        logits = chat.plain(torch.tensor([prompt + drawn]))[0][0, len(prompt) - 1:-1]  # what predicts each token
    logp = torch.log_softmax(logits, dim=-1)
    for step, (entry, token) in enumerate(zip(content, drawn)):
        text = chat.hf.decode([token])
        assert entry.token == text and entry.bytes == list(text.encode())
        assert entry.logprob == pytest.approx(float(logp[step, token]), abs=1e-4)
        best = logp[step].topk(3)
        assert [t.token for t in entry.top_logprobs] == [chat.hf.decode([int(i)]) for i in best.indices]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
    plain = client.chat.completions.create(model="chat-run", messages=HELLO, seed=seed, temperature=temperature)
    assert plain.choices[0].logprobs is None  # not asked for


def test_a_stream_sends_a_role_then_content_deltas_then_the_finish_reason(chat, client):
    chunks = list(client.chat.completions.create(model="chat-run", messages=TWO_TURNS, n=2, seed=2, stream=True,
                                                 stream_options={"include_usage": True}))
    expected = [reference(chat, TWO_TURNS, seed=2 + i) for i in range(2)]
    assert all(c.object == "chat.completion.chunk" and c.model == "chat-run" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")  # one id: the role's chunk's too
    for index, (text, reason, _) in enumerate(expected):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and not mine[0].delta.content  # the role first
        assert "".join(c.delta.content or "" for c in mine) == text
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + [reason]  # the last one only
        assert mine[-1].delta.content is None  # an empty last delta, as OpenAI sends
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(len(d) for _, _, d in expected)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_a_raw_stream_ends_with_done_and_sends_usage_only_when_asked(server, chat):
    body = {"model": "chat-run", "messages": HELLO, "seed": 3, "stream": True, "logprobs": True}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] for c in chunks)  # no usage chunk: stream_options did not ask for one
    pieces = [c["choices"][0] for c in chunks if c["choices"][0]["delta"].get("content")]
    text, _, drawn = reference(chat, HELLO, seed=3)
    assert "".join(p["delta"]["content"] for p in pieces) == text
    assert [p["logprobs"]["content"][0]["token"] for p in pieces] == [chat.hf.decode([t]) for t in drawn[:-1]]


def bad_request(call):
    """The 400 a call gets, as the openai client raises it; its error object in OpenAI's shape."""
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    assert caught.value.status_code == 400
    error = caught.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"]  # one line
    assert not re.search(r"\b([a-z]+)\W+\1\b", error["message"]), error["message"]  # no word said twice in a row
    return error


@pytest.mark.parametrize("messages, words", [
    ([{"role": "robot", "content": "hi"}], 'message 1 has the unknown role "robot"; use system, user or assistant'),
    ([{"role": "user", "content": "hi"}, {"role": None}], "message 2 has the unknown role null"),  # JSON's words
    ([{"content": "hi"}], "message 1 has the unknown role null"), ([{"role": True}], "unknown role true"),
    ([{"role": ["user"]}], 'unknown role ["user"]'),
    ([], 'messages must be a non-empty list of {"role", "content"} objects'),
    ([{"role": "user"}], "has no content"),
    ([{"role": "user", "content": "a <|end|> b"}], "chat marker"),
])
def test_bad_messages_are_400_in_openais_shape(client, messages, words):
    error = bad_request(lambda: client.chat.completions.create(model="chat-run", messages=messages))
    assert words in error["message"] and error["param"] == "messages"


def test_a_model_name_the_server_does_not_list_is_404_model_not_found(client):
    [listed] = client.models.list().data
    assert client.chat.completions.create(model=listed.id, messages=HELLO, max_tokens=1).model == "chat-run"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4", messages=HELLO)
    assert caught.value.response.json()["error"] == {
        "message": "The model `gpt-4` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


def test_a_conversation_over_the_context_is_400_and_one_at_the_context_is_answered(chat, client):
    # <|user|> + content + <|end|> + <|assistant|>: 61 characters make the 64 tokens of the context, 62 one more
    fits, over = [[{"role": "user", "content": "abcdefghij" * 6 + "x" * extra}] for extra in (1, 2)]
    assert (len(prompt_ids(chat, fits)), len(prompt_ids(chat, over))) == (64, 65)
    error = bad_request(lambda: client.chat.completions.create(model="chat-run", messages=over))
    assert error["code"] == "context_length_exceeded" and "65 tokens" in error["message"]
    assert error["param"] == "messages"
    got = client.chat.completions.create(model="chat-run", messages=fits, temperature=0, max_tokens=1)
    assert got.choices[0].message.content == reference(chat, fits, temperature=0, max_tokens=1)[0]
    assert got.usage.prompt_tokens == 64


@pytest.mark.parametrize("field, value", [("top_logprobs", 2), ("response_format", {"type": "json_object"}),
                                          ("tool_choice", "required"), ("n", 5),
                                          ("functions", [{"name": "f", "parameters": {}}]),
                                          ("function_call", "auto")])
def test_a_field_this_server_cannot_honour_is_400_naming_it(client, field, value):
    error = bad_request(lambda: client.chat.completions.create(model="chat-run", messages=HELLO, **{field: value}))
    assert error["param"] == field


def test_a_run_without_a_chat_template_is_400_saying_how_to_make_one(plain_server):
    client = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0)
    error = bad_request(lambda: client.chat.completions.create(model="plain", messages=HELLO))
    assert error["message"].startswith("this run's tokenizer has no chat template")
    assert "gptlab prepare --chat" in error["message"]
    info = httpx.get(plain_server.url + "/tokenizer_info").json()
    assert info["chat_template"] is None and info["chat_tokens"] == {}


def test_the_chat_route_asks_for_the_key_and_is_counted_in_the_metrics(chat):
    running = start_server(make_app(load_served(chat.run, "fp32", "cpu"), Limits(**LIMITS), api_key="s3cret"))
    try:
        url, body = running.url + "/v1/chat/completions", {"messages": HELLO, "seed": 3}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = httpx.post(url, json=body, headers=headers, timeout=30)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": "Bearer s3cret"}
        answer = httpx.post(url, json=body, headers=good, timeout=30).json()["choices"][0]["message"]["content"]
        assert answer == reference(chat, HELLO, seed=3)[0]
        assert httpx.post(url, json={"messages": []}, headers=good, timeout=30).status_code == 400
        text = httpx.get(running.url + "/metrics", headers=good, timeout=30).text
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        assert {s.labels["status"]: s.value for s in samples if s.name == "gptlab_requests_total"} == {
            "200": 1, "400": 1, "401": 2}
        [tokens] = [s.value for s in samples if s.name == "gptlab_tokens_generated_total"]
        assert tokens == len(reference(chat, HELLO, seed=3)[2])
    finally:
        running.stop()


def test_tokenizer_infos_template_renders_the_ids_the_answers_are_drawn_from(server, chat, client):
    jinja2 = pytest.importorskip("jinja2")
    info = httpx.get(server.url + "/tokenizer_info").json()
    markers = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    assert info["chat_tokens"] == {m: chat.hf.convert_tokens_to_ids(m) for m in markers}
    env = jinja2.Environment()

    def raise_exception(message):
        raise ValueError(message)

    template = env.from_string(info["chat_template"])
    text = template.render(messages=TWO_TURNS, add_generation_prompt=True, raise_exception=raise_exception)
    ids = chat.hf(text, add_special_tokens=False)["input_ids"]
    assert ids == prompt_ids(chat, TWO_TURNS) and ids[-1] == info["chat_tokens"]["<|assistant|>"]
    with pytest.raises(ValueError, match="unknown role"):
        template.render(messages=[{"role": "robot", "content": "x"}], raise_exception=raise_exception)
    # the first answer token's distribution is the plain forward's after exactly these ids
    got = client.chat.completions.create(model="chat-run", messages=TWO_TURNS, max_tokens=1, seed=2,
                                         logprobs=True, top_logprobs=5)  # (greedy would end the turn at once)
    with torch.no_grad():
        best = torch.log_softmax(chat.plain(torch.tensor([ids]))[0][0, -1], dim=-1).topk(5)
    top = got.choices[0].logprobs.content[0].top_logprobs
    assert [t.token for t in top] == [chat.hf.decode([int(i)]) for i in best.indices]
    assert [t.logprob for t in top] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert got.usage.prompt_tokens == len(ids)


# ---- the playground's Chat tab, in headless Chromium ---------------------------------------------------------------

def wait_status(view, selector):
    """Poll until the status starts with "done" or "error" (the page's CSP forbids wait_for_function's eval)."""
    deadline = time.monotonic() + 30
    while not view.locator(selector).inner_text().startswith(("done", "error")):
        assert time.monotonic() < deadline, view.locator(selector).inner_text()
        time.sleep(0.05)
    return view.locator(selector).inner_text()


@pytest.mark.device_path("browser")
def test_the_playground_chats_two_turns_streamed_from_the_server_alone(server, chat, browser):
    ctx = browser.new_context(viewport={"width": 1100, "height": 800})
    requests, errors = [], []
    ctx.on("request", lambda r: requests.append(r.url))
    view = ctx.new_page()
    view.on("pageerror", lambda e: errors.append(str(e)))
    view.goto(server.url + "/")
    assert view.locator("#chat-panel").is_hidden()
    view.click("#tab-chat")
    assert view.locator("#complete-panel").is_hidden() and view.locator("#chat-panel").is_visible()
    for name, value in (("#temperature", "1"), ("#seed", "3"), ("#max_tokens", "60"), ("#system", "Be brief.")):
        view.fill(name, value)
    view.fill("#chat-input", "Hello there!")
    view.click("#send")
    assert wait_status(view, "#chat-status") == f"done: stop, {len(reference(chat, HELLO, seed=3)[2])} tokens"
    first = reference(chat, HELLO, seed=3)[0]
    view.fill("#chat-input", "And then?")
    view.press("#chat-input", "Enter")
    wait_status(view, "#chat-status")
    conversation = [*HELLO, {"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    second = reference(chat, conversation, seed=3)[0]
    bubbles = view.locator("#chat-log .msg .text").all_inner_texts()
    assert bubbles == ["Hello there!", first, "And then?", second] and first and second
    shot = Image.open(io.BytesIO(view.screenshot(full_page=True))).convert("RGB")
    shot.save(chat.run.parent / "chat-tab.png")
    view.click("#reset")
    assert view.locator("#chat-log .msg").count() == 0
    ctx.close()
    assert not errors, errors
    assert requests and all(u.startswith((server.url + "/", "about:")) for u in requests), requests
    assert sum(u == server.url + "/v1/chat/completions" for u in requests) == 2
    colours = shot.getcolors(1 << 24)
    assert len(colours) > 50 and max(n for n, _ in colours) < 0.95 * shot.width * shot.height  # not blank


@pytest.mark.device_path("browser")
def test_the_playground_has_no_chat_tab_without_a_template(plain_server, browser):
    view = browser.new_page()
    errors = []
    view.on("pageerror", lambda e: errors.append(str(e)))
    view.goto(plain_server.url + "/")
    assert view.locator("#tab-chat").count() == 0 and view.locator("#chat-panel").count() == 0
    assert view.locator("#prompt").is_visible() and view.locator("#model").inner_text() == "plain"
    view.close()
    assert not errors, errors


def test_the_openai_client_s_answers_equal_gptlab_chat_s_with_the_same_seed_and_settings(chat, client):
    """Two doors to one conversation: `gptlab chat` in the terminal (its first answer drawn with --seed) and the
    server's chat route (seed), the same settings."""
    import subprocess
    import sys
    from pathlib import Path

    for seed in (1, 4):
        proc = subprocess.run([str(Path(sys.executable).parent / "gptlab"), "chat", "--run", str(chat.run), "--system",
                               "Be brief.", "--seed", str(seed), "--temperature", "0.9", "--top-k", "20",
                               "--max-new-tokens", "30", "--precision", "fp32", "--device", "cpu"],
                              input="Hello there!\n", capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        answer = proc.stdout.split("assistant> ", 1)[1].split("\nyou> ")[0].rstrip("\n")
        got = client.chat.completions.create(model="chat-run", messages=HELLO, seed=seed, temperature=0.9,
                                             max_tokens=30, extra_body={"top_k": 20})
        assert got.choices[0].message.content == answer and len(answer) >= 2


def test_the_readme_s_chat_client_example_runs_against_a_live_server(server, capsys):
    """The chat guide's openai example, as written, but for the server's address: an answer, then the same streamed."""
    import re
    from pathlib import Path

    guide = Path(__file__).resolve().parents[1] / "docs" / "guides" / "07-fine-tuning-and-chat.md"
    [code] = [b for b in re.findall(r"```python\n(.*?)```", guide.read_text(encoding="utf-8"), re.S)
              if "chat.completions" in b]
    assert code.count('model="chat"') == 2  # `gptlab serve --run runs/chat` serves "chat"; here, "chat-run"
    code = code.replace("http://localhost:8000", server.url).replace('model="chat"', 'model="chat-run"')
    exec(compile(code, str(guide), "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    answer, reason, total = printed[0].rsplit(" ", 2)
    assert reason in ("stop", "length") and int(total) > 0
    assert printed[1] == answer  # the stream with the same seed writes the same answer


@pytest.mark.parametrize("top", [MAX_TOP_LOGPROBS - 1, MAX_TOP_LOGPROBS, MAX_TOP_LOGPROBS + 1])
def test_top_logprobs_up_to_openais_limit_are_answered_and_one_past_it_is_refused(client, top):
    """OpenAI's limit, 20 alternatives per token: 19 and 20 are answered with that many, each token's own logprob
    among them where it ranks; 21 is a 400 naming top_logprobs."""
    call = lambda: client.chat.completions.create(model="chat-run", messages=HELLO, max_tokens=2, temperature=0,  # noqa: E731
                                                  logprobs=True, top_logprobs=top)
    if top > MAX_TOP_LOGPROBS:
        assert bad_request(call)["param"] == "top_logprobs"
        return
    for token in call().choices[0].logprobs.content:
        assert len(token.top_logprobs) == top
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy: the token is the first
