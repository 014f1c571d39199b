"""Benchmarks: the measured peak is cached per device and read back, but never when other work ran meanwhile;
`bench train` trains every variant from the same seed on the same batches and prints its table with the headline
ratio last; `bench matmul` times a preset's own products; every bench flag says what it does."""

import dataclasses
import json
import os

import pytest
import torch

from helpers import tiny_config
from gptlab.bench import device_peak, matmul, timing
from gptlab.bench.train_speed import Variant, attention_variants, run_train_bench, train_variants
from gptlab.cli import BENCHES, main
from gptlab.config import TrainConfig
from gptlab.peak import Peak, read_peak
from gptlab.runtime import bf16_supported

HZ = os.sysconf("SC_CLK_TCK")


def fake_machine(monkeypatch, others: float) -> None:
    """Every load reading sees `others` CPUs' worth of other processes' time per second (a job named "stress"),
    and this process at half a CPU; each reading is one second after the previous."""
    clock = iter(range(1000))

    def sample() -> timing.Sample:
        t = next(clock)
        return timing.Sample(float(t), (3.0 if others else 0.1, 1.0, 1.0), busy_ticks=int(t * HZ * (others + 0.5)),
                             own_ticks=int(t * HZ * 0.5), processes={42: ("stress", int(t * HZ * others))})
    monkeypatch.setattr(timing, "sample", sample)


@pytest.fixture
def quiet_machine(monkeypatch):
    fake_machine(monkeypatch, others=0.0)


def test_the_load_counts_other_processes_time_not_this_ones(monkeypatch):
    fake_machine(monkeypatch, others=1.5)
    load = timing.LoadWatch().stop()
    assert load.others == pytest.approx(1.5) and load.busy and load.busiest == [("stress", pytest.approx(1.5))]
    assert "other processes used 1.50 CPUs" in load.line() and "stress 150%" in load.line()
    assert "warning: other work was running" in load.report()
    fake_machine(monkeypatch, others=0.1)
    load = timing.LoadWatch().stop()
    assert not load.busy and "warning" not in load.report()
    assert not timing.Load((2.5, 0, 0), 2, 2, 1.0).busy and timing.Load((3.5, 0, 0), 2, 2, 1.0).busy  # no /proc


def test_a_peak_measured_on_a_busy_machine_is_printed_but_not_cached(monkeypatch, capsys):
    cpu = torch.device("cpu")
    fake_machine(monkeypatch, others=1.5)
    busy = device_peak.run_peak(device="cpu", quick=True)
    out = capsys.readouterr().out
    assert busy.fp32 > 0 and "fp32 matmul" in out and read_peak(cpu) is None
    assert "warning: measured while other work was running (1.50 CPUs of other work): not cached" in out
    assert device_peak.cached_peak(cpu, quick=True) and read_peak(cpu) is None  # training's first measurement, too
    assert "not cached" in capsys.readouterr().out
    fake_machine(monkeypatch, others=0.0)
    quiet = device_peak.run_peak(device="cpu", quick=True)
    out = capsys.readouterr().out
    assert "warning" not in out and "other processes used 0.00 CPUs" in out
    assert read_peak(cpu).fp32 == quiet.fp32 and read_peak(cpu).load.startswith("machine load: ")


def test_peak_is_measured_once_then_read_from_the_cache(monkeypatch, quiet_machine):
    device = torch.device("cpu")
    measured = device_peak.measure_peak(device, quick=True)
    assert measured.fp32 > 1e8 and measured.read_bytes_per_s > 1e8
    assert (measured.bf16 is not None) == bf16_supported(device) and measured.tf32 is None
    calls = []
    monkeypatch.setattr(device_peak, "measure_peak", lambda device, quick: calls.append(device) or
                        dataclasses.replace(measured, fp32=123.0))
    assert read_peak(device) is None
    assert device_peak.cached_peak(device).fp32 == 123.0 and read_peak(device).fp32 == 123.0
    assert device_peak.cached_peak(device).fp32 == 123.0 and len(calls) == 1
    device_peak.cached_peak(device, refresh=True)
    assert len(calls) == 2


def bench_rows(char_data, monkeypatch, capsys, variants):
    """bench train's rows and printed lines for `variants` over 2 steps of a tiny model with dropout (interleaved
    variants, yet each draws the masks it would alone), against a fake peak of 1e10 fp32 and 2e10 bf16 FLOP/s."""
    monkeypatch.setattr(device_peak, "measure_peak", lambda device, quick: Peak(1e10, "test", bf16=2e10))
    cfg = TrainConfig(batch_size=4, lr=3e-3, warmup_steps=1, device="cpu")
    model = tiny_config(vocab_size=0, dropout=0.1)
    rows = run_train_bench(char_data, model, cfg, steps=2, warmup=1, variants=variants)
    flops_per_token = model_flops(char_data)
    for r in rows:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops_per_token / (2e10 if r["peak"] == "bf16" else 1e10))
    return rows, capsys.readouterr().out.strip().splitlines()


