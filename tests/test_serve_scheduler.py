"""The scheduler (gptlab.serve.scheduler) driven directly, without HTTP: a job's events (text, token ids, finish
reasons, logprobs, usage) against the engine alone (`generate_batch(...)`, `gptlab sample`'s
path), the plain forward and the tokenizer; which jobs the queue takes (counted by hand); cancelled jobs leaving;
closing with a grace period; a failing step; the /metrics text read back by prometheus_client's parser against
numbers counted by hand."""

import logging
import math
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import eot_model, tiny_config
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gptlab.config import SampleConfig
from gptlab.engine import RunningBatch, generate_batch, one_thread
from gptlab.inference.loading import prepare_for_inference
from gptlab.inference.prefix_cache import PrefixCache
from gptlab.model import GPT
from gptlab.serve.api import CompletionRequest
from gptlab.serve.metrics import Metrics, metrics_registry
from gptlab.serve.scheduler import (Done, Failed, Job, PromptLogprobs, Scheduler, Token, prompt_logprobs,
                                    top_logprobs)
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
    """The job's events up to its last (Done or Failed)."""
    out = []
    while not out or not isinstance(out[-1], (Done, Failed)):
        out.append(job.events.get(timeout=20))
    return out


def by_choice(evs, size):
    """Each choice's text, token ids and finish reasons (one per token event)."""
    texts, ids, reasons = [""] * size, [[] for _ in range(size)], [[] for _ in range(size)]
    for event in (e for e in evs if isinstance(e, Token)):
        texts[event.choice] += event.text
        ids[event.choice].append(event.id)
        reasons[event.choice].append(event.finish_reason)
    return texts, ids, reasons


def alone(model, prompt, cfg, n=1):
    """The engine's rows for `prompt` alone: what `gptlab sample` gives."""
    return [list(r) for r in zip(*generate_batch(model, [TOKENIZER.encode(prompt)], cfg, n))]


@pytest.fixture
def make(model):
    """Schedulers over `model`, each stopped at the test's end (started here if the test did not)."""
    made = []

    def make(max_batch=4, queue=2, tokenizer=TOKENIZER, over=model, prefix_cache=None):
        made.append(Scheduler(over, tokenizer, max_batch, queue, prefix_cache))
        return made[-1]
    yield make
    for scheduler in made:
        if not scheduler._thread.is_alive() and scheduler._thread.ident is None:
            scheduler.start()
        scheduler.stop(0)


# ---- /metrics and logprobs, by hand ------------------------------------------------------------------------------

FAMILIES = {  # /metrics' names, types and help texts, as they always were (dashboards and alerts read them)
    "gptlab_requests": ("counter", "Completion requests answered, by HTTP status."),
    "gptlab_tokens_generated": ("counter", "Tokens generated, all requests."),
    "gptlab_requests_cancelled": ("counter", "Requests whose client left before the end."),
    "gptlab_queue_depth": ("gauge", "Requests waiting for a place in the batch."),
    "gptlab_batch_size": ("gauge", "Sequences decoded together at the last step."),
    "gptlab_time_to_first_token_seconds": ("histogram", "From a request's arrival to its first token."),
}
CACHE = {"gptlab_prefix_cache_bytes": ("gauge", "Bytes of keys and values the prefix cache holds."),
         "gptlab_prefix_cache_budget_bytes": ("gauge", "The prefix cache's budget of bytes."),
         "gptlab_prefix_cache_blocks": ("gauge", "Blocks the prefix cache holds."),
         "gptlab_prefix_cache_lookup_tokens": ("counter", "Prompt tokens looked up in the prefix cache."),
         "gptlab_prefix_cache_hit_tokens": ("counter", "Prompt tokens looked up whose keys and values the prefix "
                                                       "cache served."),
         "gptlab_prefix_cache_evictions": ("counter", "Blocks evicted from the prefix cache."),
         "gptlab_prefix_cache_hit_ratio": ("gauge", "Prompt tokens served from the prefix cache per prompt token "
                                                    "looked up (0 before any).")}
