"""The scheduler (gptlab.serve.scheduler) driven directly, without HTTP: a job's events (text, token ids, finish
reasons, logprobs, usage) against the engine alone (`generate_batch(..., batch_invariant=True)`, `gptlab sample`'s
path), the plain forward and the tokenizer; which jobs the queue takes (counted by hand); cancelled jobs leaving;
closing with a grace period; a failing step; the /metrics text written out by hand."""

import logging
import math
import queue
import threading
import time

import pytest
import torch
from helpers import eot_model, tiny_config

from gptlab.config import SampleConfig
from gptlab.engine import generate_batch, one_thread
from gptlab.inference.loading import prepare_for_inference
from gptlab.model import GPT
from gptlab.serve.api import CompletionRequest
from gptlab.serve.scheduler import Job, Metrics, Scheduler, top_logprobs
from gptlab.tokenizer import CharTokenizer, GPT2Tokenizer

SHAPE = {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 65, "block_size": 32}  # as test_serve_batching's
TOKENIZER = CharTokenizer("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n.,:;!?éü€—ß")
assert TOKENIZER.vocab_size == 65


@pytest.fixture(autouse=True)
def _one_thread():  # as test_engine's
    with one_thread():
        yield


def gpt():
    """As test_serve_batching's `prepared`, unprepared: its matrices x 10 make the context matter."""
    torch.manual_seed(0)
    model = GPT(tiny_config(**SHAPE)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0 if p.dim() == 2 else 1.0)
    return model


@pytest.fixture(scope="module")
def model():
    return prepare_for_inference(gpt(), "fp32")


class Direct:
    """Stands in for the server's event loop: runs each callback at once (in the scheduler's thread)."""

    def call_soon_threadsafe(self, callback, *args):
        callback(*args)


def job(prompts, n=1, logprobs=None, tokenizer=TOKENIZER, **settings):
    cfg = SampleConfig(**{"temperature": 0.0, "max_new_tokens": 5, **settings})
    req = CompletionRequest(prompts=prompts, cfg=cfg, n=n, logprobs=logprobs,
                            ids=[tokenizer.encode(p) for p in prompts])
    return Job(req, Direct(), queue.Queue())


def events(job):
    """The job's events up to its last ("done" or "error")."""
    out = []
    while not out or out[-1][0] not in ("done", "error"):
        out.append(job.events.get(timeout=20))
    return out


def by_choice(evs, size):
    """Each choice's text, token ids and finish reasons (one per token event)."""
    texts, ids, reasons = [""] * size, [[] for _ in range(size)], [[] for _ in range(size)]
    for kind, choice, text, token, _, reason in (e for e in evs if e[0] == "token"):
        texts[choice] += text
        ids[choice].append(token)
        reasons[choice].append(reason)
    return texts, ids, reasons


def alone(model, prompt, cfg, n=1):
    """The engine's rows for `prompt` alone: what `gptlab sample` gives."""
    return [list(r) for r in zip(*generate_batch(model, [TOKENIZER.encode(prompt)], cfg, n, batch_invariant=True))]


@pytest.fixture
def make(model):
    """Schedulers over `model`, each stopped at the test's end (started here if the test did not)."""
    made = []

    def make(max_batch=4, queue=2, tokenizer=TOKENIZER, over=model):
        made.append(Scheduler(over, tokenizer, max_batch, queue))
        return made[-1]
    yield make
    for scheduler in made:
        if not scheduler._thread.is_alive() and scheduler._thread.ident is None:
            scheduler.start()
        scheduler.stop(0)


# ---- /metrics and logprobs, by hand ------------------------------------------------------------------------------

