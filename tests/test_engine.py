import copy
from dataclasses import dataclass, field, replace

import pytest
import torch

from helpers import (CORPUS, pair, perturbed, reference_continuation, reference_greedy, reference_window, rows_of,
                     tiny_config)
from gptlab.config import SampleConfig
from gptlab.engine import RunningBatch, generate, generate_batch, generate_uncached, one_thread, window_keep
from gptlab.textstream import Completion, TextStream, complete
from gptlab.inference.loading import bf16_storage_possible, prepare_for_inference
from gptlab.inference.prepared import InferenceModel, TorchStep, as_inference
from gptlab.inference.weights import InferenceLinear, can_pack, pack_linears
from gptlab.errors import GptlabError
from gptlab.model import GPT, Bigram
from gptlab.runtime import bf16_supported
from gptlab.tokenizer import BPETokenizer

@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine every parallel region of a
    decode step can wait for a descheduled thread (a test many times slower). The paths compared here
    run under the same setting, so correctness is unaffected."""
    with one_thread():
        yield


# a small frequency penalty: a small model's plain greedy text soon loops on one token, whatever its window holds
GREEDY_200 = SampleConfig(max_new_tokens=200, temperature=0, frequency_penalty=0.05)
SHAPES = [dict(), dict(n_layer=3, n_head=3, n_embd=48, block_size=24), dict(n_layer=1, n_head=4, n_embd=32,
                                                                           block_size=9, bias=False)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("prompt_len", [1, 7, 16, 40])
def test_cached_greedy_equals_the_plain_forward_for_200_tokens_across_the_window_boundary(shape, prompt_len):
    plain, fast = pair(**shape)
    prompt = torch.randint(0, 50, (prompt_len,)).tolist()
    expected = [reference_continuation(plain, prompt, GREEDY_200)]
    assert len(set(expected[0][-60:])) > 10  # still changing at the end, not one token over and over
    assert rows_of(generate(plain, prompt, GREEDY_200)) == expected
    assert rows_of(generate(fast, prompt, GREEDY_200)) == expected  # packed weights, same ids
    assert rows_of(generate_uncached(plain, [prompt], GREEDY_200)) == expected  # the library's own reference


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_each_row_of_a_ragged_batch_equals_the_plain_forward_with_penalties(shape):
    plain, fast = pair(**shape)
    prompts = [torch.randint(0, 50, (n,)).tolist() for n in (3, 1, 16, 9, 30)]
    cfg = SampleConfig(max_new_tokens=60, temperature=0, repetition_penalty=1.3, frequency_penalty=0.2,
                       presence_penalty=0.3)
    batch = rows_of(generate_batch(fast, prompts, cfg, num_samples=2))
    for p, prompt in enumerate(prompts):
        expected = reference_continuation(plain, prompt, cfg)
        assert batch[2 * p:2 * p + 2] == [expected, expected], f"prompt {p}"


def test_the_uncached_reference_decodes_what_the_plain_loop_decodes_with_penalties():
    """generate_uncached, the yardstick of the cached decoder, against helpers.reference_continuation (a loop over
    the plain forward written out in the test helpers): penalties over the prompt and the window that slides."""
    torch.manual_seed(1)
    plain = GPT(tiny_config()).eval()
    prompts = [torch.randint(0, 50, (n,)).tolist() for n in (2, 16, 9)]
    cfg = SampleConfig(max_new_tokens=30, temperature=0, repetition_penalty=1.3, frequency_penalty=0.2,
                       presence_penalty=0.3)
    got = rows_of(generate_uncached(plain, prompts, cfg))
    assert got == [reference_continuation(plain, prompt, cfg) for prompt in prompts]


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
    model = perturbed(GPT(tiny_config())).eval()
    cfg = SampleConfig(max_new_tokens=40, temperature=0.9, top_k=10, top_p=0.9, repetition_penalty=1.3, seed=11)
    first = rows_of(generate(model, [4, 5], cfg, 2))
    assert first == rows_of(generate(model, [4, 5], cfg, 2))
    assert first == rows_of(generate_uncached(model, [[4, 5]], cfg, 2))
    other = SampleConfig(max_new_tokens=40, temperature=0.9, top_k=10, top_p=0.9, repetition_penalty=1.3, seed=12)
    assert first != rows_of(generate(model, [4, 5], other, 2))


def test_a_long_prompt_keeps_its_last_block_size_tokens():
    model = perturbed(GPT(tiny_config())).eval()
    long = torch.randint(0, 50, (40,)).tolist()
    cfg = SampleConfig(max_new_tokens=8, temperature=0, frequency_penalty=0.05)
    assert rows_of(generate(model, long, cfg)) == rows_of(generate(model, long[-16:], cfg))
    assert rows_of(generate(model, long[:16], cfg)) != rows_of(generate(model, long[-16:], cfg))  # they differ


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


# ---- an outside reference: the model's plain forward over the documented window (helpers.reference_window) -------

BLOCK = 16
TEXT = "Grüße aus Köln, schöne Straße. 日本語のテキストです。Ça va très bien? Ωμέγα και άλφα! "


@pytest.fixture(scope="module")
def trained():
    """A byte-level BPE over non-ASCII text (characters split across tokens) and a GPT trained on it a few dozen
    steps: its text looks like TEXT, so stop strings occur, and training moved every weight, LayerNorms and biases
    included, away from init (where a LayerNorm or bias bug hides)."""
    tokenizer = BPETokenizer.train([TEXT * 20], 300)
    ids = torch.tensor(tokenizer.encode(TEXT * 8))
    with one_thread():
        torch.manual_seed(0)
        model = GPT(tiny_config(vocab_size=tokenizer.vocab_size, block_size=BLOCK))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(60):
            starts = torch.randint(0, len(ids) - BLOCK - 1, (16,))
            x = torch.stack([ids[s:s + BLOCK] for s in starts])  # (16, BLOCK)
            y = torch.stack([ids[s + 1:s + BLOCK + 1] for s in starts])
            opt.zero_grad()
            model(x, y)[1].backward()
            opt.step()
    assert model.transformer.ln_f.bias.abs().min() > 0 and (model.transformer.h[0].ln_1.weight != 1).all()
    return tokenizer, model.eval()


def reference_text(tokenizer, generated, stops) -> tuple[str, str]:
    """(text, finish reason) of a row's ids: decoded whole, cut at the first stop string; the end-of-text token
    ends it."""
    reason = "length"
    if tokenizer.eot_id in generated:
        generated, reason = generated[:generated.index(tokenizer.eot_id)], "eot"
    text = tokenizer.decode(generated)
    hits = [text.find(s) for s in stops if s in text]
    return (text[:min(hits)], "stop") if hits else (text, reason)


@dataclass
class Track:
    prompt: list[int]
    cfg: SampleConfig
    completion: Completion
    generated: list[int] = field(default_factory=list)
    penalty_mattered: bool = False  # a greedy choice the penalties changed


def check_step(plain, track, token, logits, where):
    """Hold one drawn row to the reference: its logits within 1e-5 of the plain forward over its window; a greedy
    row's token the argmax of the hand-penalised logits."""
    window = reference_window(track.prompt, track.generated, BLOCK)
    with torch.no_grad():
        expected = plain(torch.tensor([window]))[0][0, -1]  # no cache: the whole window, every step
    error = (logits[0] - expected).abs().max().item()
    assert error <= 1e-5, f"{where}: logits differ from the plain forward by {error:.2e} (window {len(window)})"
    if track.cfg.temperature == 0:
        want = reference_greedy(expected, track.prompt, track.generated, track.cfg, BLOCK)
        assert token == want, f"{where}: token {token}, the reference takes {want}"
        track.penalty_mattered |= token != int(expected.argmax())