SPECULATION = {"gptlab_speculative_proposed_tokens": ("counter",
                                                     "Tokens proposed by speculation (--speculate auto) and checked."),
               "gptlab_speculative_kept_tokens": ("counter", "Proposed tokens kept: each the token drawn.")}


def scraped(registry):
    """The registry's exposition read back by prometheus_client's own parser: {family: (type, help)} and
    {sample name with its labels: value}."""
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    samples = {}
    for family in families:
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return {f.name: (f.type, f.documentation) for f in families}, samples


def test_metrics_are_prometheus_text_with_cumulative_buckets_counted_by_hand():
    metrics = Metrics()
    for status in (503, 200, 429, 200):
        metrics.count(status)
    metrics.tokens, metrics.cancelled, metrics.queue_depth, metrics.batch_rows = 7, 1, 2, 3
    for seconds in (0.01, 0.3, 0.3, 31.0):  # 0.01 on a bound counts in it (le); 31 beyond the last: +Inf only
        metrics.observe_ttft(seconds)
    families, samples = scraped(metrics_registry(metrics, object()))  # a batch without a prefix cache
    assert {name: families[name] for name in FAMILIES} == FAMILIES
    assert {name: families[name] for name in CACHE} == CACHE and len(families) == len(FAMILIES) + len(CACHE) + 2
    assert {name: families[name] for name in SPECULATION} == SPECULATION
    buckets = dict(zip(["0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "30.0", "+Inf"],
                       [1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 4]))
    assert samples.pop("gptlab_time_to_first_token_seconds_sum") == pytest.approx(0.01 + 0.3 + 0.3 + 31.0)
    assert samples == {
        'gptlab_requests_total{status="200"}': 2, 'gptlab_requests_total{status="429"}': 1,
        'gptlab_requests_total{status="503"}': 1, "gptlab_tokens_generated_total": 7,
        "gptlab_requests_cancelled_total": 1, "gptlab_queue_depth": 2, "gptlab_batch_size": 3,
        **{f'gptlab_time_to_first_token_seconds_bucket{{le="{le}"}}': n for le, n in buckets.items()},
        "gptlab_time_to_first_token_seconds_count": 4,
        **{name + "_total" * (kind == "counter"): 0 for name, (kind, _) in CACHE.items()},  # no cache: all 0
        "gptlab_speculative_proposed_tokens_total": 0, "gptlab_speculative_kept_tokens_total": 0}


def test_speculations_tally_is_read_at_each_scrape(make):
    """What the batch's rows proposed and kept (RunningBatch.tally), read at each scrape."""
    scheduler = make()
    scheduler.batch.tally.proposed, scheduler.batch.tally.kept = 120, 45
    got = {k: v for k, v in scraped(scheduler.registry)[1].items() if k.startswith("gptlab_speculative")}
    assert got == {"gptlab_speculative_proposed_tokens_total": 120, "gptlab_speculative_kept_tokens_total": 45}
    scheduler.batch.tally.kept = 46
    assert scraped(scheduler.registry)[1]["gptlab_speculative_kept_tokens_total"] == 46


class StandInCache:
    """The engine's prefix cache as /metrics reads it: `stats()`, whose numbers the test sets."""

    def __init__(self, **stats):
        self.stats_now = SimpleNamespace(**stats)

    def stats(self):
        return self.stats_now


def test_the_prefix_caches_numbers_are_read_at_each_scrape(make):
    scheduler = make()
    scheduler.batch.prefix_cache = cache = StandInCache(lookup_tokens=640, hit_tokens=192, bytes=3 << 20,
                                                        budget_bytes=64 << 20, blocks=3, evictions=5)
    got = {k: v for k, v in scraped(scheduler.registry)[1].items() if k.startswith("gptlab_prefix_cache")}
    assert got == {"gptlab_prefix_cache_bytes": 3 * 2 ** 20, "gptlab_prefix_cache_budget_bytes": 64 * 2 ** 20,
                   "gptlab_prefix_cache_blocks": 3, "gptlab_prefix_cache_lookup_tokens_total": 640,
                   "gptlab_prefix_cache_hit_tokens_total": 192, "gptlab_prefix_cache_evictions_total": 5,
                   "gptlab_prefix_cache_hit_ratio": 0.3}  # 192 / 640
    cache.stats_now = SimpleNamespace(lookup_tokens=0, hit_tokens=0, bytes=0, budget_bytes=1, blocks=0, evictions=0)
    got = scraped(scheduler.registry)[1]
    assert got["gptlab_prefix_cache_hit_ratio"] == 0 and got["gptlab_prefix_cache_budget_bytes"] == 1  # none yet


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


def test_prompt_logprobs_are_those_of_the_logits_handed_to_them_by_hand():
    """Echo logprobs from any prompt pass's logits (T, V): row t scores token t + 1; the first token has none."""
    tokenizer = CharTokenizer("xé€")  # ids: x 0, é 1, € 2
    logits = torch.tensor([[0.5, 1.2, 3.0], [2.0, 0.0, -1.0], [9.0, 9.0, 9.0]])  # the last row predicts past the end
    def logp(row, i):
        return row[i] - math.log(sum(math.exp(v) for v in row))
    got = prompt_logprobs(logits, [2, 1, 0], 2, tokenizer)  # "€éx"
    rows = logits.tolist()
    assert got["tokens"] == ["€", "é", "x"] and got["text_offset"] == [0, 1, 2]
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx([logp(rows[0], 1), logp(rows[1], 0)], abs=1e-6)
    assert list(got["top_logprobs"][1]) == ["€", "é"] and list(got["top_logprobs"][2]) == ["x", "é"]
    assert list(got["top_logprobs"][1].values()) == pytest.approx([logp(rows[0], 2), logp(rows[0], 1)], abs=1e-6)
    assert list(got["top_logprobs"][2].values()) == pytest.approx([logp(rows[1], 0), logp(rows[1], 1)], abs=1e-6)
    assert prompt_logprobs(logits, [2, 1, 0], 0, tokenizer)["top_logprobs"] == [None, {}, {}]


def test_prompt_logits_come_from_the_prompt_pass_that_generation_runs():
    """Echo logprobs are computed by the generating model's prompt pass (its chunks, its cache's precision): the same
    numbers whether a row joins with them or not, and the plain forward's within float rounding."""
    plain = gpt()
    ids = TOKENIZER.encode("Hi ü, é€")
    with torch.no_grad():
        expected = plain(torch.tensor([ids]))[0][0]
    batch = RunningBatch(plain, PrefixCache(0, chunk=3))  # chunks of 3: several forwards over the cache
    alone = batch.prompt_logits(ids)
    joined = batch.join(ids, SampleConfig(max_new_tokens=1), 2, prompt_logits=True)
    assert torch.equal(alone, joined[0].prompt_logits) and torch.equal(alone[-1:], joined[1].logits)
    torch.testing.assert_close(alone, expected, rtol=1e-5, atol=1e-5)


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
    assert all(e.logprobs is None for e in evs[:-1])  # no logprobs asked for
    assert evs[-1] == Done(prompt_tokens=6, completion_tokens=24, cached_tokens=0)  # each prompt once, not n times
    assert scheduler.idle.wait(10) and scheduler.batch.rows == []
    metrics = scheduler.metrics
    assert (metrics.tokens, metrics.batch_rows, metrics.queue_depth, metrics.cancelled) == (24, 4, 0, 0)
    assert sum(metrics.ttft) == 1 and 0 <= metrics.ttft_sum <= waited  # one first token, after its arrival


def test_the_prefix_caches_tokens_are_counted_once_a_prompt_however_many_choices(make):
    scheduler = make(max_batch=4, prefix_cache=PrefixCache(2 ** 20, chunk=2))
    scheduler.start()
    first, mine = job(["ab€d", "é c"], n=2), job(["ab€d", "é c"], n=2)  # 4 and 3 tokens
    assert scheduler.submit(first)
    assert events(first)[-1] == Done(prompt_tokens=7, completion_tokens=20, cached_tokens=0)
    assert scheduler.submit(mine)  # whole chunks of 2 before each last token: 2 of "ab€d", 2 of "é c"
    assert events(mine)[-1] == Done(prompt_tokens=7, completion_tokens=20, cached_tokens=2 + 2)  # not 2 x (2 + 2)


def test_logprobs_are_the_plain_forwards_and_zero_gives_no_alternatives(make):
    plain = gpt()
    scheduler = make()
    scheduler.start()
    two, none = job(["Hi ü"], logprobs=2, max_new_tokens=3), job(["Hi ü"], logprobs=0, max_new_tokens=3)
    assert scheduler.submit(two) and scheduler.submit(none)
    got, zero = events(two)[:-1], events(none)[:-1]
    context = TOKENIZER.encode("Hi ü")
    for event, event0 in zip(got, zero):
        text, token, info, info0 = event.text, event.id, event.logprobs, event0.logprobs
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


def test_echo_with_logprobs_sends_each_prompts_logprobs_first_and_echo_alone_or_logprobs_alone_do_not(make):
    """A job that echoes with logprobs gets a PromptLogprobs per prompt (the plain forward's log-softmax of each
    token after the first), before its tokens, with max_tokens 0 too (then the usage alone); echo without logprobs,
    or logprobs without echo, gets none."""
    plain = gpt()
    scheduler = make()
    scheduler.start()
    prompts = ["Hi ü", "é c"]
    jobs = {}
    for name, echo, logprobs, most in (("both", True, 1, 2), ("none", True, 1, 0), ("echo", True, None, 2),
                                       ("logprobs", False, 1, 2)):
        jobs[name] = job(prompts, logprobs=logprobs, max_new_tokens=max(most, 1))
        jobs[name].request.echo, jobs[name].request.max_tokens = echo, most
        assert scheduler.submit(jobs[name])
    got = {name: events(j) for name, j in jobs.items()}
    for name in ("both", "none"):
        echoed = [e for e in got[name] if isinstance(e, PromptLogprobs)]
        assert [e.prompt for e in echoed] == [0, 1] and got[name][:2] == echoed, name  # before any token
        for e, prompt in zip(echoed, prompts):
            ids = TOKENIZER.encode(prompt)
            with torch.no_grad():
                logp = torch.log_softmax(plain(torch.tensor([ids]))[0][0].double(), dim=-1)
            expected = [float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)]
            assert e.entries["tokens"] == [TOKENIZER.decode([i]) for i in ids]
            assert e.entries["token_logprobs"][0] is None
            assert e.entries["token_logprobs"][1:] == pytest.approx(expected, abs=2e-5), name
            best = [(TOKENIZER.decode([int(logp[t].argmax())]), float(logp[t].max())) for t in range(len(ids) - 1)]
            assert e.entries["top_logprobs"][0] is None and len(e.entries["top_logprobs"]) == len(ids)
            assert [list(top.items()) for top in e.entries["top_logprobs"][1:]] == \
                [[(text, pytest.approx(value, abs=2e-5))] for text, value in best], name  # logprobs 1: the likeliest
    assert got["none"][2:] == [Done(prompt_tokens=7, completion_tokens=0)]  # the prompts' logprobs alone
    for name in ("echo", "logprobs"):
        assert not any(isinstance(e, PromptLogprobs) for e in got[name]) and got[name][-1].completion_tokens == 4


