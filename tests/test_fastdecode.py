"""The fused native decode step (gptlab.fastdecode) against the model's torch forward with the same KV cache."""

import copy

import pytest
import torch

from conftest import tiny_config
from gptlab.config import ModelConfig, SampleConfig
from gptlab.engine import generate_batch, generate_uncached, prepare_for_inference
from gptlab.fastdecode import FusedDecoder, fused_decoder, load_library, move_to_huge_pages
from gptlab.model import GPT, Bigram

pytestmark = pytest.mark.skipif(load_library() is None,
                                reason="the fused decode step needs an x86-64 CPU with AVX-512 and g++")

# odd head counts, widths that are not multiples of 16 (the kernels' masked tails), no biases, GPT-2's tanh GELU
SHAPES = [dict(n_layer=2, n_head=3, n_embd=48, vocab_size=101, block_size=40, activation="gelu_tanh"),
          dict(n_layer=2, n_head=5, n_embd=80, vocab_size=67, block_size=40, bias=False),
          dict(n_layer=3, n_head=4, n_embd=128, vocab_size=65, block_size=64, layer_norm_eps=1e-6)]
FP32_TOLERANCE = 1e-5  # max abs difference of logits and cached keys/values; measured: up to 7e-7
# bf16 weights and activations (logits of these models are ~0.1-1): measured against fp32 on the same weights,
# torch path 0.005, fused 0.0026; fused over a bf16 cache against the torch path over one, 0.0068
BF16_TOLERANCE = 0.02


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


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_fused_step_equals_the_torch_forward_in_fp32(shape, rows):
    model = GPT(ModelConfig(**shape)).eval()
    expected, got, (ref, fused) = run_both(model, fused_decoder(model), rows, steps=12)
    assert (got - expected).abs().max() <= FP32_TOLERANCE
    assert torch.equal(fused.pos, ref.pos)  # advanced by one per step, row by row
    assert (fused.k - ref.k).abs().max() <= FP32_TOLERANCE and (fused.v - ref.v).abs().max() <= FP32_TOLERANCE


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_bf16_step_stays_as_close_to_fp32_as_the_torch_bf16_path(shape):
    model = GPT(ModelConfig(**shape)).eval().to(torch.bfloat16)
    exact = copy.deepcopy(model).float()  # the same (bf16-rounded) weights, computed in fp32
    torch.manual_seed(1)  # the same prompts and tokens for both runs
    reference, _, _ = run_both(exact, fused_decoder(exact), 4, steps=8)
    torch.manual_seed(1)
    torch_bf16, fused_bf16, _ = run_both(model, fused_decoder(model), 4, steps=8)
    assert (torch_bf16 - reference).abs().max() <= BF16_TOLERANCE
    assert (fused_bf16 - reference).abs().max() <= BF16_TOLERANCE


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_fused_step_over_a_bf16_cache_follows_the_torch_forward(shape):
    model = GPT(ModelConfig(**shape)).eval().to(torch.bfloat16)
    expected, got, (ref, fused) = run_both(model, fused_decoder(model), 3, steps=8, cache_dtype=torch.bfloat16)
    assert fused.k.dtype == torch.bfloat16 and torch.equal(fused.pos, ref.pos)
    assert (got - expected).abs().max() <= BF16_TOLERANCE
    assert (fused.k.float() - ref.k.float()).abs().max() <= BF16_TOLERANCE


def test_the_engine_decodes_with_the_fused_step_and_gives_the_reference_ids():
    plain = GPT(tiny_config(n_head=3, n_embd=48, block_size=24)).eval()
    fast = prepare_for_inference(copy.deepcopy(plain), "fp32")
    assert isinstance(fast.fused_decoder, FusedDecoder)
    calls = []
    step = fast.fused_decoder.step
    fast.fused_decoder.step = lambda ids, cache: calls.append(len(ids)) or step(ids, cache)
    prompts = [torch.randint(0, 50, (n,)).tolist() for n in (3, 1, 20)]  # ragged, and past the 24-token window
    cfg = SampleConfig(max_new_tokens=60, temperature=0)
    assert list(generate_batch(fast, prompts, cfg)) == list(generate_uncached(plain, prompts, cfg))
    assert calls == [3] * 59  # every decode step after the prefill


def test_the_torch_path_stays_where_the_fused_step_cannot_run():
    unfused = prepare_for_inference(GPT(tiny_config()), "fp32", fused=False)
    assert unfused.fused_decoder is None
    assert fused_decoder(Bigram(tiny_config(arch="bigram"))) is None
    assert fused_decoder(GPT(tiny_config(n_head=1, n_embd=272))) is None  # heads wider than 256
    model = GPT(tiny_config()).eval()
    assert not fused_decoder(model).accepts(model.new_kv_cache(2, dtype=torch.float16))  # fp32 or bf16 caches


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
    model = GPT(tiny_config(n_head=3, n_embd=48, block_size=24)).eval()
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