def test_bench_train_compares_variants_from_the_same_start(char_data, monkeypatch, capsys, quiet_machine):
    variants = [Variant("fp32 eager (reference)", "fp32"), Variant("fp32 again", "fp32")]
    rows, lines = bench_rows(char_data, monkeypatch, capsys, variants)
    assert [r["variant"] for r in rows] == [v.name for v in variants]
    assert rows[0]["val_loss"] == rows[1]["val_loss"]  # same seed, same batches, same path: the same numbers
    assert rows[0]["peak"] == rows[1]["peak"] == "fp32"
    assert lines[-1].endswith("peak") and "x the fp32 reference's tokens/s, MFU" in lines[-1]
    assert any(line.startswith("fp32 again") and " +0.0000" in line for line in lines)
    assert any(line.startswith("machine load: ") for line in lines)


@pytest.mark.device_path("bf16 native")
@pytest.mark.skipif(not bf16_supported(torch.device("cpu")),
                    reason="this CPU has no native bf16: bench train runs no bf16 variant here")
def test_bench_train_holds_bf16_to_the_fp32_reference_and_to_bf16s_peak(char_data, monkeypatch, capsys,
                                                                      quiet_machine):
    variants = [Variant("fp32 eager (reference)", "fp32"), Variant("bf16 eager", "bf16")]
    rows, lines = bench_rows(char_data, monkeypatch, capsys, variants)
    assert [r["variant"] for r in rows] == [v.name for v in variants]
    assert abs(rows[1]["val_loss"] - rows[0]["val_loss"]) < 0.05 and rows[1]["val_loss"] != rows[0]["val_loss"]
    assert rows[1]["peak"] == "bf16" and rows[0]["peak"] == "fp32"
    assert any(line.startswith("bf16 eager") for line in lines)


def model_flops(char_data) -> float:
    from gptlab.model import GPT

    vocab = json.loads((char_data / "meta.json").read_text())["vocab_size"]
    return GPT(tiny_config(vocab_size=vocab)).flops_per_token()


@pytest.mark.parametrize("argv, flag", [(["train", "--steps", "0"], "--steps"),
                                        (["decode", "--rounds", "0"], "--rounds"),
                                        (["matmul", "--repeats", "0"], "--repeats"),
                                        (["generate", "--char-tokens", "-1"], "--char-tokens")])