def drive_against_reference(batch, plain, tokenizer, joins) -> list[Track]:
    """Run `batch` as the server does (joins[step] = [(prompt, cfg, n), ...] before that step; a row leaves when its
    Completion finishes), every row of every step checked by check_step; the rows' tracks, by join."""
    tracks, live, step = [], {}, 0
    while live or any(k >= step for k in joins):
        for prompt, cfg, n in joins.get(step, []):
            for row in batch.join(prompt, cfg, n):
                live[row] = Track(list(prompt), cfg, Completion(tokenizer, cfg.stop))
                tracks.append(live[row])
        for row, token, logits in batch.sample():
            track = live[row]
            check_step(plain, track, token, logits, f"step {step}, row {tracks.index(track)}")
            track.generated.append(token)
            track.completion.push(token)
            if track.completion.finish_reason is not None:
                batch.leave([row])
        batch.advance()
        for row in [r for r in live if r not in batch.rows]:
            live.pop(row).completion.close("length")
        step += 1
    return tracks


def decoders(kind, model):
    """The model as RunningBatch runs it: the torch step over the plain model, over packed weights, or fused."""
    if kind == "torch step":
        return copy.deepcopy(model)
    prepared = prepare_for_inference(copy.deepcopy(model), "fp32", fused=kind == "fused step")
    assert prepared.fused == (kind == "fused step")
    return prepared


