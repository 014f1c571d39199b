"""Looking inside: the trace against transformers' output_attentions / output_hidden_states on small random GPT-2s
imported into gptlab, the invariants of attention and the logit lens, tracing the engine's output, a training
step that tracing leaves alone, the anatomy's counts, and the `gptlab inspect` commands with their pictures and
refusals (the interactive page: test_inspect_page.py)."""

import logging
import warnings
from pathlib import Path

import matplotlib
import pytest
import torch
from PIL import Image
from transformers import GPT2LMHeadModel

from helpers import CORPUS, HF_SHAPES, HF_VOCAB, TINY, chat_run, hf_folder, run_bad, run_ok, trained_like
from gptlab.checkpoint import load_run
from gptlab.cli import main
from gptlab.config import PRESETS, ModelConfig, SampleConfig
from gptlab.engine import generate
from gptlab.errors import GptlabError
from gptlab.hf.gpt2_folders import load_hf_model
from gptlab.inspect import page
from gptlab.inspect.anatomy import anatomy_table, model_for, totals
from gptlab.inspect import pictures
from gptlab.inspect.pictures import attention_png, embeddings_png, lens_png, panels
from gptlab.inspect.trace import (
    logit_lens,
    pairwise_cosine,
    token_labels,
    trace,
    trace_generation,
    word_representations,
)
from gptlab.model import GPT, Bigram
from gptlab.tokenizer import BPETokenizer, CharTokenizer, GPT2Tokenizer


@pytest.fixture(scope="module")
def hf_pairs(tmp_path_factory):
    """name -> (transformers' eager model, the same weights imported into gptlab). Every LayerNorm gain and bias and
    every linear bias is moved off its initial 1 or 0 (as training moves them), so that a trace reading ln_2 where
    ln_1 belongs, or leaving out a bias, differs from transformers."""
    root = tmp_path_factory.mktemp("hf-inspect")
    out = {}
    for i, (name, shape) in enumerate(HF_SHAPES.items()):
        folder = hf_folder(root / name, seed=10 + i, **shape)
        hf = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 1:
                    p.add_(0.3 * torch.randn_like(p))
        hf.save_pretrained(folder)
        out[name] = (hf, load_hf_model(folder).eval())
    return out


