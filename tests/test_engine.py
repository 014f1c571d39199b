import pytest
import torch

from conftest import tiny_config
from gptlab.config import SampleConfig
from gptlab.engine import generate, generate_uncached
from gptlab.errors import GptlabError
from gptlab.model import GPT, Bigram


def ids_of(stream):
    return [step for step in stream]


@pytest.mark.parametrize("shape", [dict(), dict(n_layer=3, n_head=3, n_embd=48, block_size=24)])
@pytest.mark.parametrize("prompt_len", [1, 5, 16])
def test_cached_greedy_equals_uncached_across_the_window_boundary(shape, prompt_len):
    model = GPT(tiny_config(**shape)).eval()
    prompt = torch.randint(0, 50, (prompt_len,)).tolist()
    cfg = SampleConfig(max_new_tokens=60, temperature=0)  # 60 > block_size: the window slides several times
    assert ids_of(generate(model, prompt, cfg)) == ids_of(generate_uncached(model, prompt, cfg))


def test_same_seed_same_sample_and_samples_share_one_prefill():
    model = GPT(tiny_config()).eval()
    cfg = SampleConfig(max_new_tokens=30, temperature=1.0, seed=3)
    a = ids_of(generate(model, [1, 2, 3], cfg, num_samples=3))
    assert a == ids_of(generate(model, [1, 2, 3], cfg, num_samples=3))
    rows = list(zip(*a))
    assert len(set(rows)) == 3  # three different continuations
    assert ids_of(generate(model, [1, 2, 3], cfg)) != ids_of(generate(model, [1, 2, 3], SampleConfig(
        max_new_tokens=30, temperature=1.0, seed=4)))


def test_sampled_cached_equals_sampled_uncached_with_the_same_seed():
    model = GPT(tiny_config()).eval()
    cfg = SampleConfig(max_new_tokens=40, temperature=0.9, top_k=10, seed=11)
    assert ids_of(generate(model, [4, 5], cfg)) == ids_of(generate_uncached(model, [4, 5], cfg))


def test_long_prompt_keeps_its_last_block_size_tokens():
    model = GPT(tiny_config()).eval()
    long = torch.randint(0, 50, (40,)).tolist()
    cfg = SampleConfig(max_new_tokens=5, temperature=0)
    assert ids_of(generate(model, long, cfg)) == ids_of(generate(model, long[-16:], cfg))


def test_bigram_generates_through_the_same_engine():
    model = Bigram(tiny_config(arch="bigram")).eval()
    out = ids_of(generate(model, [1], SampleConfig(max_new_tokens=40, temperature=1.0)))
    assert len(out) == 40


def test_empty_prompt_is_refused():
    with pytest.raises(GptlabError, match="prompt is empty"):
        next(generate(GPT(tiny_config()).eval(), [], SampleConfig()))
