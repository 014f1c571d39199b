import copy

import pytest
import torch

from conftest import tiny_config
from gptlab.config import SampleConfig
from gptlab.engine import generate, generate_batch, generate_uncached, one_thread, window_keep
from gptlab.textstream import TextStream, complete
from gptlab.inference import InferenceModel, TorchStep, as_inference, prepare_for_inference
from gptlab.inference.weights import InferenceLinear, can_pack
from gptlab.errors import GptlabError
from gptlab.model import GPT, Bigram
from gptlab.tokenizer import BPETokenizer, CharTokenizer

@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine every parallel region of a
    decode step can wait for a descheduled thread (measured: 0.5 s tests taking 70 s). The paths compared here
    run under the same setting, so correctness is unaffected."""
    with one_thread():
        yield


GREEDY_200 = SampleConfig(max_new_tokens=200, temperature=0)
SHAPES = [dict(), dict(n_layer=3, n_head=3, n_embd=48, block_size=24), dict(n_layer=1, n_head=4, n_embd=32,
                                                                           block_size=9, bias=False)]


def pair(**shape):
    """A plain fp32 model and its inference-prepared (packed) twin, an InferenceModel."""
    plain = GPT(tiny_config(**shape)).eval()
    return plain, prepare_for_inference(copy.deepcopy(plain), "fp32")


def rows_of(stream):
    """Yields per position -> one list of ids per row."""
    return [list(row) for row in zip(*stream)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("prompt_len", [1, 7, 16, 40])
def test_cached_greedy_equals_uncached_for_200_tokens_across_the_window_boundary(shape, prompt_len):
    plain, fast = pair(**shape)
    prompt = torch.randint(0, 50, (prompt_len,)).tolist()
    reference = rows_of(generate_uncached(plain, [prompt], GREEDY_200))
    assert rows_of(generate(plain, prompt, GREEDY_200)) == reference
    assert rows_of(generate(fast, prompt, GREEDY_200)) == reference  # packed weights, same ids


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_each_row_of_a_ragged_batch_gives_what_its_prompt_gives_alone(shape):
    _, fast = pair(**shape)
    prompts = [torch.randint(0, 50, (n,)).tolist() for n in (3, 1, 16, 9, 30)]
    batch = rows_of(generate_batch(fast, prompts, GREEDY_200))
    for prompt, row in zip(prompts, batch):
        assert rows_of(generate(fast, prompt, GREEDY_200)) == [row]


def test_num_samples_share_one_prefill():
    model = GPT(tiny_config()).eval()
    widths = []
    model.transformer.wte.register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
    out = rows_of(generate(model, [1, 2, 3], SampleConfig(max_new_tokens=10, temperature=1.0, seed=3), 4))
    assert widths[0] == (1, 3) and all(w == (4, 1) for w in widths[1:])  # one prefill, then 4 rows per step
    assert len(out) == 4 and len(set(map(tuple, out))) == 4  # four different continuations
    greedy = rows_of(generate(model, [1, 2, 3], SampleConfig(max_new_tokens=10, temperature=0), 3))
    assert greedy == [rows_of(generate(model, [1, 2, 3], SampleConfig(max_new_tokens=10, temperature=0)))[0]] * 3


def test_the_window_slides_to_its_last_three_quarters():
    assert [window_keep(n) for n in (1, 4, 16, 1024)] == [1, 3, 12, 768]
    model = GPT(tiny_config(block_size=16)).eval()
    prefills = []
    model.transformer.wte.register_forward_hook(lambda m, args, out: prefills.append(args[0].shape[1]))
    list(generate(model, [5], SampleConfig(max_new_tokens=30, temperature=0)))
    # the window grows 1 -> 16; the 17th token slides it to 12 (the cache is rebuilt from 11, then the new token
    # goes in like any other); that repeats every 16 - 12 + 1 = 5 tokens
    rebuilds = [i for i, t in enumerate(prefills) if t == 11]
    assert len(rebuilds) == 3 and rebuilds[1] - rebuilds[0] == 6  # 5 decode steps + the rebuild itself
    assert max(prefills) == 11


def test_same_seed_same_samples_and_cached_sampling_equals_uncached():
    model = GPT(tiny_config()).eval()
    cfg = SampleConfig(max_new_tokens=40, temperature=0.9, top_k=10, top_p=0.9, repetition_penalty=1.3, seed=11)
    first = rows_of(generate(model, [4, 5], cfg, 2))
    assert first == rows_of(generate(model, [4, 5], cfg, 2))
    assert first == rows_of(generate_uncached(model, [[4, 5]], cfg, 2))
    other = SampleConfig(max_new_tokens=40, temperature=0.9, top_k=10, top_p=0.9, repetition_penalty=1.3, seed=12)
    assert first != rows_of(generate(model, [4, 5], other, 2))


def test_a_long_prompt_keeps_its_last_block_size_tokens():
    model = GPT(tiny_config()).eval()
    long = torch.randint(0, 50, (40,)).tolist()
    cfg = SampleConfig(max_new_tokens=5, temperature=0)
    assert rows_of(generate(model, long, cfg)) == rows_of(generate(model, long[-16:], cfg))


def test_bigram_generates_through_the_same_engine():
    model = Bigram(tiny_config(arch="bigram")).eval()
    prompts = [[1], [2, 3, 4]]
    out = rows_of(generate_batch(model, prompts, SampleConfig(max_new_tokens=40, temperature=1.0), 2))
    assert len(out) == 4 and all(len(row) == 40 for row in out)
    assert rows_of(generate_batch(model, prompts, GREEDY_200)) == rows_of(generate_uncached(model, prompts,
                                                                                             GREEDY_200))


def test_bad_generation_inputs_are_refused_at_the_call():
    model = GPT(tiny_config()).eval()
    with pytest.raises(GptlabError, match="prompt is empty"):
        generate(model, [], SampleConfig())
    with pytest.raises(GptlabError, match="prompt is empty"):
        generate_batch(model, [[1], []], SampleConfig())
    with pytest.raises(GptlabError, match="outside the model's vocabulary of 50"):
        generate(model, [1, 50], SampleConfig())
    with pytest.raises(GptlabError, match="num_samples"):
        generate(model, [1], SampleConfig(), 0)
    with pytest.raises(GptlabError, match="precision"):
        prepare_for_inference(model, "fp16")


# ---- the inference object ----------------------------------------------------------------------------------------

class CountingStep(TorchStep):
    """The torch step, recording the rows and cache dtype of every call; accepts caches only if `accept`."""

    def __init__(self, model, accept=True):
        super().__init__(model)
        self.accept, self.calls = accept, []

    def accepts(self, cache):
        return self.accept

    def step(self, ids, cache):
        self.calls.append((len(ids), cache.k.dtype))
        return super().step(ids, cache)


def test_the_engine_decodes_with_the_objects_decoder_and_cache_precision():
    model = GPT(tiny_config()).eval()
    cfg = SampleConfig(max_new_tokens=12, temperature=0)
    reference = rows_of(generate(model, [1, 2, 3], cfg, 2))
    counting = CountingStep(model)
    prepared = InferenceModel(model, counting, torch.float32)
    assert rows_of(generate(prepared, [1, 2, 3], cfg, 2)) == reference
    assert counting.calls == [(2, torch.float32)] * 11  # every step after the prefill, over the object's cache
    refusing = CountingStep(model, accept=False)  # a decoder that cannot read the cache: the torch step decodes
    assert rows_of(generate(InferenceModel(model, refusing, torch.float32), [1, 2, 3], cfg, 2)) == reference
    assert refusing.calls == []


def test_a_plain_model_runs_as_it_is_with_the_torch_step():
    model = GPT(tiny_config()).eval()
    plain = as_inference(model)
    assert plain.model is model and isinstance(plain.decoder, TorchStep) and not plain.fused
    assert plain.cache_dtype == torch.float32 and as_inference(plain) is plain
    assert as_inference(model.to(torch.bfloat16)).cache_dtype == torch.float32  # bf16 attention is slow on a CPU


def test_preparing_attaches_nothing_to_the_module():
    model = GPT(tiny_config())
    before = set(vars(model))
    prepared = prepare_for_inference(model, "fp32")
    assert prepared.model is model and set(vars(model)) == before  # children replaced, no attribute added


# ---- inference weights -------------------------------------------------------------------------------------------

needs_onednn = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN on this CPU")
needs_bf16 = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason="no native bf16")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 4, 11])
def test_packed_linear_equals_nn_linear(rows):
    linear = torch.nn.Linear(48, 80)
    x = torch.randn(rows, 1, 48)
    with torch.no_grad():
        assert (InferenceLinear(linear)(x) - linear(x)).abs().max().item() <= 1e-5


@needs_onednn
def test_prepared_model_keeps_the_forward_contract():
    plain, fast = pair()
    assert not any(isinstance(m, (torch.nn.Linear, torch.nn.Dropout)) for m in fast.model.modules())
    x = torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        assert (plain(x)[0] - fast.model(x)[0]).abs().max().item() <= 1e-5


@needs_bf16
def test_bf16_inference_is_close_to_fp32():
    plain = GPT(tiny_config(n_layer=3, n_embd=64, n_head=4)).eval()
    with torch.no_grad():
        plain.transformer.wte.weight.mul_(20)  # logits spread over a range like a trained model's
    half = prepare_for_inference(copy.deepcopy(plain), "bf16")
    assert half.model.transformer.wte.weight.dtype == torch.bfloat16
    x = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        full, approx = plain(x)[0], half.model(x)[0].float()
        # as the engine runs it without the fused step: bf16 weights, fp32 attention
        cache = half.model.new_kv_cache(2, dtype=torch.float32)
        cached = torch.cat([half.model(x[:, :9], kv_cache=cache)[0]] + [
            half.model(x[:, t:t + 1], kv_cache=cache)[0] for t in range(9, 16)], dim=1).float()
    spread = (full.max() - full.min()).item()
    assert spread > 5
    for logits in (approx, cached):  # bf16 keeps 8 bits of mantissa: errors of ~1% of the logits' range
        assert (full - logits).abs().max().item() <= 0.02 * spread
    greedy = SampleConfig(max_new_tokens=30, temperature=0)
    assert len(rows_of(generate(half, [1, 2], greedy))[0]) == 30


# ---- text: stop strings, end-of-text, UTF-8 ------------------------------------------------------------------------

def chain_model(vocab: int, follow: dict[int, int]) -> Bigram:
    """A bigram model that, greedily, always follows token a with token follow[a]."""
    model = Bigram(tiny_config(arch="bigram", vocab_size=vocab)).eval()
    with torch.no_grad():
        for a, b in follow.items():
            model.logits_table.weight[a, b] = 10.0
    return model


CHARS = CharTokenizer("ab\n.")  # ids: "\n" 0, "." 1, "a" 2, "b" 3


def char_ids(text: str) -> list[int]:
    return CHARS.encode(text)


def test_stop_strings_stop_generation_and_are_cut_even_across_tokens():
    model = chain_model(4, {2: 3, 3: 0, 0: 0})  # a -> b -> \n -> \n -> ...
    greedy = SampleConfig(max_new_tokens=20, temperature=0, stop=["\n\n"])
    [done] = complete(model, CHARS, [char_ids("a")], greedy)
    assert (done.text, done.finish_reason) == ("b", "stop")
    assert done.ids == char_ids("b\n\n")  # the tokens that made the stop string are consumed, not shown
    stream = TextStream(model, CHARS, [char_ids("a")], greedy)
    pieces = [p[0] for p in stream]
    assert "".join(pieces) == "b" and "\n" not in "".join(pieces)  # held back, then cut: never shown


def test_the_earliest_stop_string_wins_and_text_without_one_is_all_released():
    model = chain_model(4, {2: 3, 3: 1, 1: 2})  # a -> b -> . -> a -> ...
    two = SampleConfig(max_new_tokens=20, temperature=0, stop=[".a", "b."])
    assert complete(model, CHARS, [char_ids("a")], two)[0].text == ""  # "b." starts first
    none = SampleConfig(max_new_tokens=7, temperature=0, stop=["bb"])
    [done] = complete(model, CHARS, [char_ids("a")], none)
    assert (done.text, done.finish_reason) == ("b.ab.ab", "length")


def test_rows_stop_independently_and_the_stream_ends_when_all_have():
    model = chain_model(4, {2: 3, 3: 0, 0: 0, 1: 1})  # a -> b -> \n ...; . -> . -> ...
    cfg = SampleConfig(max_new_tokens=50, temperature=0, stop=["\n"])
    stream = TextStream(model, CHARS, [char_ids("a"), char_ids(".")], cfg)
    steps = list(stream)
    assert len(steps) == 51  # the "." row never stops: all 50 tokens, then the closing step
    first, second = stream.completions
    assert (first.text, first.finish_reason) == ("b", "stop")
    assert (second.text, second.finish_reason) == ("." * 50, "length")
    early = TextStream(model, CHARS, [char_ids("a"), char_ids("b")], cfg)
    assert len(list(early)) == 2  # both rows stop at their first newline: no more decoding


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(["hello world, the quick brown fox. " * 20], 300)


def test_end_of_text_ends_a_row_and_is_not_shown(bpe):
    tokenizer = bpe
    hello = tokenizer.encode(" hello")
    model = chain_model(tokenizer.vocab_size, {hello[0]: tokenizer.eot_id, tokenizer.eot_id: hello[0]})
    [done] = complete(model, tokenizer, [hello], SampleConfig(max_new_tokens=10, temperature=0))
    assert (done.text, done.finish_reason, done.ids) == ("", "eot", [])


def test_streamed_text_never_splits_a_multi_byte_character(bpe):
    ids = bpe.encode("🙂é 日")  # every byte a different token
    assert any("\ufffd" in bpe.decode([i]) for i in ids)  # some tokens hold part of a character
    start = bpe.encode("h")
    model = chain_model(bpe.vocab_size, dict(zip(start + ids, ids)))  # h -> the bytes of the text, in turn
    stream = TextStream(model, bpe, [start], SampleConfig(max_new_tokens=len(ids), temperature=0))
    pieces = [p[0] for p in stream]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "🙂é 日" and pieces[:4] == ["", "", "", "🙂"]


def test_same_seed_same_text():
    model = GPT(tiny_config(vocab_size=4)).eval()
    cfg = SampleConfig(max_new_tokens=50, temperature=1.0, seed=5)
    texts = [c.text for c in complete(model, CHARS, [char_ids("ab")], cfg, 2)]
    assert texts == [c.text for c in complete(model, CHARS, [char_ids("ab")], cfg, 2)]
    assert texts[0] != texts[1]


def test_the_readmes_python_example_runs(tmp_path):
    """The README's engine example, as written, on a tiny run (a moved name fails here, not in a user's hands)."""
    import re
    from pathlib import Path

    from conftest import CORPUS
    from gptlab.cli import main
    from gptlab.runtime import bf16_supported

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks, "the README has no Python example"
    (tmp_path / "corpus.txt").write_text(CORPUS, encoding="utf-8")  # byte-level BPE: any prompt encodes
    data, run = tmp_path / "data", tmp_path / "run"
    assert main(["prepare", str(tmp_path / "corpus.txt"), "--out", str(data), "--tokenizer", "bpe", "--vocab-size",
                 "300", "--quiet"]) == 0
    assert main(["train", "--data", str(data), "--run", str(run), "--max-steps", "3", "--n-layer", "1", "--n-head",
                 "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4", "--eval-interval", "3",
                 "--eval-batches", "1", "--quiet"]) == 0
    for code in blocks:
        code = code.replace('"runs/char-quick"', repr(str(run)))
        if not bf16_supported(torch.device("cpu")):
            code = code.replace('"bf16"', '"fp32"')
        namespace: dict = {}
        exec(compile(code, "README.md", "exec"), namespace)
        assert namespace["texts"] and all(isinstance(t, str) for t in namespace["texts"])
