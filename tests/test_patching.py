"""inspect/patching.py held to references from outside it: TransformerLens's own activation patching
(transformer_lens.patching) and its own logit attribution on a TransformerLens copy of the same weights, numbers
worked out by hand, exactness where the model is linear, and the model's own forward."""

import copy
import warnings

import pytest
import torch

from helpers import one_torch_thread, perturbed  # noqa: F401  (one_torch_thread: autouse)
from gptlab.config import ModelConfig
from gptlab.errors import GptlabError
from gptlab.inspect import patching
from gptlab.inspect.patching import (PATCH_KINDS, activation_patch, attribution_patch, direct_logit_attribution,
                                     logit_diff)
from gptlab.model import GPT

# odd sizes: 3 layers, 3 heads of 5, 15 wide, a context of 19, 23 tokens; prompts of 7 (odd)
SHAPE = dict(n_layer=3, n_head=3, n_embd=15, block_size=19, vocab_size=23, dropout=0.0, bias=True)
T = 7
ANSWER, WRONG = 4, 17
# what TransformerLens calls each sweep
TL_SWEEPS = {"resid_pre": "get_act_patch_resid_pre", "attn_out": "get_act_patch_attn_out",
             "mlp_out": "get_act_patch_mlp_out", "head_out": "get_act_patch_attn_head_out_all_pos",
             "head_out_by_pos": "get_act_patch_attn_head_out_by_pos"}


def custom_metric(logits):
    """A TransformerLens-style metric of (1, T, V) logits, nonlinear and over every position."""
    return logits[0].log_softmax(-1)[:, ANSWER].mean() + logits[0, 2].tanh().sum()