@pytest.mark.device_path("fused decode (native)")
def test_a_predicted_output_reaches_the_batch_and_its_tokens_are_counted_in_the_usage(make, model):
    """A job with a prediction (OpenAI's predicted output) hands it to the batch's rows: the same tokens as without
    one, and Done counts the predicted tokens kept (some) and refused (none, the prediction being the answer)."""
    if not model.fused:
        pytest.skip("no fused step: predictions are proposals of the fused step's speculation")
    scheduler = make()
    scheduler.start()
    plain = job(["Hi ü"], max_new_tokens=8)
    assert scheduler.submit(plain)
    evs = events(plain)
    answer = [e.id for e in evs if isinstance(e, Token)]
    predicted = job(["Hi ü"], max_new_tokens=8)
    predicted.request.prediction_ids = answer
    assert scheduler.submit(predicted)
    again = events(predicted)
    assert [e.id for e in again if isinstance(e, Token)] == answer and evs[-1].prediction is None
    accepted, rejected = again[-1].prediction
    assert accepted > 0 and rejected == 0
    wrong = job(["Hi ü"], max_new_tokens=8)
    other = next(t for t in TOKENIZER.encode("zq") if t != answer[4])
    wrong.request.prediction_ids = answer[:4] + [other] * 4  # right, then wrong from the fifth token
    assert scheduler.submit(wrong)
    refused = events(wrong)
    assert [e.id for e in refused if isinstance(e, Token)] == answer and refused[-1].prediction[1] > 0


