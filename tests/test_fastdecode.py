"""The fused native decode step (gptlab.inference.fused) against the model's torch forward with the same KV cache.

Every comparison runs on parameters away from their initial values (at init every bias is 0 and every LayerNorm
gain 1, so ln_1 equals ln_2 and a kernel that skips a bias or a gain, or swaps the two norms, still matches), at
widths and head sizes that are not multiples of 16 (the kernel's masked tails). tests/test_kernel_mutants.py
holds these checks to deliberately broken copies of the kernel: each must fail one of them.
"""

import copy
import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from gptlab.config import ModelConfig, SampleConfig
from gptlab.engine import generate_batch, generate_uncached
from gptlab.inference import TorchStep, native, prepare_for_inference
from gptlab.inference.fused import FusedDecoder, fused_decoder
from gptlab.inference.weights import move_to_huge_pages
from gptlab.model import GPT, Bigram
from gptlab.runtime import bf16_supported

pytestmark = [pytest.mark.device_path("fused decode (AVX-512)"), pytest.mark.usefixtures("fused_kernel")]

# widths 60, 75 and 100 and head sizes 12 and 25 (the products' and the attention's masked tails; the bf16 dot
# products take 32 at a time), odd head counts, GPT-2's head size 64, no biases, GPT-2's tanh GELU
SHAPES = [dict(n_layer=2, n_head=5, n_embd=60, vocab_size=101, block_size=40, activation="gelu_tanh"),
          dict(n_layer=2, n_head=3, n_embd=75, vocab_size=67, block_size=40, bias=False),
          dict(n_layer=3, n_head=4, n_embd=100, vocab_size=65, block_size=64, layer_norm_eps=1e-6),
          dict(n_layer=2, n_head=3, n_embd=192, vocab_size=70, block_size=40)]
FP32_TOLERANCE = 1e-5  # max abs difference of logits and cached keys/values; measured: up to 1e-6
# bf16 weights and activations (logits of these models are ~0.1-1): measured against fp32 on the same weights,
# torch path 0.0049, fused 0.0020; fused over a bf16 cache against the torch path over one, 0.005. No logits
# tolerance tells a bf16 cache written by truncation instead of rounding (measured: 0.0048) from a right one, so
# bf16_cache_errors checks the rounding itself, exactly.
BF16_TOLERANCE = 0.02


def trained_like(shape: dict, dtype=torch.float32, seed: int = 0) -> GPT:
    """A GPT of `shape` whose every vector (LayerNorm gains and biases, linear biases) is moved off its initial
    value by seeded noise of 0.3, as training moves it, then cast to `dtype`."""
    model = GPT(ModelConfig(**shape)).eval()
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=noise))
    return model.to(dtype)


def decoder(model: GPT, lib=None) -> FusedDecoder:
    """The fused step for `model`, on the kernel `lib` (a ctypes library; default: the package's kernel)."""
    return fused_decoder(model) if lib is None else FusedDecoder(model, lib)


def run_both(model: GPT, fused: FusedDecoder, rows: int, steps: int, cache_dtype=torch.float32):
    """Prefill `rows` ragged rows, then feed the same random tokens to the torch forward and to the fused step,
    each with its own cache; returns the logits and caches of both."""
    config = model.config
    prompts = torch.randint(0, config.vocab_size, (rows, 7))
    caches = [model.new_kv_cache(rows, dtype=cache_dtype) for _ in range(2)]
    torch_logits, fused_logits = [], []
    with torch.inference_mode():
        for cache in caches:
            model(prompts, kv_cache=cache)
            cache.pos -= torch.arange(rows) % 3  # rows at different positions
        for _ in range(steps):
            ids = torch.randint(0, config.vocab_size, (rows,))
            torch_logits.append(model(ids[:, None], kv_cache=caches[0], last_only=True)[0][:, -1].float())
            fused_logits.append(fused.step(ids, caches[1]).clone())  # valid until the next step
    return torch.stack(torch_logits), torch.stack(fused_logits), caches


