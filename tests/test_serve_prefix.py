"""The exact prefix cache through the whole path (issue 44): `gptlab serve` with the cache (the default budget, and
one of a few blocks under a larger working set) against `gptlab serve --prefix-cache-mb 0`, the same requests to
each, the raw response bodies byte for byte alike but for what must differ (ids, times, cached_tokens), in fp32,
bf16 and int8; /metrics under memory pressure; `gptlab chat` turn by turn with the default cache against
`--prefix-cache-mb 0`, piped and in a real terminal (tmux). The reference is the server and the chat without the
cache; what the cache serves is worked out by hand from its rule (whole chunks of PROMPT_CHUNK tokens before a
prompt's last token, exact prefixes, least recently used out)."""

import itertools
import json
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from helpers import SHELL, TMUX, Pane, last_line, prompts
from prometheus_client.parser import text_string_to_metric_families

import gptlab
from gptlab.cli import main
from gptlab.config import ModelConfig
from gptlab.engine import RunningBatch, one_thread
from gptlab.errors import GptlabError
from gptlab.inference.loading import prepare_for_inference
from gptlab.inference.prefix_cache import PROMPT_CHUNK
from gptlab.model import GPT
from gptlab.runtime import bf16_supported
from gptlab.serve.api import Limits
from gptlab.serve.app import Served, make_app
from gptlab.serve.server import start_server
from gptlab.tokenizer import CharTokenizer, ChatTokenizer

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?"  # one token a character: a text's length is its prompt's
SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 320}  # prompts of up to 5 chunks of 64
SYSTEMS = (127, 192, 129)  # shared system prompts of 64k - 1, 64k and 64k + 1 tokens
LONGEST = 300  # a conversation's prompt past this starts again from a system prompt
VARYING = [(re.compile(rb'"id": ?"(?:chat)?cmpl-[0-9a-f]+"'), b'"id":""'),
           (re.compile(rb'"created": ?\d+'), b'"created":0'),
           (re.compile(rb'"cached_tokens": ?\d+'), b'"cached_tokens":0')]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():  # the scheduler's thread too: torch's threads are the process's
    with one_thread():
        yield


def served(precision):
    """A GPT over a char vocabulary with the chat markers, moved away from its init (matrices x 10, vectors by
    seeded noise) so that its next token depends on the context, prepared in `precision`."""
    tokenizer = ChatTokenizer(CharTokenizer(ALPHABET))
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, dropout=0.0, **SHAPE)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    prepared = prepare_for_inference(model, precision)
    return Served("prefix", prepared, tokenizer, model.num_params(), lambda: model)


@pytest.fixture(scope="module")
def servers():
    """servers(precision, mb): a live server of `served(precision)` with `Limits(prefix_cache_mb=mb)` (None: the
    default budget), started once for the module."""
    running = {}

    def get(precision, mb=None):
        if (precision, mb) not in running:
            limits = Limits() if mb is None else Limits(prefix_cache_mb=mb)
            running[precision, mb] = start_server(make_app(served(precision), limits))
        return running[precision, mb]

    yield get
    for server in running.values():
        server.stop()


def words(rng, n):
    """`n` characters of words drawn by `rng`."""
    text = ""
    while len(text) < n:
        text += "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 8))) + \
            rng.choice("    ,.!?")
    return text[:n]


def settings(rng, chat):
    """The sampling fields of one request: greedy or seeded sampling, n, logprobs (0 or 3), some streamed."""
    body = {"max_tokens": rng.randint(3, 12), "n": rng.choice([1, 1, 1, 2, 3])}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=rng.choice([0.7, 1.0, 1.4]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(999))
    top = rng.choice([None, None, 0, 3])
    if top is not None:
        body.update({"logprobs": True, "top_logprobs": top} if chat else {"logprobs": top})
    if rng.random() < 0.1:
        body["stream"] = True
        body.update({"stream_options": {"include_usage": True}} if chat else {})
    return body