EXPOSITION = """\
# HELP gptlab_requests_total Completion requests answered, by HTTP status.
# TYPE gptlab_requests_total counter
gptlab_requests_total{status="200"} 2
gptlab_requests_total{status="429"} 1
gptlab_requests_total{status="503"} 1
# HELP gptlab_tokens_generated_total Tokens generated, all requests.
# TYPE gptlab_tokens_generated_total counter
gptlab_tokens_generated_total 7
# HELP gptlab_requests_cancelled_total Requests whose client left before the end.
# TYPE gptlab_requests_cancelled_total counter
gptlab_requests_cancelled_total 1
# HELP gptlab_queue_depth Requests waiting for a place in the batch.
# TYPE gptlab_queue_depth gauge
gptlab_queue_depth 2
# HELP gptlab_batch_size Sequences decoded together at the last step.
# TYPE gptlab_batch_size gauge
gptlab_batch_size 3
# HELP gptlab_time_to_first_token_seconds From a request's arrival to its first token.
# TYPE gptlab_time_to_first_token_seconds histogram
gptlab_time_to_first_token_seconds_bucket{le="0.01"} 1
gptlab_time_to_first_token_seconds_bucket{le="0.025"} 1
gptlab_time_to_first_token_seconds_bucket{le="0.05"} 1
gptlab_time_to_first_token_seconds_bucket{le="0.1"} 1
gptlab_time_to_first_token_seconds_bucket{le="0.25"} 1
gptlab_time_to_first_token_seconds_bucket{le="0.5"} 3
gptlab_time_to_first_token_seconds_bucket{le="1.0"} 3
gptlab_time_to_first_token_seconds_bucket{le="2.5"} 3
gptlab_time_to_first_token_seconds_bucket{le="5.0"} 3
gptlab_time_to_first_token_seconds_bucket{le="10.0"} 3
gptlab_time_to_first_token_seconds_bucket{le="30.0"} 3
gptlab_time_to_first_token_seconds_bucket{le="+Inf"} 4
gptlab_time_to_first_token_seconds_sum 31.610000
gptlab_time_to_first_token_seconds_count 4
"""


def test_metrics_are_prometheus_text_with_cumulative_buckets_counted_by_hand():
    metrics = Metrics()
    for status in (503, 200, 429, 200):
        metrics.count(status)
    metrics.tokens, metrics.cancelled, metrics.queue_depth, metrics.batch_rows = 7, 1, 2, 3
    for seconds in (0.01, 0.3, 0.3, 31.0):  # 0.01 on a bound counts in it (le); 31 beyond the last: +Inf only
        metrics.observe_ttft(seconds)
    assert metrics.text() == EXPOSITION  # sum 0.01 + 0.3 + 0.3 + 31 = 31.61


def test_top_logprobs_are_the_log_softmax_rounded_to_5_places():
    tokenizer = CharTokenizer("xé€")  # ids: x 0, é 1, € 2
    logits = torch.tensor([[0.5, 1.2, 3.0]])
    lse = math.log(math.exp(0.5) + math.exp(1.2) + math.exp(3.0))
    assert top_logprobs(logits, 1, 2, tokenizer) == {
        "token": "é", "logprob": round(1.2 - lse, 5), "top": {"€": round(3.0 - lse, 5), "é": round(1.2 - lse, 5)},
        "bytes": [0xC3, 0xA9], "ranked": [{"token": "€", "logprob": round(3.0 - lse, 5), "bytes": [0xE2, 0x82, 0xAC]},
                                          {"token": "é", "logprob": round(1.2 - lse, 5), "bytes": [0xC3, 0xA9]}]}
    assert top_logprobs(logits, 0, 0, tokenizer) == {"token": "x", "logprob": round(0.5 - lse, 5), "top": {},
                                                     "bytes": [0x78], "ranked": []}
    assert all(round(v - lse, 6) != round(v - lse, 5) for v in (0.5, 1.2, 3.0))  # a 6th place would show


# ---- a job's events against the engine alone -----------------------------------------------------------------------

def test_a_job_gives_each_choice_the_engines_tokens_text_and_usage_prompt_major(make, model):
    cfg = {"temperature": 0.9, "top_p": 0.9, "seed": 7, "max_new_tokens": 6}
    prompts = ["ab€", "é c"]
    reference = [r for p in prompts for r in alone(model, p, SampleConfig(**cfg), 2)]  # choice p * n + i
    scheduler = make(max_batch=4, queue=1)
    scheduler.start()
    arrived = time.perf_counter()
    mine = job(prompts, n=2, **cfg)
    assert mine.arrived >= arrived and scheduler.submit(mine)
    evs = events(mine)
    waited = time.perf_counter() - arrived
    texts, ids, reasons = by_choice(evs, 4)
    assert ids == reference and len(set(map(tuple, ids))) == 4
    assert texts == [TOKENIZER.decode(r) for r in reference]
    assert reasons == [[None] * 5 + ["length"]] * 4
    assert all(e[4] is None for e in evs[:-1])  # no logprobs asked for
    assert evs[-1] == ("done", {"prompt_tokens": 6, "completion_tokens": 24, "total_tokens": 30})
    assert scheduler.idle.wait(10) and scheduler.batch.rows == []
    metrics = scheduler.metrics
    assert (metrics.tokens, metrics.batch_rows, metrics.queue_depth, metrics.cancelled) == (24, 4, 0, 0)
    assert sum(metrics.ttft) == 1 and 0 <= metrics.ttft_sum <= waited  # one first token, after its arrival