def transformer_lens_copy(model: GPT):
    """A TransformerLens HookedTransformer holding `model`'s weights as they are (no folding, no centring), built
    offline through transformers' GPT2LMHeadModel and TransformerLens's own GPT-2 weight conversion."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
    from transformers import GPT2Config, GPT2LMHeadModel

    from gptlab.hf.gpt2_folders import to_hf_tensors

    c = model.config
    act = "gelu_new" if c.activation == "gelu_tanh" else "gelu"
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd,
                                    n_layer=c.n_layer, n_head=c.n_head, activation_function=act,
                                    layer_norm_epsilon=c.layer_norm_eps))
    hf.load_state_dict(to_hf_tensors(model, c.vocab_size), strict=False)
    cfg = HookedTransformerConfig(n_layers=c.n_layer, d_model=c.n_embd, n_ctx=c.block_size, d_head=c.head_dim,
                                  n_heads=c.n_head, d_vocab=c.vocab_size, act_fn=act, normalization_type="LN",
                                  eps=c.layer_norm_eps, d_mlp=4 * c.n_embd, default_prepend_bos=False)
    tl = HookedTransformer(cfg)
    tl.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                   center_unembed=False, fold_value_biases=False, refactor_factored_attn_matrices=False)
    return tl.eval()



@pytest.fixture(scope="module")
def setup(one_torch_thread):
    """A perturbed random GPT, its TransformerLens copy, and a clean / corrupted pair of 7 tokens."""
    torch.manual_seed(0)
    model = perturbed(GPT(ModelConfig(**SHAPE))).eval()
    ids = torch.Generator().manual_seed(3)
    clean = torch.randint(0, SHAPE["vocab_size"], (1, T), generator=ids)
    corrupt = torch.randint(0, SHAPE["vocab_size"], (1, T), generator=ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tl = transformer_lens_copy(model)
    return model, tl, clean, corrupt


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    """Equal shapes and every value within rel of the largest |value| of `want`."""
    got, want = got.double(), want.double()
    return got.shape == want.shape and bool((got - want).abs().max() <= rel * want.abs().max())


@pytest.mark.parametrize("metric", ["logit_diff", "custom"])
@pytest.mark.parametrize("kind", list(PATCH_KINDS))
def test_each_activation_patching_sweep_is_transformer_lens_own(setup, kind, metric):
    from transformer_lens import patching as tl_patching

    model, tl, clean, corrupt = setup
    fn = logit_diff(ANSWER, WRONG) if metric == "logit_diff" else custom_metric
    _, clean_cache = tl.run_with_cache(clean)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = getattr(tl_patching, TL_SWEEPS[kind])(tl, corrupt, clean_cache, fn)
    got = activation_patch(model, clean, corrupt, fn, kind)
    assert got.kind == kind and got.method == "activation" and got.axes[0] == "layer"
    assert close(got.values, want, 1e-5), (got.values - want).abs().max()
    assert got.values.abs().max() > 0.1 and want.std() > 1e-3  # the sweep says something: not all one value
    assert [len(t) for t in got.ticks] == list(got.values.shape)
    with torch.no_grad():
        assert got.clean == pytest.approx(float(fn(tl(clean)).sum()), abs=1e-4)
        assert got.corrupt == pytest.approx(float(fn(tl(corrupt)).sum()), abs=1e-4)


@pytest.mark.parametrize("kind", list(PATCH_KINDS))
def test_patch_rows_in_chunks_of_one_of_four_and_of_exactly_the_rows_give_the_same_sweep(setup, monkeypatch, kind):
    """PATCH_ROWS crossed: rows of each layer (7 positions, 3 heads, 21 position-heads) in chunks of 1, of 4 (which
    divides none of them), of exactly their number, and of the default (more than them all)."""
    model, _, clean, corrupt = setup
    rows = {"pos": T, "head": SHAPE["n_head"]}
    n_rows = 1
    for axis in PATCH_KINDS[kind][1]:
        n_rows *= rows[axis]
    assert patching.PATCH_ROWS > n_rows
    for fn in (logit_diff(ANSWER, WRONG), custom_metric):
        whole = activation_patch(model, clean, corrupt, fn, kind).values
        for chunk in (1, 4, n_rows):
            monkeypatch.setattr(patching, "PATCH_ROWS", chunk)
            chunked = activation_patch(model, clean, corrupt, fn, kind).values  # rounding aside: another batch
            assert torch.allclose(chunked, whole, rtol=0, atol=1e-6), chunk  # size may sum in another order
            monkeypatch.undo()


def hand_model() -> GPT:
    """Blocks that add nothing (every output projection and its bias zero), 2 channels, tokens 0 = (1, 0) and
    1 = (0, 1), position embeddings zero, final LayerNorm gain 1 and bias 0: the LayerNorm makes token 0's stream
    (1, -1) / 2 / sqrt(1/4 + eps), token 1's its negative, and the tied head reads logit 0 - logit 1 =
    +-1 / sqrt(1/4 + eps) off them."""
    model = GPT(ModelConfig(n_layer=2, n_head=1, n_embd=2, block_size=8, vocab_size=3, dropout=0.0,
                            layer_norm_eps=1e-6))
    with torch.no_grad():
        for block in model.transformer.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
        model.transformer.wte.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        model.transformer.wpe.weight.zero_()
        model.transformer.ln_f.weight.fill_(1.0)
        model.transformer.ln_f.bias.zero_()
    return model.eval()


def test_the_clean_stream_patched_in_at_layer_0_recovers_the_clean_metric_worked_out_by_hand():
    clean_metric = 1 / (0.25 + 1e-6) ** 0.5  # hand_model's docstring: 1.999996
    result = activation_patch(hand_model(), torch.tensor([0, 1, 0]), torch.tensor([1, 1, 1]), logit_diff(0, 1))
    assert result.clean == pytest.approx(clean_metric, rel=1e-6)
    assert result.corrupt == pytest.approx(-clean_metric, rel=1e-6)
    want = torch.tensor([[-1.0, -1.0, 1.0]] * 2) * clean_metric  # only the last position is read
    assert torch.allclose(result.values, want, atol=1e-5)


def test_patching_the_one_position_where_the_prompts_differ_at_layer_0_is_the_clean_run(setup):
    """The corrupted prompt is the clean one with position 2 changed: the corrupted stream entering layer 0 with
    the clean position 2 in is the clean stream, so that patch gives the clean run's metric (read off the model's
    own forward, no hooks), and a patch anywhere else, where the two streams are equal, the corrupted run's."""
    model, _, clean, _ = setup
    corrupt = clean.clone()
    corrupt[0, 2] = (clean[0, 2] + 5) % SHAPE["vocab_size"]
    metric = logit_diff(ANSWER, WRONG)
    with torch.no_grad():
        clean_metric, corrupt_metric = (float(metric(model(ids)[0])) for ids in (clean, corrupt))
    values = activation_patch(model, clean, corrupt, metric, "resid_pre").values
    assert values[0, 2] == pytest.approx(clean_metric, abs=1e-5)
    others = torch.cat([values[0, :2], values[0, 3:]])
    assert torch.allclose(others, torch.full_like(others, corrupt_metric), atol=1e-5)
    assert abs(clean_metric - corrupt_metric) > 0.1