def fp32_error(shape: dict, rows: int, lib=None) -> float:
    """The largest difference of logits, keys and values between the fused step and the torch forward over 12
    steps of `rows` rows in fp32; inf where the fused step advanced the positions otherwise."""
    model = trained_like(shape)
    expected, got, (ref, fused) = run_both(model, decoder(model, lib), rows, steps=12)
    if not torch.equal(fused.pos, ref.pos):  # advanced by one per step, row by row
        return float("inf")
    return max((got - expected).abs().max(), (fused.k - ref.k).abs().max(), (fused.v - ref.v).abs().max()).item()


def bf16_errors(shape: dict, lib=None) -> tuple[float, float]:
    """Logits of the torch forward and of the fused step with bf16 weights, each against the same (bf16-rounded)
    weights computed in fp32: the largest differences (torch's, fused's) over 8 steps of 4 rows."""
    model = trained_like(shape, torch.bfloat16)
    exact = copy.deepcopy(model).float()
    torch.manual_seed(1)  # the same prompts and tokens for both runs
    reference, _, _ = run_both(exact, decoder(exact, lib), 4, steps=8)
    torch.manual_seed(1)
    torch_bf16, fused_bf16, _ = run_both(model, decoder(model, lib), 4, steps=8)
    return (torch_bf16 - reference).abs().max().item(), (fused_bf16 - reference).abs().max().item()


def bf16_cache_errors(shape: dict, lib=None) -> tuple[float, int]:
    """A bf16 model over a bf16 cache, 8 steps of 3 rows: the largest difference of the fused step's logits from
    the torch forward's (inf where the positions differ), and how many keys and values the fused step wrote into
    layer 0 of a bf16 cache differ from those it wrote into an fp32 one, rounded to nearest even (torch's
    .to(torch.bfloat16)). Layer 0's are exactly comparable: they depend on the token and position only."""
    model = trained_like(shape, torch.bfloat16)
    expected, got, (ref, fused) = run_both(model, decoder(model, lib), 3, steps=8, cache_dtype=torch.bfloat16)
    same_pos = fused.k.dtype == torch.bfloat16 and torch.equal(fused.pos, ref.pos)
    logits_error = (got - expected).abs().max().item() if same_pos else float("inf")
    caches = [model.new_kv_cache(3, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)]
    step = decoder(model, lib).step
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (3, 5)), kv_cache=caches[0])
        for name in ("k", "v", "pos"):
            getattr(caches[1], name).copy_(getattr(caches[0], name))  # the prefill, rounded to nearest even
        for _ in range(8):
            ids = torch.randint(0, model.config.vocab_size, (3,))
            for cache in caches:
                step(ids, cache)
    wrong = sum(int((getattr(caches[1], n)[0] != getattr(caches[0], n)[0].to(torch.bfloat16)).sum()) for n in "kv")
    return logits_error, wrong


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_fused_step_equals_the_torch_forward_in_fp32(shape, rows):
    assert fp32_error(shape, rows) <= FP32_TOLERANCE


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_bf16_step_stays_as_close_to_fp32_as_the_torch_bf16_path(shape):
    torch_error, fused_error = bf16_errors(shape)
    assert torch_error <= BF16_TOLERANCE and fused_error <= BF16_TOLERANCE


@pytest.mark.parametrize("shape", SHAPES)
def test_the_bf16_cache_holds_keys_and_values_rounded_to_nearest_even(shape):
    logits_error, wrongly_rounded = bf16_cache_errors(shape)
    assert logits_error <= BF16_TOLERANCE
    assert wrongly_rounded == 0