def test_a_jobs_structure_steers_its_rows_a_logit_bias_forces_its_token(make):
    """A job's structure (here a logit_bias of +100 on "Q") goes with its rows into the batch: every token drawn,
    greedy or sampled, is Q; a job without one draws freely."""
    from gptlab.serve.structured import parse_structure

    scheduler = make()
    scheduler.start()
    q = TOKENIZER.encode("Q")[0]
    forced, free = job(["Hi ü"], max_new_tokens=4, temperature=1.0, seed=3), job(["Hi ü"], max_new_tokens=4)
    forced.request.structure = parse_structure({"logit_bias": {str(q): 100}}, chat=False)
    assert scheduler.submit(forced) and scheduler.submit(free)
    assert by_choice(events(forced), 1)[0] == ["QQQQ"]
    assert by_choice(events(free), 1)[0] != ["QQQQ"]


def test_a_row_at_a_grammars_dead_end_fails_its_job_whole_and_the_others_go_on(make):
    """A regex the tokenizer can start but not finish (no è, no à): after "ab" no token is allowed, so the job (both
    its choices) ends Failed with the row's error, its rows leave the batch, and a job beside it finishes."""
    from gptlab.serve.structured import compile_structure, parse_structure

    scheduler = make()
    scheduler.start()
    stuck, beside = job(["Hi"], n=2, max_new_tokens=6), job(["Hi"], max_new_tokens=6)
    stuck.request.structure = parse_structure({"response_format": {"type": "regex", "regex": "ab(è|à)"}}, chat=False)
    compile_structure(stuck.request.structure, TOKENIZER)
    assert scheduler.submit(stuck) and scheduler.submit(beside)
    got = events(stuck)
    assert isinstance(got[-1], Failed) and "the constraint allows no token this model has next" in got[-1].message
    assert by_choice(got, 2)[0] == ["ab", "ab"]
    whole = job(["Hi"], max_new_tokens=6)  # a grammar complete before max_tokens: "stop"
    whole.request.structure = parse_structure({"response_format": {"type": "regex", "regex": "ab"}}, chat=False)
    compile_structure(whole.request.structure, TOKENIZER)
    assert scheduler.submit(whole)
    assert by_choice(events(whole), 1) == (["ab"], [[TOKENIZER.encode("a")[0], TOKENIZER.encode("b")[0]]],
                                           [[None, "stop"]])
    assert events(beside)[-1] == Done(prompt_tokens=2, completion_tokens=6)
    assert scheduler.idle.wait(10) and scheduler.batch.rows == []


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
    assert sorted(evs[:-1], key=lambda e: e.choice) == [Token(i, "", tokenizer.eot_id, None, "stop") for i in (0, 1)]
    assert evs[-1] == Done(prompt_tokens=len(tokenizer.encode("Grüße")), completion_tokens=2)