@pytest.mark.parametrize("kind", ["torch step", "packed torch step",
                                  pytest.param("fused step", marks=pytest.mark.device_path("fused decode (native)"))])
def test_running_batch_equals_the_plain_forward_over_the_documented_window(trained, kind, request):
    if kind == "fused step":
        request.getfixturevalue("fused_kernel")
    tokenizer, plain = trained
    greedy = SampleConfig(max_new_tokens=40, temperature=0, repetition_penalty=1.3, frequency_penalty=0.4,
                          presence_penalty=0.6)
    sampled = SampleConfig(max_new_tokens=40, temperature=1.0, top_k=30, top_p=0.95, repetition_penalty=1.2,
                           stop=["Ωμ", "ß"], seed=3)
    joins = {0: [(tokenizer.encode("Grüße aus"), greedy, 1), (tokenizer.encode(TEXT), sampled, 2)],
             3: [(tokenizer.encode("Ω"), replace(greedy, max_new_tokens=30, presence_penalty=1.0,
                                                  stop=["très"]), 1)],
             6: [(tokenizer.encode("日本語の"), SampleConfig(max_new_tokens=25, temperature=0.8, frequency_penalty=0.3,
                                                        stop=["。"], seed=9), 3)]}
    assert len(joins[0][1][0]) > BLOCK  # a prompt longer than the window
    tracks = drive_against_reference(RunningBatch(decoders(kind, plain)), plain, tokenizer, joins)
    for i, track in enumerate(tracks):
        text, reason = reference_text(tokenizer, track.generated, track.cfg.stop)
        assert (track.completion.text, track.completion.finish_reason) == (text, reason), f"row {i}"
    # the scenario reached what it names: stops, windows that slid, penalties that changed a greedy choice
    assert any(t.completion.finish_reason == "stop" for t in tracks)
    assert any(len(t.prompt[-BLOCK:]) + len(t.generated) > BLOCK + 5 for t in tracks)
    assert all(t.penalty_mattered for t in tracks if t.cfg.temperature == 0)


def test_each_sample_of_each_prompt_is_that_prompt_alone_with_seed_plus_i(trained):
    """Five prompts of different lengths, three samples each: sample i of every prompt gives the text of that prompt
    alone with seed + i (wrapped into [0, 2**63): the seed here wraps to 0 at its third sample)."""
    tokenizer, model = trained
    prompts = [tokenizer.encode(t) for t in ("Grüße", "日本語のテ", "Ω", TEXT[:30], "Ça va")]
    cfg = SampleConfig(max_new_tokens=20, temperature=1.2, seed=2**63 - 2)
    stream = TextStream(model, tokenizer, prompts, cfg, 3)
    for _ in stream:
        pass
    texts = [c.text for c in stream.completions]
    for p, prompt in enumerate(prompts):
        mine = texts[3 * p:3 * p + 3]
        assert len(set(mine)) == 3, "samples that agree could hide a wrong seed"
        for i, text in enumerate(mine):
            alone = replace(cfg, seed=(2**63 - 2 + i) % 2**63)
            assert text == complete(model, tokenizer, [prompt], alone)[0].text, f"prompt {p}, sample {i}"

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
    # off the CPU (the meta device stands for a GPU here) the cache keeps the weights' dtype, torch-step decoded
    for dtype in (torch.bfloat16, torch.float16):
        assert as_inference(GPT(tiny_config()).to("meta", dtype)).cache_dtype == dtype


