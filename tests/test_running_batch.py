"""The engine at its edges, held to test_engine's outside reference (in helpers: the model's plain forward over the
documented window, penalties worked out in numpy): each penalty alone, windows of 1 to 4 tokens on the cached path
and the server's RunningBatch, the pad row of the fused step, the prompts' checks, and tensors put on the model's
device."""

import pytest
import torch
from helpers import pair, reference_continuation, rows_of, tiny_config

from gptlab.config import SampleConfig
from gptlab.engine import RunningBatch, check_prompts, generate, generate_batch, one_thread
from gptlab.errors import GptlabError
from gptlab.inference.loading import prepare_for_inference
from gptlab.inference.prefix_cache import PrefixCache
from gptlab.model import GPT


@pytest.fixture(autouse=True)
def _one_thread():  # as test_engine's
    with one_thread():
        yield


def running(model, prompts, cfg, n=1):
    """Per-row ids through the server's path (RunningBatch)."""
    return rows_of(generate_batch(model, prompts, cfg, n))


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 2.0}, {"repetition_penalty": 1.3},
                                     {"frequency_penalty": 0.7}, {"presence_penalty": 0.8}],
                         ids=["repetition 2", "repetition 1.3", "frequency", "presence"])
def test_each_penalty_alone_counts_the_prompt_and_the_generated_tokens_on_both_paths(penalty):
    plain, fast = pair()
    prompt = [3, 3, 7, 1, 3, 9, 7, 44, 0]
    cfg = SampleConfig(max_new_tokens=30, temperature=0, **penalty)  # 9 + 30 tokens: the window slides
    expected = reference_continuation(plain, prompt, cfg)
    unpenalised = reference_continuation(plain, prompt, SampleConfig(max_new_tokens=30, temperature=0))
    assert expected != unpenalised  # the penalty changed a greedy choice
    assert rows_of(generate(fast, prompt, cfg)) == [expected]
    assert running(fast, [prompt], cfg) == [expected]


@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
def test_windows_of_a_few_tokens_slide_as_documented_on_both_paths(block_size):
    """Windows this short keep 1, 1, 2, 3 tokens when they slide (helpers.KEEPS): a rebuild from nothing (keep
    1), from one token (keep 2), a slide every token or two, several rows sliding in the same step."""
    plain, fast = pair(n_layer=2, n_head=2, n_embd=32, block_size=block_size)
    cfg = SampleConfig(max_new_tokens=12, temperature=0, frequency_penalty=0.3)
    prompts = [[5], [4, 8, 15, 16, 23, 42]]
    expected = [reference_continuation(plain, p, cfg) for p in prompts]
    assert rows_of(generate_batch(fast, prompts, cfg, 2)) == [e for e in expected for _ in range(2)]
    assert running(fast, prompts, cfg) == expected


def test_without_the_fused_step_a_lone_row_decodes_without_a_pad_row():
    batch = RunningBatch(GPT(tiny_config()).eval())
    batch.join([1, 2, 3], SampleConfig(max_new_tokens=5, temperature=0))
    batch.sample()
    batch.advance()
    assert batch.cache.pos.tolist() == [4]  # its 3 prompt tokens and the one just decoded, nothing beside it


@pytest.mark.device_path("fused decode (native)")
def test_the_fused_step_decodes_a_lone_row_alone(fused_kernel):
    """One row is one row of the fused step (its one-row product rounds as its many-row ones: tests/test_one_row.py),
    not two with a pad row beside it."""
    model = prepare_for_inference(GPT(tiny_config()).eval(), "fp32")
    if not model.fused:
        pytest.skip("no fused fp32 step on this CPU")
    batch = RunningBatch(model)
    batch.join([1, 2, 3], SampleConfig(max_new_tokens=5, temperature=0))
    for _ in range(2):
        batch.sample()
        batch.advance()
    assert batch.cache.pos.tolist() == [5]  # the row: 3 + 2 positions, and no other


def test_each_prompt_goes_through_the_prompt_pass_alone_in_chunks_of_the_caches_size():
    model = GPT(tiny_config()).eval()
    widths = []
    model.transformer.wte.register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
    cfg = SampleConfig(max_new_tokens=1, temperature=0)
    list(generate_batch(model, [[1, 2], [3, 4]], cfg))
    assert widths == [(1, 2), (1, 2)]  # PROMPT_CHUNK is longer than these prompts: one forward each
    widths.clear()
    list(generate_batch(model, [[1, 2, 3, 4, 5, 6, 7], [3, 4, 5]], cfg, prefix_cache=PrefixCache(0, chunk=3)))
    assert widths == [(1, 3), (1, 3), (1, 1), (1, 3)]  # 3 + 3 + 1 and 3: chunk by chunk, prompt by prompt


def test_ids_0_to_vocab_size_minus_1_are_accepted_and_the_rest_refused_on_both_paths():
    model = GPT(tiny_config()).eval()  # a vocabulary of 50
    cfg = SampleConfig(max_new_tokens=2, temperature=0)
    check_prompts(model, [[0, 49], [0]])
    assert len(rows_of(generate_batch(model, [[0], [49, 0]], cfg))) == 2
    assert len(RunningBatch(model).join([0, 49], cfg)) == 1
    for bad in (-1, 50):
        with pytest.raises(GptlabError, match=f"token id {bad} is outside"):
            generate_batch(model, [[1], [2, bad]], cfg)
        with pytest.raises(GptlabError, match=f"token id {bad} is outside"):
            RunningBatch(model).join([bad, 1], cfg)


def test_ragged_prompts_are_padded_with_a_token_the_model_has():
    model = GPT(tiny_config(vocab_size=1)).eval()  # one token: the only id a pad may be
    out = rows_of(generate_batch(model, [[0], [0, 0, 0]], SampleConfig(max_new_tokens=20, temperature=1.0)))
    assert out == [[0] * 20] * 2


def test_the_engine_feeds_the_model_on_the_models_device_whatever_torchs_default_device():
    """A user's torch.set_default_device (here meta, which a CPU model cannot read) must not move what the engine
    builds: prompts, steps, window rebuilds and penalty counts all go on the model's device."""
    model = GPT(tiny_config(block_size=8)).eval()
    cfg = SampleConfig(max_new_tokens=12, temperature=0.8, repetition_penalty=1.2, seed=1)  # 3 + 12 > 8: slides
    prompts = [[1, 2, 3], [4]]
    caches = (None, PrefixCache(2 ** 20, chunk=2))  # a second run of the same prompts reuses their blocks
    expected = [rows_of(generate_batch(model, prompts, cfg, 2, c)) for c in caches]
    with torch.device("meta"):
        got = [rows_of(generate_batch(model, prompts, cfg, 2, c)) for c in caches]
    assert got == expected
