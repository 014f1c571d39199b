"""Looking inside: the trace against transformers' output_attentions / output_hidden_states on small random GPT-2s
imported into gptlab, the invariants of attention and the logit lens, tracing the engine's output, and a training
step that tracing leaves alone."""

import pytest
import torch
from test_hf import SHAPES, VOCAB, hf_folder
from transformers import GPT2LMHeadModel

from gptlab.config import ModelConfig, SampleConfig
from gptlab.errors import GptlabError
from gptlab.hf import load_hf_model
from gptlab.inspect.trace import logit_lens, token_labels, trace, trace_generation
from gptlab.model import GPT, Bigram
from gptlab.tokenizer import CharTokenizer, GPT2Tokenizer


@pytest.fixture(scope="module")
def hf_pairs(tmp_path_factory):
    """name -> (transformers' eager model, the same weights imported into gptlab)."""
    root = tmp_path_factory.mktemp("hf-inspect")
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        folder = hf_folder(root / name, seed=10 + i, **shape)
        hf = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
        out[name] = (hf, load_hf_model(folder).eval())
    return out


def tiny_gpt(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    return GPT(ModelConfig(**{**cfg, **kw})).eval()


# ---- parity with transformers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SHAPES)
def test_attention_and_residual_stream_equal_transformers(hf_pairs, name):
    hf, ours = hf_pairs[name]
    x = torch.randint(VOCAB, (2, min(33, SHAPES[name]["n_positions"])))
    with torch.no_grad():
        ref = hf(x, output_attentions=True, output_hidden_states=True)
    tr = trace(ours, x)
    assert tr.n_layer == len(ref.attentions) == SHAPES[name]["n_layer"]
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
    tr = trace(ours, torch.randint(VOCAB, (3, 20)))
    upper = torch.ones(20, 20, dtype=torch.bool).triu(1)
    for probs in tr.attention:
        assert torch.allclose(probs.sum(-1), torch.ones(3, 5, 20), atol=1e-6)
        assert torch.all(probs[..., upper] == 0)  # exactly zero, not small
        assert torch.all(probs[..., ~upper] > 0)


def test_the_stream_adds_up_and_the_logits_are_the_models():
    model = tiny_gpt()
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
    with pytest.raises(GptlabError, match="context is 16"):
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