# ---- the queue: which jobs it takes (submitted before the thread starts, so that none has joined yet) ---------------

def test_jobs_that_fit_in_the_batch_never_count_against_the_queue(make):
    scheduler = make(max_batch=4, queue=1)
    a, b, c, d = job(["ab"], n=2), job(["é"], n=2), job(["€c"]), job(["d"])
    # rows a 2 + b 2 fill the batch; c would wait (1 beyond the batch: the queue of 1 is full); d is refused
    assert [scheduler.submit(j) for j in (a, b, c, d)] == [True, True, True, False]
    assert scheduler.waiting() == [a, b, c] and scheduler.metrics.queue_depth == 3
    scheduler.start()
    for mine, size, prompt in ((a, 2, 2), (b, 2, 1), (c, 1, 2)):
        assert events(mine)[-1] == Done(prompt_tokens=prompt, completion_tokens=5 * size)
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
    assert isinstance(events(b)[-1], Done) and isinstance(events(c)[-1], Done)
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
        assert isinstance(mine.events.get(timeout=20), Token)  # decoding: the batch is full
        mine.cancelled.set()
    after = job(["é"], n=2)
    assert scheduler.submit(after)
    assert events(after)[-1] == Done(prompt_tokens=1, completion_tokens=10)
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
    assert isinstance(running.events.get(timeout=20), Token)
    assert not scheduler.closing
    scheduler.close(60)
    assert scheduler.closing and not scheduler.submit(job(["x"]))
    assert events(running)[-1].completion_tokens == 40 and events(waiting)[-1].completion_tokens == 3
    scheduler.stop(60)
    assert not scheduler._thread.is_alive()  # it ended once nothing was left, long before the deadline