def test_the_engine_decodes_with_the_fused_step_and_gives_the_reference_ids():
    plain = trained_like(dict(n_layer=2, n_head=3, n_embd=60, vocab_size=50, block_size=24))
    fast = prepare_for_inference(copy.deepcopy(plain), "fp32")
    assert isinstance(fast.decoder, FusedDecoder) and fast.fused and fast.cache_dtype == torch.float32
    calls = []
    step = fast.decoder.step
    fast.decoder.step = lambda ids, cache: calls.append(len(ids)) or step(ids, cache)
    prompts = [torch.randint(0, 50, (n,)).tolist() for n in (3, 1, 20)]  # ragged, and past the 24-token window
    cfg = SampleConfig(max_new_tokens=60, temperature=0)
    assert list(generate_batch(fast, prompts, cfg)) == list(generate_uncached(plain, prompts, cfg))
    assert calls == [3] * 59  # every decode step after the prefill


def test_the_torch_path_stays_where_the_fused_step_cannot_run():
    unfused = prepare_for_inference(GPT(tiny_config()), "fp32", fused=False)
    assert isinstance(unfused.decoder, TorchStep) and not unfused.fused
    assert fused_decoder(Bigram(tiny_config(arch="bigram"))) is None
    assert fused_decoder(GPT(tiny_config(n_head=1, n_embd=272))) is None  # heads wider than 256
    model = GPT(tiny_config()).eval()
    assert not fused_decoder(model).accepts(model.new_kv_cache(2, dtype=torch.float16))  # fp32 or bf16 caches


@pytest.mark.skipif(not bf16_supported(torch.device("cpu")), reason="no native bf16 on this CPU")
def test_a_bf16_model_keeps_a_bf16_cache_only_where_the_fused_step_decodes():
    """The fused step reads a bf16 cache at half the bytes; torch ops on a CPU attend in fp32 (bf16 is slower)."""
    fast = prepare_for_inference(GPT(tiny_config()), "bf16")
    assert fast.fused and fast.cache_dtype == torch.bfloat16
    assert fast.new_kv_cache(2).k.dtype == torch.bfloat16
    assert prepare_for_inference(GPT(tiny_config()), "bf16", fused=False).cache_dtype == torch.float32


def test_a_refused_step_raises_and_changes_nothing():
    """Arguments that would take the kernel outside its memory raise ValueError, also under python -O (see the
    next test), and the cache stays as it was."""
    model = GPT(tiny_config()).eval()  # vocab_size 50, block_size 16
    fused, cache = fused_decoder(model), model.new_kv_cache(2, max_len=8)
    with torch.inference_mode():
        model(torch.randint(0, 50, (2, 5)), kv_cache=cache)
    before = [t.clone() for t in (cache.k, cache.v, cache.pos)]
    for ids in ([3, 50], [-1, 3]):
        with pytest.raises(ValueError, match="refused row"):
            fused.step(torch.tensor(ids), cache)
    with pytest.raises(ValueError, match="does not fit 3 rows"):
        fused.step(torch.tensor([1, 2, 3]), cache)
    for other in (GPT(tiny_config(n_layer=1)).new_kv_cache(2), GPT(tiny_config(n_head=4)).new_kv_cache(2)):
        with pytest.raises(ValueError, match="does not fit 2 rows of this model"):
            fused.step(torch.tensor([1, 2]), other)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        fused.step(torch.tensor([1, 2]), model.new_kv_cache(2, dtype=torch.float16))
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.k, cache.v, cache.pos)))
    cache.pos[1] = 8  # full
    with pytest.raises(ValueError, match="refused row 1: .* at position 8 \\(cache 8"):
        fused.step(torch.tensor([1, 2]), cache)
    assert torch.equal(cache.pos, torch.tensor([5, 8]))


