"""llama.cpp itself as the peer of the GGUF export: llama-cpp-python built from source (`make peers` installs it and
runs these; without it they skip and say so). llama.cpp tokenizes and detokenizes as gptlab does for every kind of
tokenizer; its logits of an exported model equal gptlab's; greedy decoding of a trained run's export equals
gptlab's; q8_0's distributions are held to gptlab's fp32 by their KL divergence.

llama.cpp's CPU GELU reads a table of fp16 values (ggml-cpu/vec.h, GGML_GELU_FP16: the input rounded to fp16, the
output an fp16), so gptlab's exact fp32 logits differ from llama.cpp's by that rounding; with the table's rounding
written into gptlab's model (`GGMLGelu`, from llama.cpp's source) they agree within a few fp16 steps of that table,
and with the MLPs silenced to fp32's rounding.
Parity runs use an fp32 KV cache without flash attention (llama.cpp's default keeps keys and values in fp16). llama.cpp
runs on one thread here: its threads meet at a spinning barrier after every operation, which on a machine as busy
as a parallel test run turns each tiny decode into scheduler waits."""

import copy

import numpy as np
import pytest
import torch

from helpers import CORPUS, GGUF_TEXT, model_run, perturbed, tiny_config, tiny_run
from gptlab.checkpoint import load_run
from gptlab.config import SampleConfig
from gptlab.engine import generate_batch
from gptlab.errors import GptlabError
from gptlab.ggml.gguf_out import export_gguf
from gptlab.ggml.peer import LlamaCpp, available
from gptlab.model import GPT
from gptlab.tokenizer import BPETokenizer, CharTokenizer, ChatTokenizer, GPT2Tokenizer

pytestmark = [pytest.mark.device_path("llama.cpp peer"),
              pytest.mark.skipif(not available(), reason="llama.cpp is not installed: `make peers` builds it and runs "
                                 "these tests")]
VARIED = ("Héllo wörld — naïve café 😀🚀 👩‍👩‍👧 日本語テキスト, Ελληνικά; e\u0301\n\n\n\t  spaces   and\r\n"
          "12345 3.14159 1,000,000 don't we'll I'M they've it's 'quoted'   \n \n  x\u00a0y   ")
LOGIT_TOLERANCE = 5e-4  # of the largest |logit|: gptlab with llama.cpp's GELU table against llama.cpp
TABLE_TOLERANCE = 3e-3  # the same, with gptlab's own GELU: what the fp16 table costs
FP32_TOLERANCE = 1e-5  # the same, with no GELU table in the way
TIE = 1e-3  # a greedy choice whose top-2 gap is below this (of the largest |logit|) may go either way


class GGMLGelu(torch.nn.Module):
    """llama.cpp's CPU GELU: 0 at x <= -10, x at x >= 10, else the tanh form of x rounded to fp16, rounded to fp16."""

    def forward(self, x):
        table = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
        return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))


def with_ggml_gelu(model):
    for block in model.transformer.h:
        block.mlp.gelu = GGMLGelu()
    return model


def exported(tmp_path, model, tokenizer, outtype="f32"):
    run = model_run(tmp_path / f"run-{outtype}", model, tokenizer)
    return export_gguf(run, tmp_path / f"m-{outtype}.gguf", outtype).path


@pytest.mark.parametrize("kind", ["gpt2", "bpe", "char", "chat-gpt2", "chat-char"])
def test_llama_cpp_tokenizes_and_detokenizes_as_gptlab(tmp_path, kind):
    text = VARIED + GGUF_TEXT
    samples = (text, " leading space", "x", "\n\n", "don't", CORPUS[:300])
    tokenizer = {"gpt2": GPT2Tokenizer, "bpe": lambda: BPETokenizer.train([VARIED * 3, CORPUS], 400),
                 "char": lambda: CharTokenizer("".join(samples)), "chat-gpt2": lambda: ChatTokenizer(GPT2Tokenizer()),
                 "chat-char": lambda: ChatTokenizer(CharTokenizer("".join(samples)))}[kind]()
    model = GPT(tiny_config(vocab_size=tokenizer.vocab_size, activation="gelu_tanh"))
    with LlamaCpp(exported(tmp_path, model, tokenizer), 16, threads=1) as peer:
        for sample in samples:
            ids = tokenizer.encode(sample)
            assert peer.tokenize(sample) == ids, sample
            assert peer.detokenize(ids) == sample.encode(), sample
        if kind.startswith("chat"):
            marked = "<|user|>" + text[:40] + "<|end|><|assistant|>"
            assert peer.tokenize(marked, special=True) == tokenizer.encode(marked, allow_special=True)
        if kind in ("gpt2", "bpe"):
            assert peer.tokenize("a<|endoftext|>b", special=True) == tokenizer.encode("a<|endoftext|>b", True)


