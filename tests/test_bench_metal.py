"""`gptlab bench metal`: the fast engine's rungs beside torch fp32 and the fastest torch path on one training step, on
tiny shapes (one torch thread, so a busy machine does not stall them). Its printed table and its JSON are held to
their own figures from outside (tokens/s from batch x T over the ms, each row's "vs torch fp32" recomputed as torch
fp32's ms over the row's, the products' GFLOP/s from FLOPs counted by torch's own flop counter); no assertion on
which contender is faster."""

import json
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import number, one_thread, run_bad, run_ok  # noqa: F401 (one_thread: a fixture)
from gptlab.bench import metal, reference
from gptlab.bench.matmul import model_config
from gptlab.config import ModelConfig
from gptlab.model import GPT
from gptlab.peak import Peak, write_peak
from gptlab.reference import library
from gptlab.reference.fast import RUNGS
from gptlab.runtime import device_name

pytestmark = pytest.mark.skipif(library.missing() is not None, reason=f"the fast engine cannot run here: "
                                f"{library.missing()}")

CPU = torch.device("cpu")
FASTEST = reference.fastest_torch()[0]
ROW = re.compile(r"^(?P<name>fast C\+\+ fp32 \(\w+\)|naive C\+\+ fp32|torch fp32|torch fastest \([^)]*\))\s+"
                 r"(?P<B>\d+) x (?P<T>\d+)\s+(?P<ms>[\d,.]+)\s+(?P<best>[\d,.]+)\s+(?P<tps>[\d,.]+)\s+"
                 r"(?P<gflops>[\d,.]+)\s+(?P<share>[\d.]+%|-)\s+(?P<ratio>[\d,.]+)x$")
PRODUCT = re.compile(r"^  (?P<name>linear_\w+)\s+(?P<ms>[\d,.]+) ms\s+[\d.]+%\s+(?P<gflops>[\d,.]+) GFLOP/s\s+"
                     r"(?P<share>[\d.]+%|-) of the fp32 peak$")
HEADLINE = re.compile(r"^(?P<preset>.+): top rung (?P<rung>\w+) (?P<fp32>[\d,.]+)x torch eager fp32, "
                      r"(?P<fastest>[\d,.]+)x torch fastest; the products (?P<products>.+)$")




def within_rounding(printed: str, top: str, bottom: str) -> bool:
    """Whether `printed` (2 decimals) is top / bottom, each printed to 2 decimals, within what the rounding allows."""
    a, b = number(top), number(bottom)
    return (a - 0.005) / (b + 0.005) - 0.005 <= number(printed) <= (a + 0.005) / (b - 0.005) + 0.005


