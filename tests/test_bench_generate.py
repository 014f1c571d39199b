"""`gptlab bench generate` and `gptlab bench decode` on tiny models: the transformers twin holds the same weights,
the engines agree, the tables and ratios come out (timings themselves are never asserted)."""

import pytest
import torch

from helpers import tiny_config
from gptlab.bench.decode import run_decode
from gptlab.bench.engines import (GEN_MODELS, bench_model, generation_ratios, print_generation_table, transformers_twin,
                                  weight_bytes_per_token)
from gptlab.bench.generate import headline
from gptlab.config import ModelConfig, build
from gptlab.inference import native
from gptlab.inference.native import load_library
from gptlab.model import GPT
from gptlab.runtime import bf16_supported


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_the_transformers_twin_computes_the_same_logits(activation):
    pytest.importorskip("transformers")
    model = GPT(tiny_config(activation=activation, block_size=32)).eval()
    hf = transformers_twin(model)
    x = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        assert (hf(x).logits - model(x)[0]).abs().max().item() <= 1e-5


def test_bench_model_times_every_variant_and_prints_the_ratios(capsys):
    pytest.importorskip("transformers")
    precisions = ["fp32", "bf16"] if bf16_supported(torch.device("cpu")) else ["fp32"]
    config = tiny_config(block_size=32)
    results = bench_model(config, torch.device("cpu"), precisions, [1, 8], prompt_tokens=5, new_tokens=6,
                          bandwidth_mb=16)
    engines = {(r.engine, r.precision, r.batch) for r in results}
    for p in precisions:
        assert {("gptlab (KV cache)", p, 1), ("gptlab (KV cache)", p, 8), ("transformers generate", p, 1),
                ("gptlab, no cache", p, 1)} <= engines
        if load_library() is not None:  # the fused step, and beside it the same engine stepping by torch ops
            assert {("gptlab, torch-op step", p, 1), ("gptlab, torch-op step", p, 8)} <= engines
    assert all(r.bandwidth > 0 for r in results if r.engine == "gptlab (KV cache)")  # each run's own floor
    assert all(0 < r.paired_floor for r in results if (r.engine, r.batch) == ("gptlab (KV cache)", 1))
    assert all(len(r.ids) == r.batch and all(len(row) == 6 for row in r.ids) for r in results)
    ours = {(r.engine, r.precision, r.batch): r for r in results}
    for batch in (1, 8):  # greedy on the same fp32 weights: the same ids
        assert ours[("gptlab (KV cache)", "fp32", batch)].ids == ours[("transformers generate", "fp32", batch)].ids
    assert ours[("gptlab (KV cache)", "fp32", 1)].ids == ours[("gptlab, no cache", "fp32", 1)].ids
    bytes_per_token = {p: weight_bytes_per_token(GPT(config), p) for p in precisions}
    print_generation_table("tiny", results, bytes_per_token)
    lines = generation_ratios(results, bytes_per_token)
    table = capsys.readouterr().out
    assert table.count("bandwidth floor") == 2 * len(precisions)
    assert "fp32 batch 1 decode: " in lines[0] and "x transformers' generate (greedy ids agree for the first 6/6)" \
        in lines[0] and "of the bandwidth floor (token by token)" in lines[0] and "x no cache" in lines[0]
    assert lines[1].startswith("fp32 batch 8 aggregate decode: ")


def test_bytes_read_per_token_count_the_tied_embedding_once():
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(build(ModelConfig, GEN_MODELS["gpt2-124M"], {}))
    assert weight_bytes_per_token(model, "fp32") == (124_439_808 - 1024 * 768) * 4
    assert weight_bytes_per_token(model, "bf16") == (124_439_808 - 1024 * 768) * 2
    # int8: 123,532,032 matrix weights (LM head included) at a byte, 133,201 rows at 8 (scale, sum), 121,344 vector
    # numbers at 4
    assert weight_bytes_per_token(model, "int8") == 123_532_032 + 8 * 133_201 + 4 * 121_344