def test_preparing_attaches_nothing_to_the_module():
    model = GPT(tiny_config())
    before = set(vars(model))
    prepared = prepare_for_inference(model, "fp32")
    assert prepared.model is model and set(vars(model)) == before  # children replaced, no attribute added


# ---- inference weights -------------------------------------------------------------------------------------------

needs_onednn = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN on this CPU")
# bf16 inference: native products, or bf16 storage decoded by the fused step (a compiler) with widened prompts
needs_bf16 = pytest.mark.skipif(not (can_pack(torch.device("cpu"), torch.bfloat16) or bf16_storage_possible(
    torch.device("cpu"))), reason="no native bf16 and no g++ for the fused bf16 step")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 4, 11])
def test_packed_linear_equals_nn_linear(rows):
    linear = torch.nn.Linear(48, 80)
    x = torch.randn(rows, 1, 48)
    with torch.no_grad():
        assert (InferenceLinear(linear, widen=False)(x) - linear(x)).abs().max().item() <= 1e-5


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 4, 5])
@pytest.mark.parametrize("bias", [True, False])
def test_a_widened_bf16_linear_is_the_fp32_product_of_its_bf16_values_rounded_to_bf16(rows, bias):
    """Where the CPU has no native bf16 products, a bf16 model's prompts multiply in fp32: the bf16 weights widened
    (exactly) and the result rounded back to bf16 once, whichever side of the padded-rows edge (MIN_ROWS = 4)."""
    linear = torch.nn.Linear(48, 80, bias=bias)
    with torch.no_grad():
        if bias:
            linear.bias.uniform_(2, 3)  # a bias lost or left in bf16 rounding shows
    linear = linear.to(torch.bfloat16)
    x = torch.randn(rows, 2, 48).to(torch.bfloat16)
    widened = InferenceLinear(linear, widen=True)
    with torch.no_grad():
        y = widened(x)
        fp32 = torch.nn.functional.linear(x.float(), linear.weight.float(),
                                          None if linear.bias is None else linear.bias.float())
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 2, 80)
    assert widened.dtype == torch.float32 and "computes_in=torch.float32" in repr(widened)
    # one rounding to bf16 (8 significant bits) of an fp32 product: within half a bf16 step of it, plus fp32's sums
    assert ((y.float() - fp32).abs() <= fp32.abs() * 2 ** -8 + 1e-4).all()
    assert repr(InferenceLinear(torch.nn.Linear(48, 80), widen=False)) == "InferenceLinear(in_features=48, out_features=80, bias=True)"
    assert repr(widened) == ("InferenceLinear(in_features=48, out_features=80, bias=%s, computes_in=torch.float32)"
                             % bias)


