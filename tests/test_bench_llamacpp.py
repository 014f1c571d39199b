"""`gptlab bench generate --peer llama.cpp` on a tiny model: every pair's rows and ratio lines come out, the two
engines compute the same fp32 model (logits and greedy ids), llama.cpp's bytes read per token are the file's
tensors without the position table, and the CLI's flags reach the bench (timings themselves are never asserted)."""

import re
import shutil

import numpy as np
import pytest
import torch

from helpers import TINY as TINY_FLAGS, model_run, run_bad, tiny_run
from gptlab.bench import llamacpp
from gptlab.config import ModelConfig
from gptlab.errors import GptlabError
from gptlab.ggml import peer
from gptlab.ggml.gguf_out import export_gguf
from gptlab.model import GPT
from gptlab.runtime import bf16_supported
from gptlab.tokenizer import GPT2Tokenizer

pytestmark = [pytest.mark.device_path("llama.cpp peer"),
              pytest.mark.skipif(not peer.available(), reason="llama.cpp is not installed: `make peers` builds it "
                                 "and runs these tests")]

TINY = {"vocab_size": 50257, "block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 64, "dropout": 0.0,
        "activation": "gelu_tanh"}


@pytest.fixture
def quick_probe(monkeypatch):
    """A small, short memory-read probe: the tiny model's runs need no 512 MB read before each."""
    monkeypatch.setattr(llamacpp, "BANDWIDTH_MB", 16)
    monkeypatch.setattr(llamacpp, "BANDWIDTH_S", 0.01)


def test_every_pair_is_timed_and_the_fp32_pair_computes_the_same_model(capsys, quick_probe):
    lines = llamacpp.run_peer_generate(config=ModelConfig(**TINY), prompt_tokens=8, new_tokens=8, prefill_tokens=32,
                                       rounds=2)
    out = capsys.readouterr().out
    pairs = ["fp32↔F32", "int8↔Q8_0"] + (["bf16↔BF16"] if bf16_supported(torch.device("cpu")) else [])
    assert "llama-cpp-python" in out and "llama.cpp 2" in out  # the header: version, llama.cpp's threads
    for pair in pairs:
        rows = [line.split(None, 2) for line in out.splitlines() if line.startswith(pair + " ")]
        rows = [row for row in rows if row[1] in ("gptlab", "llama.cpp")]  # the table's, not the ratio lines
        assert [row[1] for row in rows] == ["gptlab", "llama.cpp"], out  # one row per engine
        assert all(re.search(r"\(\S+ \.\. \S+\)\s+\d+ %\s+[\d,]+$", row[2]) for row in rows), rows
        decode = next(line for line in lines if line.startswith(f"{pair} batch-1 decode: gptlab "))
        assert re.search(r"x llama\.cpp \(gptlab \d+ % of its floor, llama\.cpp \d+ %\); goal ≥ 1\.3x: (met|short)",
                         decode), decode
        prefill = next(line for line in lines if line.startswith(f"{pair} prompt processing (32 tokens): "))
        assert re.search(r"goal ≥ 1\.0x: (met|short)$", prefill), prefill
    assert "int8 at ≥ 80 % of its floor: " in next(line for line in lines if line.startswith("int8↔Q8_0 batch-1"))
    table = {(r[0], r[1]): r for r in (line.split() for line in out.splitlines()) if len(r) > 4 and r[1] in
             ("gptlab", "llama.cpp")}
    f32, q8 = float(table["fp32↔F32", "llama.cpp"][3]), float(table["int8↔Q8_0", "llama.cpp"][3])
    assert q8 < f32 / 3  # each pair's own file: Q8_0's blocks are about a quarter of F32's bytes
    assert all(float(row[-1].replace(",", "")) >= 1 for row in table.values())  # prompt tok/s: seconds, not stamps
    parity = lines[-1]
    assert parity.startswith("parity: ") and all(f"{pair} " in parity for pair in pairs)
    assert float(re.search(r"differ by at most (\S+);", parity).group(1)) < 1e-2
    # how long the greedy ids agree: a random model's near-ties may part them (the tight parity: test_llamacpp.py)
    assert re.search(r"fp32↔F32 \d+/8", parity), parity
    assert "machine load: " in out


def test_llama_cpp_bytes_per_token_are_the_file_tensors_but_the_position_table(tmp_path):
    """Worked out from the shapes: F32 holds every tensor in 4 bytes; Q8_0 the matrices (token table included) in
    34 bytes per 32 weights and the vectors in F32; the position table is left out."""
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY)
    model = GPT(cfg).eval()
    run = model_run(tmp_path / "run", model, GPT2Tokenizer())
    V, C, L = cfg.vocab_size, cfg.n_embd, cfg.n_layer
    matrices = V * C + L * (3 * C * C + C * C + 4 * C * C + 4 * C * C)  # token table, qkv, proj, up, down
    vectors = L * (2 * C + 3 * C + C + 2 * C + 4 * C + C) + 2 * C  # norms, biases of each block; the final norm
    f32 = export_gguf(run, tmp_path / "f32.gguf", "f32").path
    q8 = export_gguf(run, tmp_path / "q8.gguf", "q8_0").path
    assert llamacpp.gguf_bytes_per_token(f32) == 4 * (matrices + vectors)
    assert llamacpp.gguf_bytes_per_token(q8) == matrices // 32 * 34 + 4 * vectors
    assert llamacpp.gguf_bytes_per_token(f32) == llamacpp.weight_bytes_per_token(model, "fp32")  # gptlab reads as many