def test_logprobs_are_the_plain_forwards_and_zero_gives_no_alternatives(make):
    plain = gpt()
    scheduler = make()
    scheduler.start()
    two, none = job(["Hi ü"], logprobs=2, max_new_tokens=3), job(["Hi ü"], logprobs=0, max_new_tokens=3)
    assert scheduler.submit(two) and scheduler.submit(none)
    got, zero = events(two)[:-1], events(none)[:-1]
    context = TOKENIZER.encode("Hi ü")
    for (_, _, text, token, info, _), (*_, info0, _) in zip(got, zero):
        with torch.no_grad():
            logp = torch.log_softmax(plain(torch.tensor([context]))[0][0, -1].double(), dim=-1)
        best = torch.topk(logp, 2)
        assert token == int(best.indices[0])  # greedy: the most likely
        assert info["token"] == text == TOKENIZER.decode([token])
        assert info["logprob"] == pytest.approx(float(logp[token]), abs=2e-5)
        assert list(info["top"]) == [TOKENIZER.decode([int(i)]) for i in best.indices]
        assert list(info["top"].values()) == pytest.approx(best.values.tolist(), abs=2e-5)
        assert info0 == {**info, "top": {}, "ranked": []}
        context.append(token)


def test_a_stop_string_ends_a_choice_and_is_cut(make, model):
    [reference] = alone(model, "ab€", SampleConfig(temperature=0.0, max_new_tokens=12))
    full = TOKENIZER.decode(reference)
    stop = full[5:7]
    scheduler = make()
    scheduler.start()
    mine = job(["ab€"], max_new_tokens=12, stop=[stop])
    assert scheduler.submit(mine)
    [text], [ids], [reasons] = by_choice(events(mine), 1)
    assert text == full[:full.index(stop)] and reasons[-1] == "stop" and ids == reference[:len(ids)]


def prepared_eot_model(tokenizer):
    """helpers.eot_model (test_serve's server runs it too), prepared for inference."""
    return prepare_for_inference(eot_model(tokenizer), "fp32")


def test_end_of_text_finishes_a_choice_with_openais_stop(make):
    tokenizer = GPT2Tokenizer()
    scheduler = make(tokenizer=tokenizer, over=prepared_eot_model(tokenizer))
    scheduler.start()
    mine = job(["Grüße"], n=2, tokenizer=tokenizer, max_new_tokens=4)
    assert scheduler.submit(mine)
    evs = events(mine)
    assert sorted(evs[:-1]) == [("token", i, "", tokenizer.eot_id, None, "stop") for i in (0, 1)]
    assert evs[-1] == ("done", {"prompt_tokens": len(tokenizer.encode("Grüße")), "completion_tokens": 2,
                                "total_tokens": len(tokenizer.encode("Grüße")) + 2})


# ---- the queue: which jobs it takes (submitted before the thread starts, so that none has joined yet) ---------------

def test_jobs_that_fit_in_the_batch_never_count_against_the_queue(make):
    scheduler = make(max_batch=4, queue=1)
    a, b, c, d = job(["ab"], n=2), job(["é"], n=2), job(["€c"]), job(["d"])
    # rows a 2 + b 2 fill the batch; c would wait (1 beyond the batch: the queue of 1 is full); d is refused
    assert [scheduler.submit(j) for j in (a, b, c, d)] == [True, True, True, False]
    assert scheduler.waiting() == [a, b, c] and scheduler.metrics.queue_depth == 3
    scheduler.start()
    for mine, size, prompt in ((a, 2, 2), (b, 2, 1), (c, 1, 2)):
        assert events(mine)[-1] == ("done", {"prompt_tokens": prompt, "completion_tokens": 5 * size,
                                             "total_tokens": prompt + 5 * size})
    assert scheduler.idle.wait(10) and scheduler.waiting() == [] and scheduler.metrics.queue_depth == 0
    assert d.events.empty() and scheduler.metrics.tokens == 25


def test_a_job_whose_client_left_while_it_waited_takes_no_place_and_is_counted(make):
    scheduler = make(max_batch=2, queue=1)
    gone = [job(["ab"], n=2), job(["cd"], n=2)]
    for mine in gone:
        assert scheduler.submit(mine)
        mine.cancelled.set()
    b, c, d = job(["é"], n=2), job(["€"], n=2), job(["x"])
    # the two gone take no rows: b fits the batch of 2, c waits beyond it (the queue of 1 is full), d is refused
    assert [scheduler.submit(j) for j in (b, c, d)] == [True, True, False]
    scheduler.start()
    assert events(b)[-1][0] == events(c)[-1][0] == "done"
    assert scheduler.idle.wait(10) and scheduler.metrics.cancelled == 2 and scheduler.metrics.queue_depth == 0
    assert all(mine.events.empty() for mine in [*gone, d])  # never started, never answered