def test_a_linear_packs_its_weight_in_the_dtype_it_computes_in_for_the_batch_rows(monkeypatch):
    """What oneDNN is asked to pack (recorded, so that a CPU without bf16 products checks it too): the weight in its
    own dtype unless widened, in fp32 when widened, laid out for MIN_ROWS rows."""
    asked = []
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, rows: asked.append((w.dtype, rows)) or w)
    own = InferenceLinear(torch.nn.Linear(8, 4).to(torch.bfloat16), widen=False)
    assert (own.dtype, own.out_dtype) == (torch.bfloat16, torch.bfloat16) and asked == [(torch.bfloat16, 4)]
    widened = InferenceLinear(torch.nn.Linear(8, 4).to(torch.bfloat16), widen=True)
    assert (widened.dtype, widened.out_dtype, widened.bias.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    assert asked[1:] == [(torch.float32, 4)]


@needs_onednn
def test_a_bf16_model_packs_fp32_copies_exactly_where_the_cpu_has_no_native_bf16_products():
    model = GPT(tiny_config()).to(torch.bfloat16)
    pack_linears(model)
    linears = [m for m in model.modules() if isinstance(m, InferenceLinear)]
    assert len(linears) == 4 * model.config.n_layer + 1  # c_attn, c_proj, c_fc, mlp c_proj per block, the LM head
    native = bf16_supported(torch.device("cpu"))
    assert {m.dtype for m in linears} == {torch.bfloat16 if native else torch.float32}
    assert {m.out_dtype for m in linears} == {torch.bfloat16}
    fp32 = GPT(tiny_config())
    pack_linears(fp32)
    assert {m.dtype for m in fp32.modules() if isinstance(m, InferenceLinear)} == {torch.float32}


@needs_onednn
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_kernel_lines_time_the_linears_as_the_engine_packs_them(monkeypatch, precision):
    """`gptlab bench generate`'s kernel lines pack each Linear as pack_linears does (a bf16 one widened to fp32
    where the CPU has no bf16 products) and run all three paths; the clock stubbed to one call each."""
    from gptlab.bench import kernels

    built = []
    monkeypatch.setattr(kernels, "time_it", lambda fn, device, min_seconds: fn() or 0.0)
    monkeypatch.setattr(kernels, "InferenceLinear", lambda m, widen: built.append(InferenceLinear(m, widen)) or
                        built[-1])
    model = GPT(tiny_config())
    times = kernels.linear_kernel_times(model, precision, torch.device("cpu"))
    assert list(times) == ["F.linear", "oneDNN-packed", "packed, padded to 4 rows"]
    engine = GPT(tiny_config()).to(kernels.FLOAT_DTYPES[precision])
    pack_linears(engine)
    assert {m.dtype for m in built} == {m.dtype for m in engine.modules() if isinstance(m, InferenceLinear)}
    assert len(built) == 4 * model.config.n_layer + 1


@pytest.mark.parametrize("native_bf16", [True, False])
def test_which_linears_are_packed_and_widened_is_chosen_by_what_the_cpu_computes(monkeypatch, native_bf16):
    """The choice itself, on any CPU: whether oneDNN packs each dtype is pretended, the packing recorded. A bf16
    model is packed as it is where bf16 products are native, widened to fp32 where only fp32 ones are, left as
    nn.Linears where neither is; an fp32 model is packed, never widened; dropouts go in every case."""
    import gptlab.inference.weights as weights

    made = []

    class Recorded(torch.nn.Module):
        def __init__(self, linear, widen=False):
            super().__init__()
            made.append(widen)

    monkeypatch.setattr(weights, "InferenceLinear", Recorded)
    linears = 4 * tiny_config().n_layer + 1
    for packs, dtype, widened in [({torch.float32, torch.bfloat16} if native_bf16 else {torch.float32},
                                   torch.bfloat16, not native_bf16),
                                  ({torch.float32, torch.bfloat16} if native_bf16 else {torch.float32},
                                   torch.float32, False), (set(), torch.bfloat16, None)]:
        monkeypatch.setattr(weights, "can_pack", lambda device, d: d in packs)
        made.clear()
        model = GPT(tiny_config(dropout=0.1)).to(dtype)
        weights.pack_linears(model)
        assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
        assert made == ([] if widened is None else [widened] * linears), (packs, dtype)
        assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == (linears if widened is None else 0)


def test_onednn_packs_fp32_on_the_cpu_bf16_where_native_and_nothing_else(monkeypatch):
    import types

    cpu = torch.device("cpu")
    available = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    assert can_pack(cpu, torch.float32) == available  # torch's CPU wheels have oneDNN: True here
    assert can_pack(cpu, torch.bfloat16) == (available and bf16_supported(cpu))
    assert not can_pack(cpu, torch.float16) and not can_pack(cpu, torch.float64)
    assert not can_pack(torch.device("meta"), torch.float32)  # off the CPU (a GPU has its own products)
    for native in (True, False):  # a CPU with native bf16 products, pretended on any CPU: bf16 packs, fp16 never
        monkeypatch.setattr("gptlab.inference.weights.bf16_supported", lambda device: native)
        assert [can_pack(cpu, d) for d in (torch.bfloat16, torch.float16)] == [available and native, False]
    monkeypatch.undo()
    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace())  # a torch without the packed Linear op
    assert not can_pack(cpu, torch.float32)
    monkeypatch.undo()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # a torch built without oneDNN
    assert not can_pack(cpu, torch.float32)


