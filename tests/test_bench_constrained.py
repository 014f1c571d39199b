"""`gptlab bench structured` (gptlab.bench.constrained): its arithmetic worked out by hand, the mask's replay, and a
run end to end on a tiny model over GPT-2's vocabulary (every schema compiled, decoded three ways, reported)."""

import statistics

import pytest
import torch
from helpers import run_bad, trained_like

from gptlab.bench.constrained import BENCH_PROMPT, NEW_TOKENS, SCHEMAS, Way, mask_times, p99, run_schema, run_structured
from gptlab.errors import GptlabError
from gptlab.inference.grammar import compile_grammar
from gptlab.inference.loading import prepare_for_inference
from gptlab.serve.app import Served
from gptlab.tokenizer import GPT2Tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


def tiny(tokenizer, block_size):
    torch.manual_seed(0)
    model = trained_like(dict(n_layer=1, n_head=2, n_embd=16, vocab_size=tokenizer.vocab_size, block_size=block_size,
                              dropout=0.0))
    return Served("tiny", prepare_for_inference(model, "fp32"), tokenizer, model.num_params(), lambda: model)


def test_p99_and_a_ways_rate_are_worked_out_by_hand():
    assert p99([float(i) for i in range(100)]) == 99.0 and p99([float(i) for i in range(200)]) == 198.0
    assert p99([5.0]) == 5.0
    way = Way()
    way.add([1, 2, 3, 4, 5], 2.0, [0.5, 0.5], [0.1])  # 4 tokens after the first in 2 s
    way.add([7, 8], 1.0)
    assert (way.tokens, way.seconds, way.draws, way.waits) == (5, 3.0, [0.5, 0.5], [0.1])
    assert way.per_token == pytest.approx(0.6)
    assert Way().per_token == 0.0


def test_the_mask_is_replayed_once_per_token(gpt2):
    grammar = compile_grammar("json_schema", SCHEMAS["tool call"], gpt2)
    ids = gpt2.encode('{"name":"get_time","arguments":{"zone":-3}}')
    times = mask_times(grammar, ids)
    assert len(times) == len(ids) and all(t > 0 for t in times)


def test_a_model_is_benched_end_to_end(gpt2, capsys):
    served = tiny(gpt2, NEW_TOKENS + 32)
    lines = run_structured(served=served, samples=2)
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in lines] == list(SCHEMAS)
    assert all("fast-forward" in line and "raw mask" in line for line in lines)
    assert "2 seeded samples a schema each way" in out and "ff/drawn" in out
    r = run_schema(served.model, gpt2, "long keys", 1)
    assert r["tokens"] > 0 and r["compile"] > 0 and r["mask p99"] >= r["mask mean"] * 0.5


def test_a_context_too_short_for_the_bench_is_refused(gpt2, capsys):
    with pytest.raises(GptlabError, match="too short"):
        run_structured(served=tiny(gpt2, NEW_TOKENS), samples=1)  # the prompt and NEW_TOKENS need one more
    assert "--samples must be >= 1" in run_bad(capsys, "bench", "structured", "--samples", "0")


def test_each_way_decodes_what_it_says_and_its_times_fit_in_the_run(gpt2):
    """run_schema's ways, from what they did (no speed asserted): the drawn way decodes what generate_batch gives
    with fast-forward off, seeded at temperature 1, one token a step and no wait; the overlap way the same tokens,
    one wait a step after the first; fast-forward takes fewer steps than tokens; every time it reports lies between
    0 and the run's own wall time."""
    import time

    from gptlab.config import SampleConfig
    from gptlab.engine import generate_batch
    from gptlab.inference.rows import Steer

    served = tiny(gpt2, NEW_TOKENS + 32)
    start = time.perf_counter()
    r = run_schema(served.model, gpt2, "long keys", 2)
    wall = time.perf_counter() - start
    grammar = compile_grammar("json_schema", SCHEMAS["long keys"], gpt2)
    cfg = SampleConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0)
    expected = [row[0] for row in generate_batch(served.model, [gpt2.encode(BENCH_PROMPT)], cfg,
                                                 steer=Steer(grammar=grammar, fast_forward=False))]
    assert r["first"] == [i for i in expected if i is not None]
    ways = r["ways"]
    assert len(ways["drawn"].draws) == ways["drawn"].tokens + 2 and ways["drawn"].waits == []
    assert ways["overlap"].tokens == ways["drawn"].tokens and len(ways["overlap"].waits) == ways["drawn"].tokens
    assert len(ways["ff"].draws) < ways["ff"].tokens + 2  # several tokens in some steps
    assert ways["free"].tokens == ways["drawn"].tokens
    for key in ("compile", "mask mean", "mask p99", "step"):
        assert 0 < r[key] < wall, key
    for key in ("added mean", "added p99", "overlap mean", "overlap p99"):
        assert -wall < r[key] < wall, key
    assert all(0 < d < wall for way in ways.values() for d in way.draws)
    base = statistics.median(ways["free"].draws)  # the arithmetic, by the standard library's median and mean
    assert r["added mean"] == pytest.approx(statistics.mean(ways["drawn"].draws) - base)
    assert r["overlap mean"] == pytest.approx(statistics.mean(ways["overlap"].draws) - base +
                                              statistics.mean(ways["overlap"].waits))
    assert r["step"] == pytest.approx(ways["free"].seconds / ways["free"].tokens)