def test_a_job_left_before_it_started_is_dropped_quietly(make, caplog):
    scheduler = make()
    mine = job(["ab"])
    assert scheduler.submit(mine)
    mine.cancelled.set()
    with caplog.at_level(logging.WARNING):
        scheduler.start()
        assert scheduler.idle.wait(10)  # nothing left to do
    assert scheduler.metrics.cancelled == 1 and mine.events.empty() and not caplog.records


def test_jobs_whose_clients_left_mid_decoding_leave_the_batch_and_free_their_rows(make):
    scheduler = make(max_batch=2, queue=1)
    long = [job(["ab"], max_new_tokens=500), job(["cd"], max_new_tokens=500)]
    for mine in long:
        assert scheduler.submit(mine)
    scheduler.start()
    for mine in long:
        assert mine.events.get(timeout=20)[0] == "token"  # decoding: the batch is full
        mine.cancelled.set()
    after = job(["é"], n=2)
    assert scheduler.submit(after)
    assert events(after)[-1] == ("done", {"prompt_tokens": 1, "completion_tokens": 10, "total_tokens": 11})
    assert scheduler.idle.wait(10) and scheduler.metrics.cancelled == 2 and scheduler.batch.rows == []
    assert scheduler.metrics.tokens < 2 * 500 + 10


# ---- closing, stopping, failing ------------------------------------------------------------------------------------

def test_the_scheduler_runs_in_a_daemon_thread_named_for_it(make):
    before = set(threading.enumerate())
    make().start()
    [thread] = set(threading.enumerate()) - before
    assert thread.name == "gptlab-scheduler" and thread.daemon  # a stuck model cannot keep the process alive


def test_closing_refuses_new_jobs_and_lets_running_and_waiting_ones_finish_in_the_grace(make):
    scheduler = make(max_batch=2, queue=1)
    running, waiting = job(["ab"], n=2, max_new_tokens=20), job(["é"], max_new_tokens=3)
    assert scheduler.submit(running) and scheduler.submit(waiting)
    scheduler.start()
    assert running.events.get(timeout=20)[0] == "token"
    assert not scheduler.closing
    scheduler.close(60)
    assert scheduler.closing and not scheduler.submit(job(["x"]))
    assert events(running)[-1][1]["completion_tokens"] == 40 and events(waiting)[-1][1]["completion_tokens"] == 3
    scheduler.stop(60)
    assert not scheduler._thread.is_alive()  # it ended once nothing was left, long before the deadline


def test_at_the_deadline_running_and_waiting_jobs_are_told_the_server_is_shutting_down(make):
    scheduler = make(max_batch=2, queue=1)
    running, waiting = job(["ab"], n=2, max_new_tokens=500), job(["é"], max_new_tokens=500)
    assert scheduler.submit(running) and scheduler.submit(waiting)
    scheduler.start()
    assert running.events.get(timeout=20)[0] == "token"
    scheduler.stop(0)
    assert not scheduler._thread.is_alive()  # stop returned once the thread had ended
    assert events(running)[-1] == ("error", "the server is shutting down")
    assert events(waiting) == [("error", "the server is shutting down")]


def test_stop_gives_the_thread_the_grace_and_then_gives_up(make, monkeypatch):
    scheduler = make()
    scheduler.start()
    timeouts, join = [], scheduler._thread.join
    monkeypatch.setattr(scheduler._thread, "join", lambda timeout=None: (timeouts.append(timeout), join(timeout)))
    scheduler.stop(3.0)
    [timeout] = timeouts
    assert timeout is not None and 3.0 <= timeout <= 3.0 + 30  # a stuck model must not hang the shutdown


def test_a_failing_step_fails_its_jobs_and_the_scheduler_keeps_serving(make, model):
    [reference] = alone(model, "€a", SampleConfig(temperature=0.0, max_new_tokens=5))
    scheduler = make(max_batch=4)
    sample, calls = scheduler.batch.sample, []

    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return sample()
    scheduler.batch.sample = fails_once
    first = job(["ab"], n=2)
    assert scheduler.submit(first)
    scheduler.start()
    assert events(first) == [("error", "generation failed: boom")]
    assert scheduler.idle.wait(10) and scheduler.batch.rows == []
    after = job(["€a"])
    assert scheduler.submit(after)
    assert by_choice(events(after), 1)[1] == [reference]