def plan(count=200, seed=0):
    """`count` requests in waves (a wave's requests are sent together, so their rows share the batch): each an
    item (kind, conversation, new text, system prompt, body). Kinds: "shared" (a system prompt + a user text, some
    echoed, some two prompts, some ending one before, at or one past a chunk's edge, the system prompt alone
    among them), "turn" (conversation c's last prompt + its answer + new text), "chat" (a chat completion
    continuing conversation c's messages), "unrelated"."""
    rng, waves, made = random.Random(seed), [], 0
    while made < count:
        wave, busy = [], set()
        for _ in range(min(rng.choice([1, 1, 1, 4, 6]), count - made)):
            kind = rng.choice(["shared"] * 4 + ["turn"] * 3 + ["chat"] * 2 + ["unrelated"])
            c = rng.randrange(4)
            if kind in ("turn", "chat") and (kind, c) in busy:
                kind = "unrelated"
            busy.add((kind, c))
            body = settings(rng, kind == "chat")
            if kind == "shared" and rng.random() < 0.2:
                body["echo"] = True
            s, n = rng.randrange(3), rng.randint(8, 40)
            if kind == "shared" and rng.random() < 0.4:  # a prompt of 64k - 1, 64k or 64k + 1 tokens
                n = (-SYSTEMS[s] % PROMPT_CHUNK + rng.choice([-1, 0, 1])) % PROMPT_CHUNK
            wave.append((kind, c, words(rng, n), s, body))
        waves.append(wave)
        made += len(wave)
    return waves


def request(item, state, systems):
    """(path, body) of `item` given a server's `state` (its conversations so far)."""
    kind, c, text, s, body = item
    if kind == "chat":
        messages = state.get(("chat", c)) or [{"role": "system", "content": systems[s]}]
        if sum(len(m["content"]) + 2 for m in messages) + len(text) > LONGEST - 20:
            messages = [{"role": "system", "content": systems[s]}]
        state["chat", c] = messages + [{"role": "user", "content": text}]
        return "/v1/chat/completions", {**body, "messages": state["chat", c]}
    if kind == "turn":
        prompt = state.get(("turn", c), systems[s]) + text
        state["turn", c] = prompt = prompt if len(prompt) <= LONGEST else systems[s] + text
    elif kind == "shared":
        prompt = systems[s] + text
        prompt = [prompt, systems[(s + 1) % 3] + text] if body.get("n") == 1 and len(text) % 4 == 0 else prompt
    else:
        prompt = words(random.Random(text), 60 + 5 * len(text))
    return "/v1/completions", {**body, "prompt": prompt}


def normal(raw):
    """A raw body with its ids, times and cached_tokens made alike: what may differ between the two servers."""
    for pattern, fixed in VARYING:
        raw = pattern.sub(fixed, raw)
    return raw


def post(http, path, body):
    """The raw body of the answer (a stream's: every event as sent), checked to be 200."""
    with http.stream("POST", path, json=body) as reply:
        raw = reply.read()
    assert reply.status_code == 200, raw
    return raw


def objects(raw, stream):
    """The JSON objects of a body: the one, or each event's."""
    if not stream:
        return [json.loads(raw)]
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


def answer(objs, chat):
    """Choice 0's text, from the one object or across a stream's."""
    if chat:
        return "".join((c.get("message") or c.get("delta") or {}).get("content") or "" for o in objs
                       for c in o["choices"] if c["index"] == 0)
    return "".join(c["text"] for o in objs for c in o["choices"] if c["index"] == 0)


def drive(url, waves, systems):
    """Every wave's requests sent to the server at `url` (a wave's together, from threads), each conversation
    continued from this server's own answers; per request: its raw body normalised, and its usage."""
    state, bodies, usages = {}, [], []
    with httpx.Client(base_url=url, timeout=30) as http, ThreadPoolExecutor(6) as pool:
        for wave in waves:
            asked = [request(item, state, systems) for item in wave]
            raws = list(pool.map(lambda a: post(http, *a), asked))
            for (kind, c, *_), (path, body), raw in zip(wave, asked, raws):
                objs = objects(raw, body.get("stream", False))
                usages.append(next(o["usage"] for o in objs if o.get("usage")))
                bodies.append(normal(raw))
                said = answer(objs, kind == "chat")
                if kind == "chat":
                    state["chat", c] = state["chat", c] + [{"role": "assistant", "content": said}]
                elif kind == "turn":
                    state["turn", c] = body["prompt"] + said
    return bodies, usages