def test_bench_cli_rejects_bad_numbers(capsys, argv, flag):
    assert main(["bench", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_every_bench_flag_says_what_it_does():
    import argparse

    for name, (add, _, _) in BENCHES.items():
        parser = argparse.ArgumentParser()
        add(parser)
        for action in parser._actions:
            assert action.help, f"gptlab bench {name} {action.option_strings}"
            if action.dest == "device":
                assert action.choices == ("auto", "cpu", "cuda", "mps") and action.default == "auto"
    assert {"peak", "train", "attention", "generate", "decode", "matmul"} <= set(BENCHES)


def test_bench_train_times_finetune_on_gpt2_124m_at_context_256(monkeypatch, tmp_path):
    """finetune's shape comes from --init-from, which a bench has not: it times GPT-2 124M at context 256 with the
    preset's dropout, not the default model config with GPT-2's vocabulary. The bench wing resolves it."""
    import gptlab.runs
    from gptlab.bench.presets import train_bench_settings

    monkeypatch.setattr(gptlab.runs, "data_dir_for", lambda data, preset, quiet: tmp_path / preset)
    data, model, train = train_bench_settings("finetune", 4, "cpu")
    assert (model.n_layer, model.n_head, model.n_embd, model.block_size, model.vocab_size) == (12, 12, 768, 256, 50257)
    assert model.dropout == 0.1 and train.batch_size == 4 and data == tmp_path / "finetune"
    assert train_bench_settings("char-small", 4, "cpu")[1].n_embd == 384  # other presets keep their own shape
    assert train_bench_settings("char-small", 4, "cpu", attention="naive")[1].attention == "naive"


def test_bench_matmul_takes_the_presets_that_name_a_gpts_shape():
    from gptlab.bench.presets import SHAPED_PRESETS

    assert SHAPED_PRESETS == ("char-quick", "char-race", "char-small", "gpt2", "gpt2-medium", "gpt2-large",
                              "gpt2-xl")


def test_variants_put_the_fp32_reference_first():
    cpu = torch.device("cpu")
    assert train_variants(cpu)[0] == Variant("fp32 eager (reference)", "fp32")
    assert [v.compile for v in train_variants(cpu)] == [False] * (1 + bf16_supported(cpu)) + [True]
    pairs = [(v.precision, v.attention) for v in attention_variants(cpu)]
    assert pairs == [("fp32", "sdpa"), ("fp32", "naive")] + [("bf16", "sdpa"), ("bf16", "naive")] * bf16_supported(cpu)


def test_bench_matmul_times_every_product_of_the_preset(capsys):
    result = matmul.run_matmul(preset="char-quick", batch_size=1, repeats=1, profile=True)
    lines = capsys.readouterr().out.strip().splitlines()
    assert result.rows == 64 and list(result.gflops) == [(128, 384), (128, 128), (128, 512), (512, 128), (128, 65)]
    assert all(len(v) == 3 and min(v) > 0 for per in result.gflops.values() for v in per.values())
    assert result.ratio > 0 and result.total_s["fp32"] > 0
    assert lines[0] == "char-quick: 64 rows (batch 1 x context 64); best of 1"
    assert [line.split(" GFLOP/s")[0].split() for line in lines[1:6]] == [
        ["128", "->", "384"], ["128", "->", "128"], ["128", "->", "512"], ["512", "->", "128"], ["128", "->", "65"]]
    assert lines[6].startswith("machine load: ")
    assert f"bf16 {result.ratio:.2f}x fp32" in next(line for line in lines if line.startswith("all products"))
    for precision in ("fp32", "bf16"):
        seconds, products, rest = result.steps[precision]
        assert seconds > 0 and products > 0 and rest > 0
    assert lines[-4].startswith("fp32 step ") and lines[-2].startswith("bf16 step ") and "the rest" in lines[-2]
    assert lines[-1].startswith("  the rest: ") and lines[-1].endswith(" ms")


def test_the_profiled_rest_is_told_by_kind_and_a_dropout_owns_its_mask_and_cast():
    steps, rest = matmul.profile_steps(tiny_config(dropout=0.2), batch_size=2)
    for precision in ("fp32", "bf16"):
        assert abs(sum(rest[precision].values()) - steps[precision][2]) < 1e-9  # the kinds add up to the rest
        assert {"dropout", "LayerNorm", "GELU", "optimizer (AdamW)", "cross-entropy"} <= set(rest[precision])
        assert "products" not in rest[precision] and rest[precision]["dropout"] > 0


def test_a_profiled_op_is_counted_as_its_innermost_known_kind_and_all_of_a_dropout_as_dropout():
    """Hand-made profiler events (name, cpu_parent), labels read off OP_KINDS by hand: a product inside a Dropout
    module counts as dropout wherever the Dropout sits among its callers; otherwise the op's own name decides
    before its callers'; an unknown op under no known caller is other."""
    from types import SimpleNamespace

    def chain(*names):  # the op first, then its callers outwards
        event = None
        for name in reversed(names):
            event = SimpleNamespace(name=name, cpu_parent=event)
        return event

    assert matmul.kind_of(chain("aten::mm", "aten::linear", "module:Dropout")) == "dropout"
    assert matmul.kind_of(chain("aten::mm", "module:Dropout")) == "dropout"
    assert matmul.kind_of(chain("aten::gelu", "aten::mm")) == "GELU"
    assert matmul.kind_of(chain("aten::add_", "AccumulateGrad")) == "gradient adds"
    assert matmul.kind_of(chain("aten::fill_")) == "other"


def test_the_sliding_bench_returns_the_cached_time_then_the_uncached_one(monkeypatch):
    """bench generate's char-small line: (KV cache seconds, no cache seconds), in that order, each timed by its
    own path (the engine's cached generate_batch for the first, the no-cache reference for the second)."""
    from gptlab.bench import engines
    from gptlab.bench.sliding import char_model_speedup

    calls, batch, uncached = [], engines.generate_batch, engines.generate_uncached
    monkeypatch.setattr(engines, "generate_batch", lambda *a, **k: calls.append("cache") or batch(*a, **k))
    monkeypatch.setattr(engines, "generate_uncached", lambda *a, **k: calls.append("no cache") or uncached(*a, **k))
    clocks = []
    real_clock = engines.Clock

    class Recorded(real_clock):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            clocks.append(self)

    monkeypatch.setattr(engines, "Clock", Recorded)
    cached_s, uncached_s = char_model_speedup(torch.device("cpu"), 3, 4)
    assert calls == ["cache", "cache", "no cache"]  # a warm-up, then the two timed runs
    assert (cached_s, uncached_s) == (clocks[1].seconds, clocks[2].seconds)


def test_time_it_is_the_median_of_the_timed_calls_or_with_best_the_fastest_and_skips_the_warm_ups(monkeypatch):
    """On a clock that moves only inside fn, by durations set by hand: 2 warm-up calls (100 s each, never counted),
    then calls of 5, 1, 3, 9, 2 s until min_seconds (19 s) has passed: the median is 3, the fastest 1."""
    durations = iter([100, 100, 5, 1, 3, 9, 2] * 2)
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def fn():
        now[0] += next(durations)

    cpu = torch.device("cpu")
    assert timing.time_it(fn, cpu, min_seconds=19) == 3
    assert timing.time_it(fn, cpu, min_seconds=19, best=True) == 1