def linear_model() -> GPT:
    """A float64 GPT whose metric is linear in every activation after layer 0's attention: every LayerNorm has
    an epsilon so large (1e12) that its scale is a constant (its gain scaled up by 1e6 to keep values their size),
    and from layer 1 on attention has zero queries and keys (a uniform, constant pattern: linear in its values) and
    the MLP a zero input matrix (a constant output). Layer 0 keeps a softmax and a GELU of its own."""
    torch.manual_seed(1)
    model = perturbed(GPT(ModelConfig(**{**SHAPE, "layer_norm_eps": 1e12}))).double().eval()
    C = SHAPE["n_embd"]
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.mul_(1e6)
        for block in model.transformer.h[1:]:
            block.attn.c_attn.weight[:2 * C].zero_()
            block.attn.c_attn.bias[:2 * C].zero_()
            block.mlp.c_fc.weight.zero_()
    return model


# (kind, the first layer from which everything downstream of the activation is linear)
LINEAR_FROM = [("resid_pre", 1), ("attn_out", 1), ("head_out", 1), ("head_out_by_pos", 1), ("mlp_out", 0)]


@pytest.mark.parametrize("kind, first", LINEAR_FROM)
def test_attribution_patching_is_activation_patching_where_the_metric_is_linear_and_not_elsewhere(setup, kind,
                                                                                                  first):
    _, _, clean, corrupt = setup
    metric = logit_diff(ANSWER, WRONG)
    model = linear_model()
    exact = activation_patch(model, clean, corrupt, metric, kind)
    estimate = attribution_patch(model, clean, corrupt, metric, kind)
    assert estimate.method == "attribution" and estimate.values.shape == exact.values.shape
    assert estimate.values.dtype == torch.float64 and estimate.corrupt == pytest.approx(exact.corrupt, rel=1e-9)
    assert exact.effect[first:].abs().max() > 1e-3  # patches that change something
    assert close(estimate.values[first:], exact.effect[first:], 1e-6)
    if first == 1:  # layer 0 is not linear downstream of these (its MLP's GELU): there the estimate is off
        assert not close(estimate.values[0], exact.effect[0], 1e-5)
    ordinary = copy.deepcopy(setup[0]).double()  # the perturbed model: nothing linear about it
    off = attribution_patch(ordinary, clean, corrupt, metric, kind).values
    assert not close(off, activation_patch(ordinary, clean, corrupt, metric, kind).effect, 1e-3)


def test_attribution_patching_takes_a_custom_metric_and_sums_a_heads_positions(setup):
    model, _, clean, corrupt = setup
    by_pos = attribution_patch(model, clean, corrupt, custom_metric, "head_out_by_pos")
    all_pos = attribution_patch(model, clean, corrupt, custom_metric, "head_out")
    assert by_pos.values.shape == (3, T, 3) and all_pos.values.shape == (3, 3)
    assert torch.allclose(by_pos.values.sum(1), all_pos.values, atol=1e-5)
    with torch.no_grad():
        assert all_pos.corrupt == pytest.approx(float(custom_metric(model(corrupt)[0])), abs=1e-5)


@pytest.mark.parametrize("pos", [-1, 3])
def test_logit_attribution_parts_sum_to_the_logit_difference_and_match_transformer_lens(setup, pos):
    model, tl, clean, _ = setup
    parts = direct_logit_attribution(model, clean, ANSWER, WRONG, pos=pos)
    with torch.no_grad():
        logits = model(clean)[0][0, pos]
    assert parts.logit_diff == pytest.approx(float(logits[ANSWER] - logits[WRONG]), abs=1e-5)
    assert float(parts.values.sum()) == pytest.approx(parts.logit_diff, abs=1e-5)
    L, H = SHAPE["n_layer"], SHAPE["n_head"]
    assert parts.labels[:3] == ("embed", "pos_embed", "L0H0") and parts.labels[-1] == "ln_final bias"
    assert len(parts.labels) == 2 + L * (H + 2) + 1 and "L1 attn bias" in parts.labels and "L2 mlp" in parts.labels
    # TransformerLens's head results through its own apply_ln_to_stack (centred, divided by the frozen scale)
    _, cache = tl.run_with_cache(clean)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stack = cache.stack_head_results(layer=-1, pos_slice=pos)  # (L * H, 1, C)
        stack = cache.apply_ln_to_stack(stack, layer=-1, pos_slice=pos)
    direction = tl.W_U[:, ANSWER] - tl.W_U[:, WRONG]
    want = ((stack[:, 0] * tl.ln_final.w) @ direction).reshape(L, H)
    assert close(parts.heads(L, H), want.detach(), 1e-5)