def tiny_gpt(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = {"vocab_size": 50, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0}
    return GPT(ModelConfig(**{**cfg, **kw})).eval()


# ---- parity with transformers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", HF_SHAPES)
def test_attention_and_residual_stream_equal_transformers(hf_pairs, name):
    hf, ours = hf_pairs[name]
    x = torch.randint(HF_VOCAB, (2, min(33, HF_SHAPES[name]["n_positions"])))
    with torch.no_grad():
        ref = hf(x, output_attentions=True, output_hidden_states=True)
    tr = trace(ours, x)
    assert tr.n_layer == len(ref.attentions) == HF_SHAPES[name]["n_layer"]
    for layer, probs in enumerate(ref.attentions):
        assert tr.attention[layer].shape == probs.shape  # (B, H, T, T)
        assert (tr.attention[layer] - probs).abs().max().item() <= 1e-5, layer
    # hidden_states: the embeddings, each block's output, and (last) the final block's output after ln_f
    for layer in range(len(ref.hidden_states) - 1):
        assert (tr.residual[layer] - ref.hidden_states[layer]).abs().max().item() <= 1e-5, layer
    final = ours.transformer.ln_f(tr.residual[-1])
    assert (final - ref.hidden_states[-1]).abs().max().item() <= 1e-5
    assert (tr.logits - ref.logits).abs().max().item() <= 1e-5


# ---- invariants --------------------------------------------------------------------------------------------------

def test_rows_sum_to_one_and_nothing_above_the_diagonal(hf_pairs):
    _, ours = hf_pairs["5-heads-60-wide"]
    tr = trace(ours, torch.randint(HF_VOCAB, (3, 20)))
    upper = torch.ones(20, 20, dtype=torch.bool).triu(1)
    for probs in tr.attention:
        assert torch.allclose(probs.sum(-1), torch.ones(3, 5, 20), atol=1e-6)
        assert torch.all(probs[..., upper] == 0)  # exactly zero, not small
        assert torch.all(probs[..., ~upper] > 0)


def test_the_stream_adds_up_and_the_logits_are_the_models():
    model = trained_like(dict(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32))
    x = torch.randint(50, (2, 16))
    tr = trace(model, x)
    assert len(tr.residual) == 3 and len(tr.after_attention) == len(tr.attn_out) == len(tr.mlp_out) == 2
    for layer in range(2):
        assert torch.equal(tr.after_attention[layer], tr.residual[layer] + tr.attn_out[layer])
        assert torch.equal(tr.residual[layer + 1], tr.after_attention[layer] + tr.mlp_out[layer])
    with torch.no_grad():
        assert (tr.logits - model(x)[0]).abs().max().item() <= 1e-5


def test_the_lens_last_row_is_the_models_logits():
    model = tiny_gpt(1)
    x = torch.randint(50, (1, 12))
    tr = trace(model, x)
    lens = logit_lens(model, tr)
    assert lens.shape == (3, 1, 12, 50)
    assert torch.equal(lens[-1], tr.logits)
    with torch.no_grad():
        assert (lens[-1] - model(x)[0]).abs().max().item() <= 1e-5
    assert not torch.allclose(lens[0], lens[-1])


def block_streams(model, x):
    """The residual stream entering block 0 and leaving every block, captured with forward hooks on the model's
    own forward (the reference for the trace's and the lens's rows): a list of L + 1 tensors (B, T, C)."""
    seen = []
    hooks = [model.transformer.h[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))]
    hooks += [b.register_forward_hook(lambda m, args, out: seen.append(out.clone())) for b in model.transformer.h]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_every_row_of_the_lens_is_ln_f_and_the_head_on_that_depths_stream():
    """Row l of the lens, by hand: LayerNorm written out with ln_f's gain and bias (moved off 1 and 0, as training
    moves them) and the tied head wte^T, on the stream the model's own forward hands between blocks."""
    model = trained_like(dict(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=32), seed=4)
    x = torch.randint(50, (2, 12))
    streams = block_streams(model, x)
    lens = logit_lens(model, trace(model, x))
    assert lens.shape == (4, 2, 12, 50) and len(streams) == 4
    ln_f = model.transformer.ln_f
    for depth, stream in enumerate(streams):
        mean, var = stream.mean(-1, keepdim=True), stream.var(-1, unbiased=False, keepdim=True)
        normed = (stream - mean) / torch.sqrt(var + ln_f.eps) * ln_f.weight + ln_f.bias
        expected = normed @ model.transformer.wte.weight.T  # (B, T, V)
        assert (lens[depth] - expected).abs().max().item() <= 1e-4, depth


def test_trace_of_generated_text_continues_the_prompt_greedily():
    model = tiny_gpt(2)
    prompt = [3, 1, 4, 1, 5]
    tr = trace_generation(model, prompt, SampleConfig(max_new_tokens=8, temperature=0))
    ids = tr.ids[0].tolist()
    assert ids[:5] == prompt and len(ids) == 13
    # greedy: each generated token is the argmax of the traced logits one position before it
    assert tr.logits[0, 4:-1].argmax(-1).tolist() == ids[5:]


def test_refusals_are_one_clear_line():
    model = tiny_gpt()
    with pytest.raises(GptlabError, match="context is 16"):
        trace(model, list(range(17)))
    with pytest.raises(GptlabError, match="prompt plus 7 new tokens is 17 tokens but the model's context is 16"):
        trace_generation(model, [1] * 10, SampleConfig(max_new_tokens=7, temperature=0))
    with pytest.raises(GptlabError, match="empty"):
        trace(model, [])
    with pytest.raises(GptlabError, match="no attention"):
        trace(Bigram(ModelConfig(vocab_size=10, arch="bigram")), [1, 2])
    with pytest.raises(GptlabError, match=r"\[0, 50\)"):
        trace(model, [1, 50])


def test_tracing_leaves_a_training_step_unchanged():
    """Tracing is a separate forward over the same weights: no hooks, no state. A training step (with dropout)
    after a trace gives bit for bit the weights of the same step without one."""
    def one_step(traced):
        model = tiny_gpt(3, dropout=0.1).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = torch.randint(50, (4, 16)), torch.randint(50, (4, 16))
        if traced:
            trace(model, x)
        torch.manual_seed(7)
        model(x, y)[1].backward()
        optimizer.step()
        assert model.training and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        return model.state_dict()

    plain, traced = one_step(False), one_step(True)
    assert all(torch.equal(plain[k], traced[k]) for k in plain)