@pytest.mark.device_path("fused decode (native)")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_two_hundred_mixed_requests_are_answered_byte_for_byte_alike_with_the_cache_and_without(
        fused_kernel, servers, precision):
    """`gptlab serve` with the default --prefix-cache-mb against --prefix-cache-mb 0."""
    if precision == "bf16" and not bf16_supported(torch.device("cpu")):
        pytest.skip("no native bf16 on this CPU")
    if not served(precision).model.fused:
        pytest.skip(f"no fused {precision} step on this CPU: rows beside others are bitwise alike only on it")
    rng = random.Random(1)
    systems = [words(rng, n) for n in SYSTEMS]
    waves = plan()
    on, on_usage = drive(servers(precision).url, waves, systems)
    off, off_usage = drive(servers(precision, 0).url, waves, systems)
    assert len(on) == len(off) == 200
    for i, (a, b) in enumerate(zip(on, off)):
        assert a == b, f"request {i}"
    assert [u["prompt_tokens"] for u in on_usage] == [u["prompt_tokens"] for u in off_usage]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in on_usage]
    assert all(c % PROMPT_CHUNK == 0 for c in cached) and sum(cached) > 0.3 * sum(u["prompt_tokens"] for u in
                                                                                   on_usage)
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 0 for u in off_usage)


# ---- speculation through the server ------------------------------------------------------------------------------------------------

def by_choice(raw):
    """A response body as it is; a stream's events grouped by choice, each choice's in order (a row that drew
    several tokens at once sends them together: the choices of n > 1 interleave otherwise)."""
    if not raw.startswith(b"data:"):
        return raw
    groups = {}
    for event in raw.split(b"\n\n"):
        choice = re.search(rb'"index": ?(\d+)', event)
        groups.setdefault(choice.group(1) if choice else b"", []).append(event)
    return groups

@pytest.mark.device_path("fused decode (native)")
def test_a_server_that_speculates_answers_two_hundred_mixed_requests_byte_for_byte_as_one_that_does_not(fused_kernel):
    """`gptlab serve --speculate auto` (and the default prefix cache) against `--speculate off --prefix-cache-mb 0`:
    the 200 mixed requests above (shared prompts, conversations turn by turn, greedy and
    seeded, n > 1, logprobs, echo, streams, concurrent rows), raw bodies alike; /metrics counts what was proposed
    and kept."""
    model = served("fp32")
    assert model.model.fused
    rng = random.Random(1)
    systems = [words(rng, n) for n in SYSTEMS]
    running = [start_server(make_app(model, Limits(speculate="auto"))),
               start_server(make_app(model, Limits(prefix_cache_mb=0)))]
    try:
        on, _ = drive(running[0].url, plan(), systems)
        off, _ = drive(running[1].url, plan(), systems)
        assert len(on) == len(off) == 200
        for i, (a, b) in enumerate(zip(on, off)):
            assert by_choice(a) == by_choice(b), f"request {i}"
        assert sum(a != b for a, b in zip(on, off)) <= sum(a.startswith(b"data:") for a in on)  # streams only
        metrics = [scrape(r.url) for r in running]
    finally:
        for r in running:
            r.stop()
    proposed, kept = (metrics[0][f"gptlab_speculative_{n}_tokens_total"] for n in ("proposed", "kept"))
    assert proposed > kept > 0 and metrics[1]["gptlab_speculative_proposed_tokens_total"] == 0
    with pytest.raises(GptlabError, match="--speculate must be one of auto, off, not 'yes'"):
        Limits(speculate="yes")