def test_a_refused_step_raises_under_python_O_too():
    """python -O drops assert statements: the previous test, run there, still sees every refusal raise."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_fastdecode as t; "
            "t.test_a_refused_step_raises_and_changes_nothing(); print('optimize', sys.flags.optimize)")
    out = subprocess.run([sys.executable, "-O", "-c", code, str(Path(__file__).parent)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("optimize 1")


def test_builds_are_keyed_by_the_cpus_instruction_set_not_the_host_name(tmp_path, monkeypatch):
    """A build folder shared by machines of one name with different CPUs: each loads only its own build (-march=
    native: another's may hold instructions its CPU lacks) and prunes only its own older builds."""
    fake = tmp_path / "fake-g++"  # answers -march=native -Q --help=target with $ISA
    fake.write_text('#!/bin/sh\necho "$ISA"\n')
    fake.chmod(0o755)
    keys = []
    for isa, host in (("-mavx512f [enabled]", "a"), ("-mavx512f [disabled]", "a"), ("-mavx512f [enabled]", "b")):
        monkeypatch.setenv("ISA", isa)
        monkeypatch.setattr(platform, "node", lambda: host)
        keys.append(native._machine_key.__wrapped__(str(fake)))
    assert keys[0] != keys[1] and keys[0] == keys[2]

    folder = tmp_path / "kernels"
    folder.mkdir()
    mine = native._machine_key(native._compiler())
    code = hashlib.sha256(native.SOURCE.read_bytes()).hexdigest()[:12]
    other_cpu, earlier = folder / f"decode-{'0' * 12}-{code}.so", folder / f"decode-{mine}-{'0' * 12}.so"
    for stale in (other_cpu, earlier, folder / "decode-0123456789abcdef.so"):  # the last named by host name
        stale.write_bytes(b"not a library: loading this fails")
    native.build_library(native.SOURCE, folder)
    assert sorted(folder.iterdir()) == sorted([other_cpu, folder / f"decode-{mine}-{code}.so"])


def test_collecting_the_tests_builds_nothing_and_writes_nothing_into_the_users_cache(tmp_path):
    """`make test` points the kernel folder at a temporary one before collecting, and collecting builds nothing:
    the user's ~/.cache/gptlab/kernels is neither written nor pruned."""
    code = ("import sys, pytest; pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', sys.argv[1]]); "
            "from gptlab.inference import native; print('builds', native.load_library.cache_info().misses)")
    env = {k: v for k, v in os.environ.items() if k not in ("GPTLAB_KERNELS", "GPTLAB_CACHE")}
    env.update(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"))
    tests = Path(__file__).parent
    out = subprocess.run([sys.executable, "-c", code, str(tests)], capture_output=True, text=True, env=env,
                         cwd=tests.parent, timeout=300)
    assert out.stdout.strip().endswith("builds 0"), out.stdout[-2000:] + out.stderr[-2000:]
    assert not list(tmp_path.rglob("decode-*"))


def test_weights_moved_to_huge_pages_compute_the_same_and_stay_tied():
    model = GPT(tiny_config(n_head=3, n_embd=48)).eval()
    x = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        expected = model(x)[0]
        assert move_to_huge_pages(model)
        assert torch.equal(model(x)[0], expected)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(p.data_ptr() % 64 == 0 for p in model.parameters())  # each on its own cache lines


def test_a_thread_count_raised_between_steps_still_gives_the_reference_logits():
    model = trained_like(dict(n_layer=2, n_head=3, n_embd=60, vocab_size=50, block_size=24))
    fused, threads = fused_decoder(model), torch.get_num_threads()
    caches = [model.new_kv_cache(2) for _ in range(2)]  # torch's, fused's
    first, second = torch.tensor([1, 2]), torch.tensor([3, 4])
    try:
        with torch.inference_mode():
            for cache in caches:
                model(torch.randint(0, 50, (2, 5)).fill_(7), kv_cache=cache)
            torch.set_num_threads(1)
            fused.step(first, caches[1])  # planned for one thread
            model(first[:, None], kv_cache=caches[0])
            torch.set_num_threads(2)
            got = fused.step(second, caches[1])  # two now: a scores row each
            expected = model(second[:, None], kv_cache=caches[0], last_only=True)[0][:, -1]
    finally:
        torch.set_num_threads(threads)
    assert (got - expected).abs().max() <= FP32_TOLERANCE and torch.equal(caches[1].pos, torch.tensor([7, 7]))