def counted_products(config: ModelConfig, B: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of the matrix products (aten mm and addmm: the Linears and the LM head) of one
    training step of a GPT of `config`, as torch's flop counter counts them."""
    model = GPT(config).train()
    idx = torch.randint(config.vocab_size, (B, config.block_size))

    def products(counter: FlopCounterMode) -> int:
        return sum(v for k, v in counter.get_flop_counts()["Global"].items() if str(k) in ("aten.mm", "aten.addmm"))

    with FlopCounterMode(display=False) as forward:
        _, loss = model(idx, idx)
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return products(forward), products(backward)


def test_the_products_flops_are_what_torchs_flop_counter_counts_in_a_step():
    for shape in ({"n_layer": 2, "n_embd": 12, "vocab_size": 37}, {"n_layer": 1, "n_embd": 8, "vocab_size": 65}):
        config = ModelConfig(block_size=8, n_head=2, **shape)
        assert metal.product_flops(config, 3 * 8) == counted_products(config, 3)
    assert metal.product_flops(ModelConfig(n_layer=1, n_head=1, n_embd=2, vocab_size=3), 5) == (540, 1080)


def test_the_default_shapes_are_char_quick_char_small_at_8_and_gpt2_124m_at_context_256_batch_4():
    quick, small, gpt2 = metal.metal_shapes()
    assert (quick.name, quick.train.batch_size, quick.model.block_size) == ("char-quick", 32, 64)
    assert (small.name, small.train.batch_size, small.model.block_size, small.model.n_embd) == ("char-small", 8, 256,
                                                                                                  384)
    g = gpt2.model
    assert gpt2.name == "gpt2@256" and gpt2.train.batch_size == 4
    assert (g.n_layer, g.n_head, g.n_embd, g.block_size, g.vocab_size) == (12, 12, 768, 256, 50257)
    assert g.activation == model_config("gpt2").activation
    assert [s.train.batch_size for s in metal.metal_shapes(["char-small", "gpt2@128"], batch_size=3)] == [3, 3]
    assert metal.metal_shapes(["gpt2@128"])[0].model.block_size == 128
    tiny = metal.metal_shapes(["gpt2@256"], tiny=True)[0]
    assert (tiny.name, tiny.model.n_layer, tiny.model.n_embd, tiny.model.block_size, tiny.train.batch_size) == (
        "gpt2 (tiny)", 2, 32, 16, 2)


def test_the_table_has_a_row_per_rung_and_torchs_and_holds_to_its_own_figures(capsys, one_thread):
    out = run_ok(capsys, "bench", "metal", "--tiny", "--presets", "char-quick", "--steps", "2", "--warmup", "1")
    rows = [m.groupdict() for line in out.splitlines() if (m := ROW.match(line))]
    assert [r["name"] for r in rows] == [f"fast C++ fp32 ({rung})" for rung in RUNGS] + ["torch fp32", FASTEST]
    torch_ms = rows[-2]["ms"]
    for r in rows:
        tokens, ms, tps = int(r["B"]) * int(r["T"]), number(r["ms"]), number(r["tps"])
        assert (int(r["B"]), int(r["T"])) == (2, 16) and min(ms, number(r["best"]), tps, number(r["gflops"])) > 0
        assert number(r["best"]) <= ms + 0.01 and r["share"] == "-"
        assert tokens * 1e3 / (ms + 0.005) - 0.05 <= tps <= tokens * 1e3 / (ms - 0.005) + 0.05
        assert within_rounding(r["ratio"], torch_ms, r["ms"])
    assert rows[-2]["ratio"] == "1.00"
    assert "fast C++ fp32 (fused) step by function" in out and "fast engine (top rung): fused (rung 5 of 5)" in out
    products = {m["name"]: m for line in out.splitlines() if (m := PRODUCT.match(line))}
    assert set(products) == {"linear_forward", "linear_backward"} and all(m["share"] == "-" for m in products.values())
    (headline,) = [m for line in out.splitlines() if (m := HEADLINE.match(line))]
    assert headline["preset"] == "char-quick (tiny)" and headline["rung"] == "fused"
    assert headline["fp32"] == rows[-3]["ratio"]
    assert within_rounding(headline["fastest"], rows[-1]["ms"], rows[-3]["ms"])
    assert headline["products"].endswith("GFLOP/s (no peak measured)") and out.strip().splitlines()[-1] == headline[0]


def test_the_json_holds_to_its_own_times_with_a_subset_of_rungs_and_the_naive_engine(capsys, one_thread):
    out = run_ok(capsys, "bench", "metal", "--tiny", "--presets", "char-small", "gpt2@256", "--rungs", "simd,loops",
                 "--naive", "--steps", "1", "--warmup", "0", "--batch-size", "3", "--json")
    report = json.loads(out)
    assert report["fast"]["rungs"] == ["loops", "simd"] and report["fast"]["top"] == "simd" and report["naive"]
    assert report["fast"]["library"].startswith("simd (rung 3 of 5)") and set(report["fast"]["tiles"]) == {
        "mr", "nr", "mc", "kc", "nc"}
    assert [s["preset"] for s in report["shapes"]] == ["char-small (tiny)", "gpt2 (tiny)"]
    for shape, vocab in zip(report["shapes"], (65, 50257)):
        rows = {r["contender"]: r for r in shape["rows"]}
        assert list(rows) == ["naive C++ fp32", "fast C++ fp32 (loops)", "fast C++ fp32 (simd)", "torch fp32", FASTEST]
        assert shape["tokens_per_step"] == 48 and shape["vocab_size"] == vocab
        assert shape["top"] == "fast C++ fp32 (simd)"
        for r in rows.values():
            assert min(r["ms_per_step"], r["best_ms"], r["tokens_per_s"], r["gflops"]) > 0 and "vs_naive" not in r
            assert r["vs_torch"] == pytest.approx(rows["torch fp32"]["ms_per_step"] / r["ms_per_step"])
            assert r["tokens_per_s"] == pytest.approx(48 / (r["ms_per_step"] / 1e3))
        top = rows[shape["top"]]
        assert shape["top_step_s"] * 1e3 == pytest.approx(top["ms_per_step"])  # one step: the clock is the top rung's
        assert sum(shape["top_by_function"].values()) + shape["top_rest_s"] == pytest.approx(shape["top_step_s"])
        config = ModelConfig(vocab_size=vocab, block_size=16, n_layer=2, n_head=2, n_embd=32)
        forward, backward = counted_products(config, 3)
        for name, flops in (("linear_forward", forward), ("linear_backward", backward)):
            reach = shape["products"][name]
            assert reach["flops"] == flops and reach["seconds"] == shape["top_by_function"][name]
            assert reach["gflops"] == pytest.approx(flops / reach["seconds"] / 1e9) and reach["share"] is None
        h = shape["headline"]
        assert h["vs_torch_fp32"] == top["vs_torch"] and h["torch_fastest"] == FASTEST
        assert h["vs_torch_fastest"] == pytest.approx(rows[FASTEST]["ms_per_step"] / top["ms_per_step"])
        assert h["products_gflops"] == pytest.approx((forward + backward) / sum(
            shape["products"][n]["seconds"] for n in metal.CLOCKED_PRODUCTS) / 1e9)


def test_with_a_measured_peak_the_products_share_is_of_the_fp32_peak(capsys, one_thread):
    assert write_peak(CPU, Peak(1e10, device_name(CPU), bf16=2e10, measured_at="then"))
    out = run_ok(capsys, "bench", "metal", "--tiny", "--presets", "char-quick", "--rungs", "tiles", "--steps", "1",
                 "--warmup", "0")
    assert "peaks measured then: fp32 10 GFLOP/s, bf16 20 GFLOP/s" in out
    for m in (m for line in out.splitlines() if (m := PRODUCT.match(line))):
        assert number(m["share"][:-1]) == pytest.approx(number(m["gflops"]) / 10 * 100, abs=0.006)
    (headline,) = [m for line in out.splitlines() if (m := HEADLINE.match(line))]
    assert headline["rung"] == "tiles" and re.fullmatch(r"at [\d.]+% of the fp32 peak", headline["products"])


@pytest.mark.parametrize("argv, says", [
    (["--rungs", "simd,warp"], "--rungs: no rung named 'warp'; the rungs are loops, tiles, simd, threads, fused"),
    (["--rungs", ""], "no rung named ''"),
    (["--presets", "bigram"], "--presets: 'bigram' names no GPT preset"),
    (["--presets", "gpt2@x"], "the context after @ must be a whole number of at least 1"),
    (["--presets", "gpt2@0"], "the context after @ must be a whole number of at least 1"),
    (["--steps", "0"], "--steps"), (["--warmup", "-1"], "--warmup"), (["--batch-size", "0"], "--batch-size")])
def test_the_cli_refuses_a_bad_setting_in_one_line(capsys, argv, says):
    assert says in run_bad(capsys, "bench", "metal", "--tiny", *argv)