def scrape(url):
    """/metrics' samples by name."""
    text = httpx.get(url + "/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_cache_under_memory_pressure_evicts_stays_exact_and_keeps_within_its_budget(servers):
    """--prefix-cache-mb of 5 blocks (a block: keys and values of 64 tokens, 2 x n_layer x n_embd x 64 fp32
    numbers) under 8 prefixes of 2 blocks each, each asked twice in a row, the 8 twice over: the second of each
    pair reuses both its blocks, the first never does (7 other prefixes, 14 blocks, came since)."""
    block = 2 * SHAPE["n_layer"] * SHAPE["n_embd"] * PROMPT_CHUNK * 4
    budget = 5 * block
    small, plain = servers("fp32", budget / 2 ** 20), servers("fp32", 0)
    rng = random.Random(2)
    prefixes = [words(rng, 140) for _ in range(8)]
    asked = [(p + words(rng, 20 + k), k) for _ in range(2) for p in prefixes for k in range(2)]
    got = {}
    for url in (small.url, plain.url):
        with httpx.Client(base_url=url, timeout=60) as http:
            for n, (prompt, k) in enumerate(asked):
                body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2 * k}
                raw = post(http, "/v1/completions", body)
                got.setdefault(url, []).append(raw)
                if url == small.url:
                    seen = scrape(url)
                    assert seen["gptlab_prefix_cache_bytes"] <= budget, f"request {n}"
                    assert seen["gptlab_prefix_cache_budget_bytes"] == budget
    usage = [json.loads(raw)["usage"] for raw in got[small.url]]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == [0, 128] * 16
    for a, b in zip(got[small.url], got[plain.url]):
        assert normal(a) == normal(b)
    seen = scrape(small.url)
    assert seen["gptlab_prefix_cache_evictions_total"] == 16 * 2 - seen["gptlab_prefix_cache_blocks"] > 0
    assert seen["gptlab_prefix_cache_bytes"] == seen["gptlab_prefix_cache_blocks"] * block <= budget
    assert seen["gptlab_prefix_cache_hit_ratio"] == pytest.approx(16 * 128 / sum(u["prompt_tokens"] for u in usage))
    assert seen["gptlab_prefix_cache_hit_ratio"] > 0


# ---- gptlab chat ----------------------------------------------------------------------------------------------

def long_chat_run(root):
    """A run folder like helpers.chat_run's (a char vocabulary with the chat markers, the end of turn's logit
    raised) with a context of 320, every weight moved by seeded noise of 0.3 (test_chat_cli's talking_run), so that
    its greedy answers depend on the whole conversation and end by themselves."""
    from gptlab import rundir
    from gptlab.checkpoint import save_checkpoint
    from gptlab.config import TrainConfig, to_dict

    tokenizer = ChatTokenizer(CharTokenizer(ALPHABET))
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=320, n_layer=1, n_head=2, n_embd=64, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        direction = torch.nn.functional.normalize(torch.randn(64), dim=0)
        model.transformer.ln_f.bias.add_(direction)
        model.transformer.wte.weight[tokenizer.end_id] += 1.0 * direction
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=noise))
    run, train_cfg = root / "long-chat-run", TrainConfig(max_steps=1)
    rundir.init_run(run, cfg, train_cfg, tokenizer, {"preset": "char-quick"})
    state = rundir.TrainingState(model=to_dict(cfg), train=to_dict(train_cfg), best_val_loss=1.0, val_loss=1.0)
    save_checkpoint(run, "best", 1, model, state, extra_files={"tokenizer.json": (run / "tokenizer.json").read_bytes()})
    return run


JOIN = RunningBatch.join


def chat(monkeypatch, capsys, run, lines, *flags):
    """`gptlab chat` in this process over piped `lines`: (stdout, [(prompt length, cached) per answer])."""
    import io

    seen, real = [], JOIN

    def join(self, prompt, cfg, num_samples=1, prompt_logits=False, **more):  # wrapped, not replaced
        rows = real(self, prompt, cfg, num_samples, prompt_logits, **more)
        seen.append((len(prompt), rows[0].cached))
        return rows

    monkeypatch.setattr(RunningBatch, "join", join)
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{x}\n" for x in lines)))
    code = main(["chat", "--run", str(run), "--device", "cpu", "--precision", "fp32", *flags])
    out = capsys.readouterr()
    assert code == 0 and "Traceback" not in out.err, out.err
    return out.out, seen