def test_token_labels_show_whitespace_and_bpe_pieces():
    chars = CharTokenizer("ab \n\t")
    assert token_labels(chars, chars.encode("a b\n\t")) == ["a", "␣", "b", "↵", "→"]
    gpt2 = GPT2Tokenizer()
    assert token_labels(gpt2, gpt2.encode("Hello world\n")) == ["Hello", "␣world", "↵"]
    assert token_labels(gpt2, gpt2.encode("😀")[:1])[0].startswith("\\x")
    bpe = BPETokenizer.train([CORPUS], 300)
    text = "First Citizen:\nBefore we proceed"
    labels = token_labels(bpe, bpe.encode(text))
    assert "".join(labels) == text.replace(" ", "␣").replace("\n", "↵") and len(labels) <= len(text) / 2
    assert "␣Citizen" in labels


def drawn_texts(monkeypatch) -> list[list[str]]:
    """Every text each picture drawn from now on holds (tick labels, cells, titles), one list per picture."""
    drawn, save = [], pictures.save_png
    monkeypatch.setattr(pictures, "save_png", lambda fig, out: drawn.append(
        [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]) or save(fig, out))
    return drawn


def test_labels_drawn_on_pictures_escape_what_the_font_cannot_show(tmp_path, monkeypatch, caplog):
    """matplotlib's default font, DejaVu Sans, has 😀 and → but no ␍ and no 中: a control character is shown as
    its escape, a character the font lacks as its code point, and matplotlib has nothing to warn about."""
    text = "a\r\t😀中\x1b b"
    chars = CharTokenizer(text)
    ids = chars.encode(text)
    model = tiny_gpt(4, vocab_size=chars.vocab_size)
    tr = trace(model, ids)
    labels = token_labels(chars, ids)
    assert labels == ["a", "\\r", "→", "😀", "中", "\\x1b", "␣", "b"]  # the terminal's and the page's
    drawn = drawn_texts(monkeypatch)
    with matplotlib.rc_context({"font.family": "DejaVu Sans"}), warnings.catch_warnings(record=True) as caught, \
            caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        attention_png(tr, labels, tmp_path / "attention.png", layer=0, head=0)
        lens_png(logit_lens(model, tr), labels, chars, tmp_path / "lens.png")
        embeddings_png(torch.randn(4, 2, 8), "中", ["a\r中", "😀 中"], tmp_path / "embeddings.png")
    assert [str(w.message) for w in caught] == [] and caplog.text == ""
    ticks = ["a", "\\r", "→", "😀", "\\u4e2d", "\\x1b", "␣", "b"]
    for texts in drawn:
        assert not any(c in t for t in texts for c in "中\r\x1b␍"), texts
    assert all(t in drawn[0] for t in ticks) and all(t in drawn[1] for t in ticks)
    legend = next(t for t in drawn[2] if t.startswith("PCA per depth"))
    assert legend.splitlines() == ["PCA per depth; contexts", "1: 'a\\r\\u4e2d'", "2: '😀 \\u4e2d'"]


# ---- anatomy -----------------------------------------------------------------------------------------------------

def test_gpt2_has_124m_parameters_split_by_kind():
    sums = totals(model_for(ModelConfig(**PRESETS["gpt2"].model)))
    assert sums == {"embeddings": 39_383_808, "attention": 28_348_416, "MLP": 56_669_184, "LayerNorms": 38_400,
                    "total": 124_439_808}


def test_anatomy_counts_what_the_model_holds():
    model = tiny_gpt(n_layer=3, bias=False)
    text = anatomy_table(model)
    assert text.splitlines()[-1].split() == ["total", f"{model.num_params():,}"]
    assert "heads × d_k = 2 × 16" in text and "γ of C = 32" in text
    assert totals(model)["total"] == sum(p.numel() for p in model.parameters())
    bigram = Bigram(ModelConfig(vocab_size=10, arch="bigram"))
    assert totals(bigram)["total"] == 100 and "V×V = 10×10" in anatomy_table(bigram)


# ---- the commands ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """A tiny char run trained for 5 steps (context 16)."""
    root = tmp_path_factory.mktemp("inspect-run")
    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    assert main(["prepare", str(root / "corpus.txt"), "--out", str(root / "data"), "--quiet"]) == 0
    args = ["train", "--data", str(root / "data"), "--run", str(root / "run"), "--max-steps", "5", *TINY]
    assert main(args + ["--n-layer", "2"]) == 0
    return root / "run"