@pytest.mark.parametrize("layer, head", [(0, 1), (1, 2), (2, 0)])
def test_zeroing_one_heads_output_rows_zeroes_that_heads_part_only(setup, layer, head):
    model = copy.deepcopy(setup[0])
    D = SHAPE["n_embd"] // SHAPE["n_head"]
    with torch.no_grad():
        model.transformer.h[layer].attn.c_proj.weight[:, head * D:(head + 1) * D].zero_()
    parts = dict(direct_logit_attribution(model, setup[2], ANSWER, WRONG).items())
    assert parts[f"L{layer}H{head}"] == 0.0
    others = [v for k, v in parts.items() if k[0] == "L" and "H" in k and k != f"L{layer}H{head}"]
    assert len(others) == 8 and min(abs(v) for v in others) > 0
    assert sum(parts.values()) == pytest.approx(direct_logit_attribution(model, setup[2], ANSWER, WRONG).logit_diff,
                                                abs=1e-5)


def test_a_result_reads_as_a_table_and_a_heat_map(setup):
    model, _, clean, corrupt = setup
    result = activation_patch(model, clean, corrupt, logit_diff(ANSWER, WRONG), "head_out_by_pos")
    cells = result.cells()
    assert len(cells) == 3 * T * 3 and cells[0][0] == ("L0", "0", "H0") and cells[-1][0] == ("L2", "6", "H2")
    assert cells[5][1] == pytest.approx(float(result.values[0, 1, 2]))  # L0, position 1, head 2
    matrix, rows, columns = result.heatmap()
    assert matrix.shape == (9, T) and rows[4] == "L1H1" and columns == [str(p) for p in range(T)]
    assert matrix[4, 6] == result.values[1, 6, 1]


def test_bad_input_is_refused_with_one_clear_line(setup):
    model, _, clean, corrupt = setup
    metric = logit_diff(ANSWER, WRONG)
    with pytest.raises(GptlabError, match="7 tokens and the corrupted one 6"):
        activation_patch(model, clean, corrupt[:, :6], metric)
    with pytest.raises(GptlabError, match="7 tokens and the corrupted one 6"):
        attribution_patch(model, clean, corrupt[:, :6], metric)
    with pytest.raises(GptlabError, match=r"metric's token id 23 is outside the vocabulary \[0, 23\)"):
        activation_patch(model, clean, corrupt, logit_diff(23, WRONG))
    with pytest.raises(GptlabError, match=r"answer id 40 is outside the vocabulary \[0, 23\)"):
        direct_logit_attribution(model, clean, 40, WRONG)
    with pytest.raises(GptlabError, match=r"wrong answer id -1 is outside"):
        direct_logit_attribution(model, clean, ANSWER, -1)
    with pytest.raises(GptlabError, match="no patching sweep 'resid_post'"):
        activation_patch(model, clean, corrupt, metric, "resid_post")
    with pytest.raises(GptlabError, match="holds an id outside the vocabulary"):
        activation_patch(model, clean, corrupt + 20, metric)
    with pytest.raises(GptlabError, match="returned"):
        activation_patch(model, clean, corrupt, lambda logits: logits[0, -1])
    with pytest.raises(GptlabError, match="position 7 is outside the prompt of 7 tokens"):
        direct_logit_attribution(model, clean, ANSWER, WRONG, pos=7)


def test_a_prompt_of_the_whole_context_is_patched_and_one_past_it_or_an_id_at_the_vocabulary_size_refused(setup):
    """The edges of the checks: block_size (19) tokens patch like any prompt (the clean run patched in everywhere at
    layer 0 is the clean run, by hand); 20 tokens, or an id equal to the vocabulary's size, are refused."""
    model = setup[0]
    g = torch.Generator().manual_seed(9)
    clean, corrupt = (torch.randint(0, 23, (1, 19), generator=g) for _ in range(2))
    corrupt[0, :18] = clean[0, :18]  # the prompts differ at the last position only
    metric = logit_diff(ANSWER, WRONG)
    result = activation_patch(model, clean, corrupt, metric, "resid_pre")
    assert result.values.shape == (3, 19)
    assert float(result.values[0, 18]) == pytest.approx(result.clean, abs=1e-5)
    with pytest.raises(GptlabError, match="20 tokens, more than the context of 19"):
        activation_patch(model, torch.zeros(1, 20, dtype=torch.long), torch.zeros(1, 20, dtype=torch.long), metric)
    with pytest.raises(GptlabError, match=r"outside the vocabulary \[0, 23\)"):
        activation_patch(model, torch.full((1, 4), 23), torch.zeros(1, 4, dtype=torch.long), metric)