def test_bench_model_times_int8_beside_the_float_step(capsys):
    base = "bf16" if bf16_supported(torch.device("cpu")) else "fp32"
    config = tiny_config(block_size=32)
    results = bench_model(config, torch.device("cpu"), [base, "int8"], [1], prompt_tokens=5, new_tokens=6,
                          bandwidth_mb=16, with_transformers=False)
    engines = {(r.engine, r.precision) for r in results}
    assert ("gptlab (KV cache)", "int8") in engines and ("gptlab, no cache", "int8") not in engines
    bytes_per_token = {p: weight_bytes_per_token(GPT(config), p) for p in (base, "int8")}
    lines = generation_ratios(results, bytes_per_token)
    int8 = next(line for line in lines if line.startswith("int8 batch 1 decode: "))
    assert "of the bandwidth floor" in int8 and " ms/step, " in int8 and f"x the {base} step (" in int8
    assert "greedy ids agree for the first " in int8
    assert "; int8 " in headline(results, [base, "int8"], bytes_per_token)
    assert f"x the {base} step at " in headline(results, [base, "int8"], bytes_per_token)


@pytest.mark.device_path("fused decode (native)")
def test_bench_decode_holds_each_step_to_the_floor_read_beside_it(fused_kernel, capsys):
    rows = run_decode(rounds=3, pages="both", config=tiny_config(block_size=64), positions=16, buffer_mb=8)
    lines = capsys.readouterr().out.strip().splitlines()
    assert [(r.precision, r.pages) for r in rows] == [("fp32", "2M"), ("fp32", "4K"), ("bf16", "2M"), ("bf16", "4K"),
                                                      ("int8", "2M"), ("int8", "4K")]
    for r in rows:
        assert len(r.shares) == 3 and min(r.shares) > 0 and r.batch1_s > 0 and r.bare8_s > 0
        assert r.batch8_s > 0
    assert lines[0] == f"kernel build: {native.describe(native.load_library())}"  # which build ran
    assert lines[1].startswith("machine load: ")
    table = [line for line in lines if " batch 1: " in line]
    assert [line.split(" batch 1:")[0] for line in table] == ["fp32 2M pages", "fp32 4K pages", "bf16 2M pages",
                                                               "bf16 4K pages", "int8 2M pages", "int8 4K pages"]
    assert all("of the floor (median of 3; " in line and "x batch 1's tokens/s (" in line for line in table)
    with pytest.raises(ValueError, match="pages"):
        run_decode(pages="1G")


def test_the_floor_and_the_gains_are_the_arithmetic_their_docstrings_state():
    """Worked out by hand: every row's token from one read of the weights; batch 8's tokens/s over batch 1's; the
    leading ids two generations share, also where one is the other's prefix."""
    from gptlab.bench.decode import DecodeRow
    from gptlab.bench.engines import GenResult, agreeing_prefix

    result = GenResult("gptlab (KV cache)", "fp32", 4, 0.1, 10.0, 100.0, [], bandwidth=2e9)
    assert result.floor_tok_s(1_000_000) == 8000.0  # 4 rows x 2e9 B/s / 1e6 B per token
    assert DecodeRow("fp32", "2M", [0.5], 0.010, 0.020, 0.015).batch8_gain == pytest.approx(4.0)  # 8 x 10 ms / 20 ms
    assert agreeing_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert agreeing_prefix([1, 2, 3], [1, 2]) == 2 and agreeing_prefix([5], [5, 6, 7]) == 1
    assert agreeing_prefix([], [1]) == 0


def test_the_headline_divides_ours_by_theirs_and_shares_by_the_floor():
    """Hand-made results, figures worked out by hand: batch-1 decode 300 tok/s against transformers' 100 is 3.00x;
    without transformers, 300 tok/s against a floor of 1 row x 1e9 B/s / 2.5e6 B = 400 tok/s is 75 %; int8 at
    450 tok/s is 1.50x the fp32 step, at 450 / (1e9 / 1e6) = 45 % of its own floor."""
    from gptlab.bench.engines import ENGINE, GenResult

    def result(engine, precision, tok_s):
        return GenResult(engine, precision, 1, 0.1, 10.0, tok_s, [], bandwidth=1e9)

    ours = [result(ENGINE, "fp32", 300.0), result(ENGINE, "int8", 450.0)]
    theirs = [result("transformers generate", "fp32", 100.0)]
    sizes = {"fp32": 2_500_000, "int8": 1_000_000}
    assert headline(ours + theirs, ["fp32", "int8"], sizes) == (
        "headline: batch-1 decode vs transformers' generate: fp32 3.00x; int8 1.50x the fp32 step at 45% of its floor")
    assert headline(ours, ["fp32"], sizes) == "headline: batch-1 decode at fp32 75% of the bandwidth floor"