def llama_logits(tmp_path, model, tokenizer, ids):
    """llama.cpp's logits of `ids` fed at once and fed one at a time (fp32 cache, no flash attention); on the way,
    the last position's alone are the last row of all of them, in batches of 7 as in one, and each decode
    continues where the sequence stands (its greedy steps included)."""
    path = exported(tmp_path, model, tokenizer)
    with LlamaCpp(path, model.config.block_size, threads=1, f32_cache=True) as peer:
        at_once = peer.decode(ids, all_logits=True)
        assert peer.pos == len(ids)
        peer.clear()
        last = peer.decode(ids)
        scale = np.abs(at_once).max()  # (llama.cpp computes the last block for the outputs' rows alone: other sums)
        assert last.shape == (1, peer.n_vocab) and np.abs(last - at_once[-1:]).max() <= FP32_TOLERANCE * scale
        peer.clear()
        one_by_one = np.concatenate([peer.decode([i], all_logits=True) for i in ids])
        peer.generate(ids[:5], 4)  # 5 prompt tokens, then 3 greedy steps
        assert peer.pos == 5 + 3
    with LlamaCpp(path, model.config.block_size, threads=1, f32_cache=True, n_batch=7) as peer:
        assert np.abs(peer.decode(ids, all_logits=True) - at_once).max() <= FP32_TOLERANCE * scale
    return at_once, one_by_one


SHAPES = [{"n_embd": 96, "n_head": 3, "n_layer": 2},
          {"n_embd": 64, "n_head": 4, "n_layer": 3, "bias": False, "layer_norm_eps": 1e-4}]


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_gptlabs(tmp_path, shape):
    """A GPT-2-shaped random model off its init, every position. The GELU table rounds its input to fp16, so a
    last-bit difference in an MLP's input can move a table entry by one fp16 step: with the table written into
    gptlab's model the logits agree within a few such steps (LOGIT_TOLERANCE), without it within the table's cost
    (TABLE_TOLERANCE). With the MLPs' products silenced (their output projections zero: each MLP adds its bias
    alone) nothing is rounded to fp16 and the rest (embeddings, LayerNorms and their epsilon, attention, biases,
    the tied head) agrees to fp32's rounding."""
    torch.manual_seed(0)
    tokenizer = CharTokenizer(GGUF_TEXT)
    model = perturbed(GPT(tiny_config(vocab_size=tokenizer.vocab_size, block_size=64, activation="gelu_tanh",
                                      **shape))).eval()
    ids = tokenizer.encode(GGUF_TEXT[:64])
    with torch.no_grad():
        plain = model(torch.tensor([ids]))[0][0].numpy()
        table = with_ggml_gelu(copy.deepcopy(model))(torch.tensor([ids]))[0][0].numpy()
    scale = np.abs(plain).max()
    for theirs in llama_logits(tmp_path / "full", model, tokenizer, ids):
        assert np.abs(theirs - table).max() <= LOGIT_TOLERANCE * scale
        assert np.abs(theirs - plain).max() <= TABLE_TOLERANCE * scale
        assert (theirs.argmax(-1) == table.argmax(-1)).all()
    with torch.no_grad():
        for block in model.transformer.h:
            block.mlp.c_proj.weight.zero_()
        plain = model(torch.tensor([ids]))[0][0].numpy()
    for theirs in llama_logits(tmp_path / "silenced", model, tokenizer, ids):
        assert np.abs(theirs - plain).max() <= FP32_TOLERANCE * np.abs(plain).max()


def test_logits_of_a_gpt2_initialised_model(tmp_path):
    """GPT-2's own initialisation (weights N(0, 0.02), biases 0, gains 1), GPT-2's vocabulary: logits within 2e-4
    of gptlab's with llama.cpp's GELU table written in, within 5e-4 of gptlab's own (absolute)."""
    torch.manual_seed(0)
    tokenizer = GPT2Tokenizer()
    model = GPT(tiny_config(vocab_size=tokenizer.vocab_size, block_size=64, n_embd=96, n_head=3, n_layer=3,
                            activation="gelu_tanh")).eval()
    ids = tokenizer.encode(VARIED)[:64]
    with torch.no_grad():
        plain = model(torch.tensor([ids]))[0][0].numpy()
        table = with_ggml_gelu(copy.deepcopy(model))(torch.tensor([ids]))[0][0].numpy()
    for theirs in llama_logits(tmp_path, model, tokenizer, ids):
        assert np.abs(theirs - table).max() <= 2e-4  # a few fp16 steps of the table, as above
        assert np.abs(theirs - plain).max() <= 5e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A char run with the tanh GELU trained on CORPUS, its context long enough for a prompt and 64 tokens."""
    root = tmp_path_factory.mktemp("trained")
    return tiny_run(root, 150, ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "80",
                                "--batch-size", "8", "--activation", "gelu_tanh", "--precision", "fp32",
                                "--eval-interval", "150", "--eval-batches", "1", "--quiet"])


def first_real_difference(ours, theirs, model, prompt):
    """None when the two greedy continuations agree up to their first near-tie (gptlab's top-2 gap there below
    TIE of its largest |logit|), else the position where they part."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ours[:i]]))[0][0, -1]
        top2 = logits.topk(2).values
        return None if (top2[0] - top2[1]) < TIE * logits.abs().max() else i
    return None