def test_llama_decode_stamps_every_token_and_matches_llama_cpps_own_greedy_loop(tmp_path):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**TINY)).eval()
    path = export_gguf(model_run(tmp_path / "run", model, GPT2Tokenizer()), tmp_path / "m.gguf", "f32").path
    prompt = [5, 17, 300, 4000, 2]
    with peer.LlamaCpp(path, n_ctx=64) as llm:
        clock = llamacpp.llama_decode(llm, prompt, 6)
        assert len(clock.stamps) == 6 and llm.pos == len(prompt) + 5
        assert [ids[0] for ids in clock.ids] == llm.generate(prompt, 6)
        assert llamacpp.llama_prefill(llm, prompt) > 0 and llm.pos == len(prompt)
        assert llamacpp.logits_difference(model, llm, prompt) < 1e-2
        assert np.isfinite(llm.decode([1])).all()


def test_the_cli_refuses_zero_rounds_and_passes_its_flags(capsys, monkeypatch):
    assert "--rounds must be >= 1, not 0" in run_bad(capsys, "bench", "generate", "--peer", "llama.cpp", "--rounds",
                                                     "0")
    from gptlab.cli import main

    seen = []
    monkeypatch.setattr(llamacpp, "run_peer_generate", lambda **kw: seen.append(kw) or [])
    assert main(["bench", "generate", "--peer", "llama.cpp", "--rounds", "3", "--new-tokens", "20",
                 "--prompt-tokens", "4"]) == 0
    assert seen == [{"new_tokens": 20, "prompt_tokens": 4, "rounds": 3, "quality_run": None}]


def test_without_llama_cpp_the_bench_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(peer, "available", lambda: False)
    with pytest.raises(GptlabError) as error:
        llamacpp.run_peer_generate(config=ModelConfig(**TINY))
    assert str(error.value) == f"llama.cpp is not installed; {peer.PEER_INSTALL}" and "\n" not in str(error.value)


def test_lengths_past_the_context_are_refused_before_anything_runs():
    with pytest.raises(GptlabError, match="exceed the model's context of 64 tokens"):
        llamacpp.run_peer_generate(config=ModelConfig(**TINY), prompt_tokens=60, new_tokens=8)
    with pytest.raises(GptlabError, match="a prompt of 65 tokens exceeds"):
        llamacpp.run_peer_generate(config=ModelConfig(**TINY), prompt_tokens=8, new_tokens=8, prefill_tokens=65)


def test_quality_puts_each_export_of_a_trained_run_beside_gptlabs_fp32(tmp_path, capsys):
    """--quality RUN with --peer: F32 differs from gptlab's fp32 by llama.cpp's rounding alone, Q8_0 by more; an
    exact-GELU run is exported with the tanh form and says what that costs; a run whose data is gone is refused."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run = tiny_run(tmp_path / "a", 40, [*TINY_FLAGS, "--activation", "gelu_tanh"])
    line = llamacpp.peer_quality(str(run), threads=1)[0]
    parts = re.findall(r"(F32|BF16|Q8_0) mean KL ([0-9.e+-]+), top token agrees ([0-9.]+)%", line)
    kls = {k: float(v) for k, v, _ in parts}
    assert set(kls) == {"F32", "BF16", "Q8_0"} and kls["F32"] < 1e-5 and kls["F32"] < kls["Q8_0"]
    assert float(parts[0][2]) == 100.0 and all(float(a) >= 90 for _, _, a in parts)  # the same top token
    assert "validation text: F32 mean KL" in line and line.endswith("%") and line.count("; ") == 2  # no GELU part
    exact = tiny_run(tmp_path / "b", 5, TINY_FLAGS)
    assert "the run's exact GELU exported as the tanh form" in llamacpp.peer_quality(str(exact), threads=1)[0]
    shutil.rmtree(tmp_path / "b" / "data")
    with pytest.raises(GptlabError, match="needs the run's validation text"):
        llamacpp.peer_quality(str(exact))


def test_each_pair_runs_gptlab_at_its_own_precision(monkeypatch, capsys, quick_probe):
    """gptlab's side of each pair is prepared at the pair's precision (fp32, bf16 where the CPU has it, int8)."""
    seen = []
    real = llamacpp.prepare_for_inference

    def spy(model, precision, *args, **kwargs):
        seen.append(precision)
        return real(model, precision, *args, **kwargs)

    monkeypatch.setattr(llamacpp, "prepare_for_inference", spy)
    llamacpp.run_peer_generate(config=ModelConfig(**TINY), prompt_tokens=4, new_tokens=4, prefill_tokens=8,
                               rounds=1)
    assert seen == (["fp32", "bf16", "int8"] if bf16_supported(torch.device("cpu")) else ["fp32", "int8"])