def test_at_the_deadline_running_and_waiting_jobs_are_told_the_server_is_shutting_down(make):
    scheduler = make(max_batch=2, queue=1)
    running, waiting = job(["ab"], n=2, max_new_tokens=500), job(["é"], max_new_tokens=500)
    assert scheduler.submit(running) and scheduler.submit(waiting)
    scheduler.start()
    assert isinstance(running.events.get(timeout=20), Token)
    scheduler.stop(0)
    assert not scheduler._thread.is_alive()  # stop returned once the thread had ended
    assert events(running)[-1] == Failed("the server is shutting down")
    assert events(waiting) == [Failed("the server is shutting down")]


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
    assert events(first) == [Failed("generation failed: boom")]
    assert scheduler.idle.wait(10) and scheduler.batch.rows == []
    after = job(["€a"])
    assert scheduler.submit(after)
    assert by_choice(events(after), 1)[1] == [reference]


def test_a_job_that_fails_to_start_is_answered_and_so_are_those_admitted_with_it(make, model):
    """A prompt pass that raises (a bug) fails the job being started and every job admitted beside it, none left
    waiting for an answer that never comes; the scheduler then serves on."""
    [reference] = alone(model, "€a", SampleConfig(temperature=0.0, max_new_tokens=5))
    scheduler = make(max_batch=4)
    join, calls = scheduler.batch.join, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return join(*args, **kwargs)
    scheduler.batch.join = fails_once
    first, beside = job(["ab"]), job(["cd"])
    assert scheduler.submit(first) and scheduler.submit(beside)  # admitted together at the first step
    scheduler.start()
    assert events(first) == [Failed("generation failed: boom")]
    assert events(beside) == [Failed("generation failed: boom")]
    assert scheduler.idle.wait(10) and scheduler.batch.rows == []
    after = job(["€a"])
    assert scheduler.submit(after)
    assert by_choice(events(after), 1)[1] == [reference]