def test_bench_generates_skip_flags_and_quality_prompts_reach_the_bench(monkeypatch):
    """`--no-uncached`, `--no-transformers` and `--quality-prompts N` as the bench's arguments (their defaults: True,
    True, 8); the bench itself (bench_model) leaves those rows out when told."""
    import gptlab.bench.generate as generate
    from gptlab.cli import main

    seen = []
    monkeypatch.setattr(generate, "run_generate", lambda **kw: seen.append(kw) or [])
    assert main(["bench", "generate", "--no-uncached", "--no-transformers", "--quality", "runs/r",
                 "--quality-prompts", "3"]) == 0
    assert main(["bench", "generate"]) == 0
    assert [(kw["uncached"], kw["with_transformers"], kw["quality_prompts"]) for kw in seen] == [(False, False, 3),
                                                                                                 (True, True, 8)]
    results = bench_model(tiny_config(block_size=32), torch.device("cpu"), ["fp32"], [1], prompt_tokens=5,
                          new_tokens=3, bandwidth_mb=16, uncached=False, with_transformers=False)
    assert not {r.engine for r in results} & {"gptlab, no cache", "transformers generate"}


def test_quality_prompts_sets_how_many_validation_windows_are_compared(tmp_path):
    from helpers import TINY, tiny_run
    from gptlab.bench.quality import int8_quality

    run = tiny_run(tmp_path, 2, TINY)
    lines = int8_quality(str(run), prompts=3, prompt_tokens=4, new_tokens=2)
    assert any("/3 validation prompts agree" in line for line in lines), lines


def test_bench_generate_times_the_path_sample_runs_a_running_batch(monkeypatch):
    """The engine rows (run_gptlab, and with it paired_floor's steps) are generate_batch over a RunningBatch, batch 1
    as `gptlab sample` runs it: 6 new tokens are one prompt joined, 6 draws and 5 decode steps (none after the last)."""
    from gptlab import engine
    from gptlab.bench.engines import run_gptlab
    from gptlab.inference.loading import prepare_for_inference

    calls = []
    for name in ("join", "sample", "advance"):
        original = getattr(engine.RunningBatch, name)
        monkeypatch.setattr(engine.RunningBatch, name,
                            lambda self, *a, _f=original, _n=name, **k: calls.append(_n) or _f(self, *a, **k))
    model = prepare_for_inference(GPT(tiny_config(block_size=32)).eval(), "fp32")
    clock = run_gptlab(model, [[1, 2, 3]], 6)
    assert [calls.count(n) for n in ("join", "sample", "advance")] == [1, 6, 5]
    assert [len(ids) for ids in clock.ids] == [1] * 6


def test_bench_decode_labels_itself_the_kernels_step_alone(monkeypatch, capsys):
    import gptlab.bench.decode as decode
    from gptlab.cli import main

    monkeypatch.setattr(decode, "run_decode", lambda **kw: print("the rows") or [])
    assert main(["bench", "decode", "--rounds", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "gptlab bench decode: the fused kernel's decode step alone (no prompt pass, no sampling, no engine loop; "
        "`gptlab bench generate` times the path `gptlab sample` runs)", "the rows"]


def test_a_runs_rates_are_its_clocks_stamps_worked_out_by_hand():
    """Two rows, a 4-token prompt, new positions stamped at 1.0, 1.5, 2.0 and 3.0 s after the call: time to first
    token 1.0 s, prefill 2 x 4 / 1.0 = 8 tokens/s, decode the 3 positions after the first, 2 x 3 / (3.0 - 1.0) = 3
    tokens/s (the first token's time is the prefill's, not the decode's)."""
    from gptlab.bench.engines import GenResult
    from gptlab.bench.timing import Clock

    clock = Clock()
    clock.start, clock.stamps, clock.ids = 10.0, [11.0, 11.5, 12.0, 13.0], [[1, 2], [3, 4], [5, 6], [7, 8]]
    result = GenResult.of(clock, "gptlab", "fp32", 2, 4)
    assert (result.ttft_s, result.prefill_tok_s, result.decode_tok_s) == (1.0, 8.0, 3.0)
    assert result.ids == [[1, 3, 5, 7], [2, 4, 6, 8]]