def greedy(model, prompt, n):
    """The prompt and its greedy continuation by n tokens, from the engine."""
    return prompt + [ids[0] for ids in generate(model, prompt, SampleConfig(max_new_tokens=n, temperature=0))]


def looked_at(path):
    """A PNG that is a picture: it opens, has some size and more than one colour."""
    image = Image.open(path).convert("RGB")
    assert image.width > 200 and image.height > 200
    assert len(image.getcolors(1 << 24)) > 10
    return image


def test_inspect_attention_lens_and_model(char_run, capsys):
    out = run_ok(capsys, "inspect", "attention", "--run", str(char_run), "--prompt", "the cat\\n sat")
    assert out.strip() == str(char_run / "inspect" / "attention.png")
    looked_at(char_run / "inspect" / "attention.png")
    out = run_ok(capsys, "inspect", "attention", "--run", str(char_run), "--prompt", "the", "--layer", "1", "--head",
                 "0", "--out", str(char_run / "pics"))
    looked_at(out.strip())
    assert out.strip().endswith("pics/attention-layer1-head0.png")
    out = run_ok(capsys, "inspect", "attention", "--run", str(char_run), "--prompt", "the", "--layer", "1", "--html")
    png, page = out.split()
    assert page == str(char_run / "inspect" / "attention.html") and "const DATA" in Path(page).read_text()
    out = png
    assert looked_at(out.strip()).width > 1.5 * Image.open(out.strip()).height  # one row: layer 1's two heads
    out = run_ok(capsys, "inspect", "lens", "--run", str(char_run), "--prompt", "the cat", "--top", "2")
    lines = out.splitlines()
    assert lines[0].split() == ["pos", "token", "emb", "h.0", "h.1"] and len(lines) == 2 + 7 + 1
    assert lines[3].split()[1] == "h" and lines[5].split()[1] == "␣"
    looked_at(lines[-1])
    out = run_ok(capsys, "inspect", "lens", "--run", str(char_run), "--prompt", "the", "--generate", "5")
    lines = out.splitlines()
    assert len(lines) == 2 + 3 + 5 + 1 and [line.split()[1] for line in lines[2:5]] == ["t", "h", "e"]
    loaded = load_run(char_run)
    continued = loaded.tokenizer.decode(greedy(loaded.model, loaded.tokenizer.encode("the"), 5))
    assert "".join(line.split()[1] for line in lines[2:-1]).replace("␣", " ").replace("↵", "\n") == continued
    out = run_ok(capsys, "inspect", "model", "--run", str(char_run))
    assert "h.0 … h.1: 2 blocks" in out and "total" in out


def test_attention_pictures_hold_the_panels_asked_for():
    tr = trace(tiny_gpt(), [1, 2, 3])
    assert panels(tr, None, None) == ([0, 1], [0, 1])
    assert panels(tr, 1, None) == ([1], [0, 1]) and panels(tr, None, 0) == ([0, 1], [0])
    assert panels(tr, 1, 0) == ([1], [0])


def test_inspect_model_of_a_preset(capsys):
    out = run_ok(capsys, "inspect", "model", "--preset", "gpt2")
    assert out.splitlines()[-1].split() == ["total", "124,439,808"]
    assert "attention       28,348,416" in out


def test_inspect_refusals_write_nothing(char_run, capsys, monkeypatch):
    before = sorted(p.name for p in char_run.iterdir())
    run = ["--run", str(char_run), "--out", str(char_run / "refused")]
    assert "context is 16" in run_bad(capsys, "inspect", "attention", *run, "--prompt", "e" * 17)
    assert "context is 16" in run_bad(capsys, "inspect", "lens", *run, "--prompt", "e" * 17)
    assert "plus 10 new tokens is 17" in run_bad(capsys, "inspect", "lens", *run, "--prompt", "e" * 7, "--generate",
                                                 "10")
    assert "--layer must be in [0, 1]" in run_bad(capsys, "inspect", "attention", *run, "--prompt", "at", "--layer",
                                                 "2")
    assert "--head must be in [0, 1]" in run_bad(capsys, "inspect", "attention", *run, "--prompt", "at", "--head",
                                                "-1")
    assert "does not occur" in run_bad(capsys, "inspect", "embeddings", *run, "--word", "cat", "--context",
                                       "the cat", "--context", "a hat")
    assert "at least two" in run_bad(capsys, "inspect", "embeddings", *run, "--word", "cat", "--context", "cat")
    assert "not both" in run_bad(capsys, "inspect", "model", "--run", str(char_run), "--preset", "gpt2")
    monkeypatch.setattr(page, "MAX_NUMBERS", 10)
    assert "too many for one page" in run_bad(capsys, "inspect", "attention", *run, "--prompt", "the", "--html")
    assert sorted(p.name for p in char_run.iterdir()) == before