def test_a_chat_continued_turn_by_turn_answers_as_without_the_cache_and_reuses_the_conversation(
        tmp_path, monkeypatch, capsys):
    """`gptlab chat` with the default --prefix-cache-mb against --prefix-cache-mb 0, greedy and seeded: the same
    transcript; turn k reuses the whole chunks of turn k-1's prompt before its own last token."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as `make test`'s workers have it: chat's set_threads keeps one
    run = long_chat_run(tmp_path)
    rng = random.Random(3)
    lines = [words(rng, rng.randint(35, 48)).strip() for _ in range(5)]
    for flags in (["--temperature", "0"], ["--temperature", "0.9", "--top-p", "0.9", "--seed", "5"]):
        flags += ["--max-new-tokens", "16"]
        on, with_cache = chat(monkeypatch, capsys, run, lines, *flags)
        off, without = chat(monkeypatch, capsys, run, lines, *flags, "--prefix-cache-mb", "0")
        assert on == off
        assert len(re.findall(r"^assistant> \S", on, re.MULTILINE)) >= 3, on  # answers that say something
        lengths = [n for n, _ in with_cache]
        assert lengths == [n for n, _ in without] and lengths[-1] > 3 * PROMPT_CHUNK
        reused = [0] + [PROMPT_CHUNK * min(before // PROMPT_CHUNK, (now - 1) // PROMPT_CHUNK)
                        for before, now in itertools.pairwise(lengths)]  # the rule, by hand
        assert [c for _, c in with_cache] == reused and reused[-1] >= 2 * PROMPT_CHUNK
        assert [c for _, c in without] == [0] * 5


SPY = """import atexit, json, sys
from gptlab.cli import main
from gptlab.engine import RunningBatch
seen, real = [], RunningBatch.join
def join(self, prompt, cfg, *rest, **more):  # wrapped, not replaced: (prompt length, tokens served by the cache)
    rows = real(self, prompt, cfg, *rest, **more)
    seen.append([len(prompt), rows[0].cached])
    return rows
RunningBatch.join = join
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(seen)))
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (`make browser` installs it: the Makefile's APT_TOOLS)")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_a_chat_in_a_terminal_answers_alike_with_the_cache_and_without(tmp_path, precision):
    """`gptlab chat` in a real terminal (a tmux pane: a tty, keys typed, the screen read), seeded sampling, five turns
    that outgrow three chunks: the screen's transcript with the default --prefix-cache-mb equals the one with
    --prefix-cache-mb 0, in each precision; the process with the cache reused each turn's whole chunks (its joins,
    recorded in the process by a wrapper of RunningBatch.join), the one without reused none."""
    if precision == "bf16" and not bf16_supported(torch.device("cpu")):
        pytest.skip("no native bf16 on this CPU")
    run = long_chat_run(tmp_path)
    rng = random.Random(3)
    lines = [words(rng, rng.randint(35, 48)).strip() for _ in range(5)]
    (tmp_path / "spy.py").write_text(SPY)
    src = Path(gptlab.__file__).resolve().parents[1]
    panes = {"on": Pane(), "off": Pane()}
    try:
        for name, pane in panes.items():
            pane.wait(lambda s: last_line(s) == SHELL, "the shell's prompt")
            pane.run(f"env PYTHONPATH={src} OMP_NUM_THREADS=1 {sys.executable} {tmp_path / 'spy.py'} "
                     f"{tmp_path / name}.json chat --run {run} --device cpu --precision {precision} --temperature 0.9 "
                     f"--top-p 0.9 --seed 5 --max-new-tokens 16" + (" --prefix-cache-mb 0" if name == "off" else ""))
        for n, line in enumerate([None, *lines], 1):
            for pane in panes.values():  # the two chats answer side by side
                pane.type(line) if line is not None else None
            for pane in panes.values():
                pane.wait(lambda s, n=n: prompts(s) == n, f"prompt {n}")
        for pane in panes.values():
            pane.type("/exit")
        screens = {name: pane.wait(lambda s: last_line(s) == SHELL, "the shell's prompt after /exit")
                   for name, pane in panes.items()}
    finally:
        for pane in panes.values():
            pane.close()
    shown = {name: [x.rstrip() for x in s.splitlines() if x.startswith(("you>", "assistant>"))]
             for name, s in screens.items()}
    assert shown["on"] == shown["off"] and "Traceback" not in screens["on"] + screens["off"]
    assert [x for x in shown["on"] if x.startswith("you>")] == [f"you> {x}" for x in lines] + ["you> /exit"]
    assert sum(x.startswith("assistant> ") and len(x) > 11 for x in shown["on"]) >= 3, shown["on"]  # they say things
    with_cache, without = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("on", "off"))
    lengths = [n for n, _ in with_cache]
    assert lengths == [n for n, _ in without] and len(lengths) == 5 and lengths[-1] > 3 * PROMPT_CHUNK
    reused = [0] + [PROMPT_CHUNK * min(before // PROMPT_CHUNK, (now - 1) // PROMPT_CHUNK)
                    for before, now in itertools.pairwise(lengths)]  # the rule, by hand
    assert [c for _, c in with_cache] == reused and reused[-1] >= 2 * PROMPT_CHUNK
    assert [c for _, c in without] == [0] * 5