@pytest.mark.parametrize("device, weights, fused, int8, expected", [
    ("cpu", torch.float32, False, False, torch.float32),
    ("cpu", torch.bfloat16, False, False, torch.float32),  # torch's bf16 attention is slow on a CPU
    ("cpu", torch.bfloat16, True, False, torch.bfloat16),  # the fused step reads half the bytes
    ("cpu", torch.float32, True, True, torch.bfloat16),  # int8's fused step too, over fp32 activations
    ("cpu", torch.float32, True, False, torch.float32),
    ("cpu", torch.float32, False, True, torch.float32),  # int8 by torch ops on a CPU
    ("meta", torch.float16, False, False, torch.float16),  # off the CPU: the weights' dtype
    ("meta", torch.float32, False, True, torch.float32),  # int8 by torch ops off the CPU: its fp32 activations
])
def test_the_cache_dtype_follows_the_step_that_reads_it(device, weights, fused, int8, expected):
    from gptlab.inference.prepared import cache_dtype

    assert cache_dtype(torch.device(device), weights, fused=fused, int8=int8) == expected


def test_weights_move_into_huge_pages_only_where_they_can(monkeypatch):
    """move_to_huge_pages says whether it moved anything: not a model without parameters, not one off the CPU (left
    as it is), not where the mapping cannot be made; a CPU model's weights keep their values and ties."""
    import mmap

    from gptlab.inference.weights import move_to_huge_pages

    assert move_to_huge_pages(torch.nn.Sequential()) is False
    on_meta = GPT(tiny_config()).to("meta")
    assert move_to_huge_pages(on_meta) is False and on_meta.transformer.wte.weight.device.type == "meta"
    model = GPT(tiny_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def refused(*args, **kwargs):
        raise OSError("no memory for the mapping")

    with monkeypatch.context() as m:
        m.setattr(mmap, "mmap", refused)
        assert move_to_huge_pages(model) is False
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert move_to_huge_pages(model) is True
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.lm_head.weight is model.transformer.wte.weight


def test_an_inference_models_cache_is_in_its_dtype_length_and_attention_precision():
    """new_kv_cache: the cache dtype the model was prepared with (not the weights': a bf16 model decoded by torch
    ops keeps an fp32 cache), the length asked (else the context), the attention precision it was given."""
    half = as_inference(GPT(tiny_config()).to(torch.bfloat16))
    cache = half.new_kv_cache(2)
    assert cache.k.dtype == cache.v.dtype == torch.float32 and cache.max_len == 16 and cache.attend is None
    model = GPT(tiny_config())
    given = InferenceModel(model, TorchStep(model), torch.bfloat16, "fp32", attend=torch.bfloat16)
    short = given.new_kv_cache(3, max_len=5)
    assert (short.k.dtype, short.v.shape, short.attend) == (torch.bfloat16, (2, 3, 2, 5, 16), torch.bfloat16)


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


def test_the_readmes_python_example_runs(tmp_path):
    """The generation guide's engine example, as written, on a tiny run (a moved name fails here, not in a user's
    hands)."""
    import re
    from pathlib import Path

    from gptlab.cli import main

    guide = Path(__file__).resolve().parents[1] / "docs" / "guides" / "05-generation.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(encoding="utf-8"), re.S)
    assert blocks, "the generation guide has no Python example"
    (tmp_path / "corpus.txt").write_text(CORPUS, encoding="utf-8")  # byte-level BPE: any prompt encodes
    data, run = tmp_path / "data", tmp_path / "run"
    assert main(["prepare", str(tmp_path / "corpus.txt"), "--out", str(data), "--tokenizer", "bpe", "--vocab-size",
                 "300", "--quiet"]) == 0
    assert main(["train", "--data", str(data), "--run", str(run), "--max-steps", "3", "--n-layer", "1", "--n-head",
                 "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4", "--eval-interval", "3",
                 "--eval-batches", "1", "--quiet"]) == 0
    for code in blocks:
        if "OpenAI(" in code:  # a client of `gptlab serve`: tests/test_serve_chat.py runs it against a server
            continue
        code = code.replace('"runs/char-quick"', repr(str(run)))
        if not bf16_supported(torch.device("cpu")):
            code = code.replace('"bf16"', '"fp32"')
        namespace: dict = {}
        exec(compile(code, str(guide), "exec"), namespace)
        assert namespace["texts"] and all(isinstance(t, str) for t in namespace["texts"])