def test_inspect_reads_chat_markers_in_a_prompt_only_with_allow_special(tmp_path, capsys):
    """A chat run's prompt written as its template renders it: refused as `sample` refuses it, read with
    --allow-special as `sample --allow-special` reads it (each marker one special token)."""
    run = chat_run(tmp_path)
    prompt = "<|user|>hi<|end|><|assistant|>"
    for what in ("attention", "lens"):
        assert "chat marker <|user|>" in run_bad(capsys, "inspect", what, "--run", str(run), "--prompt", prompt)
    ids = load_run(run).tokenizer.encode(prompt, allow_special=True)
    assert len(ids) == 5
    lines = run_ok(capsys, "inspect", "lens", "--run", str(run), "--prompt", prompt, "--allow-special").splitlines()
    assert len(lines) == 2 + len(ids) + 1 and lines[2].split()[1] == "<|user|>"
    out = run_ok(capsys, "inspect", "attention", "--run", str(run), "--prompt", prompt, "--allow-special")
    looked_at(out.strip())


def test_the_apple_experiment(char_run, capsys):
    loaded = load_run(char_run)
    contexts = ["the cat sat", "a cat ran away", "cat"]
    reps = word_representations(loaded.model, loaded.tokenizer, "cat", contexts)
    assert reps.shape == (2 + 2, 3, 16)
    assert torch.equal(reps[0, 0], reps[0, 1]) and torch.equal(reps[0, 0], reps[0, 2])  # static: one vector
    sims = pairwise_cosine(reps)
    assert not torch.allclose(reps[-1, 0], reps[-1, 1]) and sims[-1, 0, 1] < 1 - 1e-4  # contextual: they diverge
    ids = loaded.tokenizer.encode("a cat ran away")
    streams = block_streams(loaded.model, torch.tensor([ids]))  # the model's own forward, through hooks
    for depth, stream in enumerate(streams):  # read at the word's last token, the "t" at position 4
        assert (reps[depth + 1, 1] - stream[0, 4]).abs().max().item() <= 1e-5, depth
    assert torch.equal(reps[0, 1], loaded.model.transformer.wte.weight[ids[4]])
    out = run_ok(capsys, "inspect", "embeddings", "--run", str(char_run), "--word", "cat",
                 *[arg for c in contexts for arg in ("--context", c)])
    lines = out.splitlines()
    assert lines[0].split() == ["depth", "1", "vs", "2", "1", "vs", "3", "2", "vs", "3"]
    assert lines[2].split() == ["static", "1.0000", "1.0000", "1.0000"]
    assert [line.split()[0] for line in lines[3:-1]] == ["tok+pos", "h.0", "h.1"]
    looked_at(lines[-1])
    assert lines[-1].endswith("inspect/embeddings-cat.png")


def test_bench_train_traced_gives_the_references_numbers(char_data, monkeypatch, capsys):
    """`gptlab bench train --traced`: the reference traced before every step reaches the same loss (the bench line
    beside it shows the speed)."""
    from gptlab.bench import device_peak
    from gptlab.bench.train_speed import run_train_bench, train_variants
    from gptlab.config import TrainConfig
    from gptlab.peak import Peak

    monkeypatch.setattr(device_peak, "measure_peak", lambda device, quick: Peak(1e10, "test"))
    variants = train_variants(torch.device("cpu"), traced=True)[:2]
    assert [v.traced for v in variants] == [False, True]
    calls = []
    monkeypatch.setattr("gptlab.inspect.trace.trace", lambda model, x, real=trace: calls.append(1) or real(model, x))
    cfg = TrainConfig(batch_size=4, lr=3e-3, warmup_steps=1, device="cpu")
    model = ModelConfig(vocab_size=0, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    rows = run_train_bench(char_data, model, cfg, steps=2, warmup=1, variants=variants)
    assert len(calls) == 3 and rows[1]["variant"] == "fp32 eager, traced before each step"
    assert rows[0]["val_loss"] == rows[1]["val_loss"]
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("fp32 eager, traced") and " +0.0000" in line for line in lines)
