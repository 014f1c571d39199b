"""Benchmarks: the measured peak is cached per device and read back; `bench train` trains every variant from the
same seed on the same batches and prints its table with the headline ratio last."""

import json

import pytest
import torch

from conftest import tiny_config
from gptlab import bench
from gptlab.cli import main
from gptlab.config import TrainConfig
from gptlab.runtime import bf16_supported, read_peak


def test_peak_is_measured_once_then_read_from_the_cache(monkeypatch):
    device = torch.device("cpu")
    peak = bench.measure_peak(device, quick=True)
    assert peak["fp32"] > 1e8 and peak["read_bytes_per_s"] > 1e8
    assert ("bf16" in peak) == bf16_supported(device) and "tf32" not in peak
    calls = []
    monkeypatch.setattr(bench, "measure_peak", lambda device: calls.append(device) or {**peak, "fp32": 123.0})
    assert read_peak(device) is None
    assert bench.cached_peak(device)["fp32"] == 123.0 and read_peak(device)["fp32"] == 123.0
    assert bench.cached_peak(device)["fp32"] == 123.0 and len(calls) == 1
    bench.cached_peak(device, refresh=True)
    assert len(calls) == 2


def test_bench_train_compares_variants_from_the_same_start(char_data, monkeypatch, capsys):
    monkeypatch.setattr(bench, "measure_peak", lambda device: {"device": "test", "fp32": 1e10, "bf16": 2e10})
    variants = [bench.Variant("fp32 eager (reference)", "fp32"), bench.Variant("fp32 again", "fp32")]
    if bf16_supported(torch.device("cpu")):
        variants.append(bench.Variant("bf16 eager", "bf16"))
    cfg = TrainConfig(batch_size=4, lr=3e-3, warmup_steps=1, device="cpu")
    model = tiny_config(vocab_size=0, dropout=0.1)  # interleaved variants, yet each draws the masks it would alone
    rows = bench.run_train_bench(char_data, model, cfg, steps=2, warmup=1, variants=variants)
    lines = capsys.readouterr().out.strip().splitlines()
    assert [r["variant"] for r in rows] == [v.name for v in variants]
    assert rows[0]["val_loss"] == rows[1]["val_loss"]  # same seed, same batches, same path: the same numbers
    if len(rows) == 3:
        assert abs(rows[2]["val_loss"] - rows[0]["val_loss"]) < 0.05
        assert rows[2]["peak"] == "bf16" and rows[0]["peak"] == "fp32"
    flops_per_token = model_flops(char_data)
    for r in rows:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops_per_token / (2e10 if r["peak"] == "bf16" else 1e10))
    assert lines[-1].endswith("peak") and "x the fp32 reference's tokens/s, MFU" in lines[-1]
    assert any(line.startswith("fp32 again") and " +0.0000" in line for line in lines)


def model_flops(char_data) -> float:
    from gptlab.model import GPT

    vocab = json.loads((char_data / "meta.json").read_text())["vocab_size"]
    return GPT(tiny_config(vocab_size=vocab)).flops_per_token()


def test_bench_train_cli_rejects_bad_numbers(capsys):
    assert main(["bench", "train", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_variants_put_the_fp32_reference_first():
    cpu = torch.device("cpu")
    assert bench.train_variants(cpu)[0] == bench.Variant("fp32 eager (reference)", "fp32")
    assert [v.compile for v in bench.train_variants(cpu)] == [False] * (1 + bf16_supported(cpu)) + [True]
    pairs = [(v.precision, v.attention) for v in bench.attention_variants(cpu)]
    assert pairs == [("fp32", "sdpa"), ("fp32", "naive")] + [("bf16", "sdpa"), ("bf16", "naive")] * bf16_supported(cpu)