def test_greedy_tokens_of_a_trained_run_equal_gptlabs(tmp_path, trained):
    loaded = load_run(trained)
    path = export_gguf(trained, tmp_path / "t.gguf").path
    prompts = [loaded.tokenizer.encode(CORPUS[i * 37:i * 37 + 8]) for i in range(20)]
    cfg = SampleConfig(max_new_tokens=64, temperature=0)
    ours = [[] for _ in prompts]
    for ids in generate_batch(loaded.model, prompts, cfg):
        for row, i in zip(ours, ids):
            row.append(i)
    with LlamaCpp(path, 80, threads=1, f32_cache=True) as peer:
        theirs = [peer.generate(p, 64) for p in prompts]
    exact = sum(a == b for a, b in zip(ours, theirs))
    assert exact >= 16, f"{exact}/20 prompts equal"  # the rest part only at a near-tie (below)
    assert all(first_real_difference(a, b, loaded.model, p) is None for a, b, p in zip(ours, theirs, prompts))


def test_q8_0_distributions_beside_gptlabs_fp32(tmp_path, trained, capsys):
    """KL(gptlab fp32 || llama.cpp) per position on the run's text, and how often the top token agrees: F32 is
    the table's rounding alone, Q8_0 adds the quantization (llama.cpp's own figure for Q8_0 on 8B models: 0.0014)."""
    loaded = load_run(trained)
    ids = loaded.tokenizer.encode(CORPUS[1000:1080])
    with torch.no_grad():
        ours = torch.log_softmax(loaded.model(torch.tensor([ids]))[0][0].double(), -1)
    figures = {}
    for outtype in ("f32", "q8_0"):
        path = export_gguf(trained, tmp_path / f"{outtype}.gguf", outtype).path
        with LlamaCpp(path, 80, threads=1) as peer:  # llama.cpp's defaults: fp16 cache, flash attention where it runs
            theirs = torch.log_softmax(torch.from_numpy(peer.decode(ids, all_logits=True)).double(), -1)
        kl = (ours.exp() * (ours - theirs)).sum(-1).mean().item()
        figures[outtype] = (kl, (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item())
    with capsys.disabled():
        print("\nllama.cpp beside gptlab fp32: " + "; ".join(f"{k.upper()} mean KL {kl:.2e}, top token agrees "
                                                            f"{agree:.1%}" for k, (kl, agree) in figures.items()))
    assert figures["f32"][0] < 1e-5 and figures["f32"][1] == 1.0
    assert figures["q8_0"][0] < 5e-3 and figures["q8_0"][1] >= 0.9
    assert figures["q8_0"][0] > figures["f32"][0]


def test_a_token_outside_the_vocabulary_is_one_line(tmp_path):
    tokenizer = CharTokenizer(GGUF_TEXT)
    model = GPT(tiny_config(vocab_size=tokenizer.vocab_size, activation="gelu_tanh"))
    with LlamaCpp(exported(tmp_path, model, tokenizer), 16, threads=1) as peer:
        with pytest.raises(GptlabError, match="llama.cpp could not decode 1 tokens at position 0"):
            peer.decode([tokenizer.vocab_size + 3])
        peer.decode([1, 2])
        with pytest.raises(GptlabError, match="llama.cpp could not decode a token at position 2"):
            peer.step(tokenizer.vocab_size + 3)


def test_the_peer_edges(tmp_path, capfd, monkeypatch):
    """Special tokens are text unless asked for; an empty text is no tokens; end of text is written out; a file
    llama.cpp cannot load, and llama.cpp missing, are one line each; llama.cpp's own log stays silent."""
    from gptlab.ggml import peer as peer_module

    tokenizer = GPT2Tokenizer()
    model = GPT(tiny_config(vocab_size=tokenizer.vocab_size, activation="gelu_tanh"))
    path = exported(tmp_path, model, tokenizer)
    capfd.readouterr()
    with LlamaCpp(path, 16, threads=1) as peer:
        assert peer.tokenize("<|endoftext|>") == tokenizer.enc.encode_ordinary("<|endoftext|>")  # as plain text
        assert peer.tokenize("<|endoftext|>", special=True) == [50256] and peer.tokenize("") == []
        assert peer.detokenize([50256, 40]) == b"<|endoftext|>I"
    assert capfd.readouterr().err == ""  # no line of llama.cpp's log
    (tmp_path / "not.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(GptlabError, match=f"llama.cpp could not load {tmp_path / 'not.gguf'}"):
        LlamaCpp(tmp_path / "not.gguf", 16)
    monkeypatch.setattr(peer_module, "available", lambda: False)
    with pytest.raises(GptlabError, match="llama.cpp is not installed; pip install 'gptlab\\[peers\\]'"):
        LlamaCpp(path, 16)
