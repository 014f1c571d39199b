"""The inspect module value by value: the anatomy's table for models whose counts are worked out by hand, the
trace's attention and streams against the equation written out in plain torch, the logit lens's table and the
pictures' texts, images and labels read back from matplotlib's figure objects."""

from pathlib import Path

import matplotlib
import pytest
import torch
from PIL import Image

from gptlab.config import ModelConfig, SampleConfig
from gptlab.errors import GptlabError
from gptlab.inspect import pictures
from gptlab.inspect.anatomy import anatomy_table
from gptlab.inspect.pictures import (
    attention_png,
    embeddings_png,
    lens_png,
    lens_table,
    lens_top,
    pca_2d,
    similarity_table,
)
from gptlab.inspect.trace import (
    find_word,
    pairwise_cosine,
    token_label,
    token_labels,
    trace,
    trace_generation,
    word_representations,
)
from gptlab.model import GPT, Bigram
from gptlab.plots import pyplot
from gptlab.tokenizer import CharTokenizer, GPT2Tokenizer


def gpt(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = {"vocab_size": 50, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0}
    return GPT(ModelConfig(**{**cfg, **kw})).eval()


# ---- anatomy -----------------------------------------------------------------------------------------------------

# V 50, C 32, block_size 16, biases: wte 50·32 = 1,600, wpe 16·32 = 512; per block ln_1 = ln_2 = 2·32 = 64,
# c_attn 32·96 + 96 = 3,168, attn c_proj 32·32 + 32 = 1,056, c_fc 32·128 + 128 = 4,224, mlp c_proj 128·32 + 32 =
# 4,128, a block 12,704; ln_f 64. Three blocks: 2,112 + 38,112 + 64 = 40,288; attention 3·4,224 = 12,672 (31.5 %),
# MLP 3·8,352 = 25,056 (62.2 %), LayerNorms 3·128 + 64 = 448 (1.1 %), embeddings 2,112 (5.2 %).
BIASED = """\
component                                        shape                            parameters
--------------------------------------------------------------------------------------------
input ids                                        B×T                                        
wte (token embedding)                            V×C = 50×32                           1,600
wpe (position embedding)                         block_size×C = 16×32                    512
x = wte[ids] + wpe[0..T)                         B×T×C                                      
h.0 … h.2: 3 blocks, each                        B×T×C → B×T×C                        12,704
  ln_1                                           B×T×C, γ and β of C = 32                 64
  attn.c_attn (W_Q, W_K, W_V)                    C → 3C = 32 → 96                      3,168
  q, k, v per head                               B×H×T×d_k, heads × d_k = 2 × 16            
  softmax(QKᵀ/√d_k + mask)                       B×H×T×T, −∞ above the diagonal             
  attn.c_proj (W_O)                              C → C = 32 → 32                       1,056
  + residual                                     B×T×C                                      
  ln_2                                           B×T×C, γ and β of C = 32                 64
  mlp.c_fc + GELU                                C → 4C = 32 → 128                     4,224
  mlp.c_proj                                     4C → C = 128 → 32                     4,128
  + residual                                     B×T×C                                      
ln_f                                             B×T×C, γ and β of C = 32                 64
lm_head (tied to wte: no parameters of its own)  C → V = 32 → 50                            
logits                                           B×T×V                                      
--------------------------------------------------------------------------------------------
B batch, T ≤ block_size 16, C = n_embd 32, H = n_head 2, d_k = C/H = 16, V = vocab 50, 3 blocks
embeddings           2,112  (5.2%)
attention           12,672  (31.5%)
MLP                 25,056  (62.2%)
LayerNorms             448  (1.1%)
total               40,288"""

# No biases, one block of 4 heads: ln γ only (32), c_attn 3,072, c_proj 1,024, c_fc 4,096, mlp c_proj 4,096, a
# block 12,352; total 2,112 + 12,352 + 32 = 14,496: 14.6 %, 28.3 %, 56.5 %, 0.7 %.
UNBIASED_ONE_BLOCK = """\
h.0 … h.0: 1 blocks, each                        B×T×C → B×T×C                       12,352
  ln_1                                           B×T×C, γ of C = 32                      32
  attn.c_attn (W_Q, W_K, W_V)                    C → 3C = 32 → 96                     3,072
  q, k, v per head                               B×H×T×d_k, heads × d_k = 4 × 8            
  softmax(QKᵀ/√d_k + mask)                       B×H×T×T, −∞ above the diagonal            
  attn.c_proj (W_O)                              C → C = 32 → 32                      1,024
  + residual                                     B×T×C                                     
  ln_2                                           B×T×C, γ of C = 32                      32
  mlp.c_fc + GELU                                C → 4C = 32 → 128                    4,096
  mlp.c_proj                                     4C → C = 128 → 32                    4,096
  + residual                                     B×T×C                                     
ln_f                                             B×T×C, γ of C = 32                      32
lm_head (tied to wte: no parameters of its own)  C → V = 32 → 50                           
logits                                           B×T×V                                     
-------------------------------------------------------------------------------------------
B batch, T ≤ block_size 16, C = n_embd 32, H = n_head 4, d_k = C/H = 8, V = vocab 50, 1 blocks
embeddings           2,112  (14.6%)
attention            4,096  (28.3%)
MLP                  8,192  (56.5%)
LayerNorms              96  (0.7%)
total               14,496"""

BIGRAM = """\
component     shape        parameters
-------------------------------------
input ids     B×T                    
logits_table  V×V = 10×10         100
logits        B×T×V                  
-------------------------------------
embeddings             100  (100.0%)
total                  100"""


def test_the_anatomy_table_of_a_gpt_with_biases_row_by_row():
    assert anatomy_table(gpt(n_layer=3)) == BIASED


def test_the_anatomy_of_one_block_without_biases():
    lines = anatomy_table(gpt(n_layer=1, n_head=4, bias=False)).splitlines()
    assert lines[0].split() == ["component", "shape", "parameters"] and set(lines[1]) == {"-"}
    assert "\n".join(lines[6:]) == UNBIASED_ONE_BLOCK


def test_the_anatomy_of_the_bigram_table():
    assert anatomy_table(Bigram(ModelConfig(vocab_size=10, arch="bigram"))) == BIGRAM


# ---- the trace ---------------------------------------------------------------------------------------------------

def by_hand(model, ids):
    """Every block's attention probabilities, the equation in plain torch: per head, softmax over keys j ≤ i of
    q_i·k_j / √D, with q, k the slices of c_attn(ln_1(x)); x advanced by the model's own blocks."""
    x = model.transformer.wte(ids) + model.transformer.wpe(torch.arange(ids.size(1)))
    out = []
    for block in model.transformer.h:
        C, H = x.size(-1), block.attn.n_head
        D = C // H
        q, k, _ = block.attn.c_attn(block.ln_1(x)).split(C, dim=-1)
        probs = torch.zeros(ids.size(0), H, ids.size(1), ids.size(1))
        for h in range(H):
            qh, kh = q[..., h * D:(h + 1) * D], k[..., h * D:(h + 1) * D]
            for i in range(ids.size(1)):
                scores = (qh[:, i:i + 1] * kh[:, :i + 1]).sum(-1) / D ** 0.5  # (B, i + 1)
                probs[:, h, i, :i + 1] = torch.softmax(scores, dim=-1)
        out.append(probs)
        x = block(x)
    return out


def test_attention_is_the_causal_softmax_of_scaled_dot_products():
    model = gpt(5, n_head=4, block_size=8)
    ids = torch.randint(50, (2, 8))  # the whole context: 8 of 8 positions is allowed
    with torch.no_grad():
        expected = by_hand(model, ids)
    tr = trace(model, ids)
    assert tr.n_layer == 2 and tr.ids.tolist() == ids.tolist()
    for got, want in zip(tr.attention, expected):
        assert got.shape == (2, 4, 8, 8) and (got - want).abs().max().item() <= 1e-5


def test_one_sequence_is_traced_as_a_batch_of_one_and_every_id_in_the_vocabulary_is_accepted():
    model = gpt(6)
    tr = trace(model, [0, 49, 7])
    assert tr.ids.tolist() == [[0, 49, 7]] and tr.logits.shape == (1, 3, 50)
    with pytest.raises(GptlabError, match=r"token ids must be in \[0, 50\)"):
        trace(model, [3, -1])


def test_generation_may_fill_the_context_exactly():
    tr = trace_generation(gpt(7), [1, 2, 3, 4], SampleConfig(max_new_tokens=12, temperature=0))
    assert tr.ids.shape == (1, 16)


class NoBytes:
    def decode_bytes(self, ids):
        return b""


def test_token_labels_escape_invisible_characters_and_name_the_empty_token():
    chars = CharTokenizer("a\r\xa0\u200b\x7fé")
    assert token_labels(chars, chars.encode("é\r\xa0\u200b\x7fa")) == ["é", "\\r", "\\xa0", "\\u200b", "\\x7f", "a"]
    assert token_label(NoBytes(), 0) == "∅"


def test_a_byte_level_piece_is_shown_byte_by_byte():
    gpt2 = GPT2Tokenizer()
    assert token_labels(gpt2, gpt2.encode("😀")) == ["\\xf0\\x9f\\x98", "\\x80"]  # F0 9F 98 80, split 3 + 1


def test_one_token_is_enough_to_trace():
    tr = trace(gpt(11), [7])
    assert tr.logits.shape == (1, 1, 50) and tr.attention[0][0, :, 0, 0].tolist() == [1.0, 1.0]


def test_the_causal_mask_is_made_on_the_streams_device():
    """On the meta device (standing in for an accelerator): a mask left on the CPU could not mask its scores."""
    with torch.device("meta"):
        model = GPT(ModelConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0))
        x = torch.randn(2, 5, 32)
    seen = {}
    added = model.transformer.h[0].attn(x, tap=lambda name, t: seen.setdefault(name, t))  # the traced path
    probs = seen["attn.hook_pattern"]
    assert added.device.type == probs.device.type == "meta" and probs.shape == (2, 2, 5, 5)


def test_refusals_name_the_model_and_the_way_out():
    with pytest.raises(GptlabError, match="this run's model is a Bigram: it has no attention"):
        trace(Bigram(ModelConfig(vocab_size=10, arch="bigram")), [1])
    with pytest.raises(GptlabError, match="^the prompt is 17 tokens but the model's context is 16; give a shorter prompt$"):
        trace(gpt(), list(range(17)))
    with pytest.raises(GptlabError, match="the prompt plus 9 new tokens is 17 tokens but the model's context is 16; "
                                          "give a shorter prompt or generate fewer tokens"):
        trace_generation(gpt(), [1] * 8, SampleConfig(max_new_tokens=9, temperature=0))

def test_a_word_is_read_at_its_last_token_and_a_missing_word_is_refused():
    chars = CharTokenizer("abc ")
    text = "ab cab"
    ids = chars.encode(text)
    assert find_word(chars, ids, text, "ab") == 1 and find_word(chars, ids, text, "cab") == 5
    assert find_word(chars, ids, text, "a") == 0
    for word in ("", "ba"):
        with pytest.raises(GptlabError, match="does not occur"):
            find_word(chars, ids, text, word)


def test_word_representations_refuse_a_context_longer_than_the_model_reads():
    chars = CharTokenizer("ab ")
    model = gpt(8, vocab_size=3, block_size=8)
    with pytest.raises(GptlabError, match="context is 8"):
        word_representations(model, chars, "ab", ["ab", "a " * 5 + "ab"])
    with pytest.raises(GptlabError, match="at least two"):
        word_representations(model, chars, "ab", ["ab"])
    assert word_representations(model, chars, "ab", ["ab", "b ab"]).shape == (2 + 2, 2, 32)


def test_pairwise_cosine_by_hand():
    reps = torch.tensor([[[1.0, 0.0], [1.0, 1.0], [0.0, -2.0]]], dtype=torch.float64)
    r = 2 ** -0.5  # cos 45°
    expected = torch.tensor([[[1, r, 0], [r, 1, -r], [0, -r, 1]]])
    sims = pairwise_cosine(reps)
    assert sims.dtype == torch.float32 and torch.allclose(sims, expected.float(), atol=1e-6)


# ---- the logit lens's table and the pictures ---------------------------------------------------------------------

# Row 0 of the lens: log-probabilities chosen by hand (depth, position) over the vocabulary " ", a, b, é; row 1
# of the batch is uniform, so that reading it instead would show 0.25 everywhere.
LENS_P = [[[0.1, 0.6, 0.2, 0.1], [0.3, 0.2, 0.05, 0.45]], [[0.05, 0.15, 0.7, 0.1], [0.8, 0.1, 0.06, 0.04]]]
LENS = torch.stack([torch.tensor(LENS_P).log(), torch.full((2, 2, 4), 0.25).log()], dim=1)  # (depths, B, T, V)
LENS_TABLE = """\
pos  token  emb            h.0
------------------------------
0    a      a 0.60 b 0.20  b 0.70 a 0.15
1    é      é 0.45 ␣ 0.30  ␣ 0.80 a 0.10"""


def test_the_lens_table_shows_the_top_tokens_of_the_first_row_at_every_depth():
    chars = CharTokenizer("ab é")
    assert lens_table(LENS, chars, [1, 3], top=2) == LENS_TABLE
    assert lens_table(LENS, chars, [1, 3]).splitlines()[2:] == ["0    a      a 0.60  b 0.70", "1    é      é 0.45  ␣ 0.80"]


def test_the_lens_top_is_one_token_unless_asked():
    values, indices = lens_top(LENS)  # row 0: a at emb/pos 0 (0.6), é at emb/pos 1 (0.45), then b (0.7), ␣ (0.8)
    assert indices.tolist() == [[[1], [3]], [[2], [0]]]
    assert torch.allclose(values[..., 0], torch.tensor([[0.6, 0.45], [0.7, 0.8]]), atol=1e-6)

@pytest.fixture
def figures(monkeypatch):
    """Every figure a picture function draws from now on, kept open to be read (and closed at the end)."""
    drawn = []
    monkeypatch.setattr(pictures, "save_png", lambda fig, out: drawn.append(fig) or Path(out))
    yield drawn
    for fig in drawn:
        pyplot().close(fig)


def ticks(labels):
    return [t.get_text() for t in labels]


def test_the_attention_grid_draws_each_heads_map_of_the_first_row(figures, tmp_path):
    model = gpt(9, block_size=100)
    tr = trace(model, torch.randint(50, (2, 3)))
    labels = ["x", "中", "␣"]
    assert attention_png(tr, labels, tmp_path / "a.png") == tmp_path / "a.png"
    fig = figures[0]
    assert tuple(fig.get_size_inches()) == pytest.approx((2 * 2 + 1, 2 * 2 + 0.6))  # cell max(2, 0.11·3) = 2
    assert fig._suptitle.get_fontsize() == 10 and fig._suptitle.get_position()[1] == 1.0
    assert fig._suptitle.get_text() == "attention: row = query token, column = key token it reads (colour = probability)"
    axes = [ax for ax in fig.axes if ax.images]
    assert len(axes) == 4
    for n, ax in enumerate(axes):
        layer, head = divmod(n, 2)
        assert ax.get_title() == f"layer {layer} head {head}"
        image = ax.images[0]
        assert torch.equal(torch.from_numpy(image.get_array().data), tr.attention[layer][0, head])
        assert image.get_clim() == (0, 1) and image.get_interpolation() == "nearest"
        assert image.get_cmap().name == "viridis" and ax.title.get_fontsize() == 9
        assert ax.get_xticklabels()[0].get_rotation() == 90 and ax.xaxis.get_major_ticks()[0].tick1line.get_markersize() == 0
        shown = ["x", "\\u4e2d", "␣"]
        assert ticks(ax.get_xticklabels()) == (shown if layer == 1 else ["", "", ""])
        assert ticks(ax.get_yticklabels()) == (shown if head == 0 else ["", "", ""])
        assert {t.get_fontsize() for t in ax.get_xticklabels() + ax.get_yticklabels()} == {9.0}  # min(9, 36)


@pytest.mark.parametrize("T, layer, head, size, font", [
    (30, None, None, (3.3 * 2 + 1, 3.3 * 2 + 0.6), 0.75 * 72 * 3.3 / 30),  # cell 0.11·30 = 3.3
    (60, None, None, (4.5 * 2 + 1, 4.5 * 2 + 0.6), 0.75 * 72 * 4.5 / 60),  # cell at most 4.5
    (100, 1, None, (4.5 * 2 + 1, 4.5 + 0.6), 3.0),  # one layer's heads; the font at least 3
    (30, None, 1, (3.3 + 1, 3.3 * 2 + 0.6), 0.75 * 72 * 3.3 / 30),  # one head across layers
    (30, 1, 0, (6 + 1, 6 + 0.6), 9.0),  # one map at full size: cell 6, font min(9, 0.75·72·6/30 = 10.8)
])
def test_attention_pictures_are_sized_to_their_panels_and_tokens(figures, tmp_path, T, layer, head, size, font):
    tr = trace(gpt(10, block_size=100), torch.randint(50, (T,)))
    attention_png(tr, [str(i % 10) for i in range(T)], tmp_path / "a.png", layer=layer, head=head)
    fig = figures[0]
    axes = [ax for ax in fig.axes if ax.images]
    assert tuple(fig.get_size_inches()) == pytest.approx(size)
    assert [ax.get_title() for ax in axes] == [f"layer {lyr} head {hd}" for lyr, hd in zip(*(
        [[0, 0, 1, 1], [0, 1, 0, 1]] if layer is None and head is None else
        [[layer, layer], [0, 1]] if head is None else [[0, 1], [head, head]] if layer is None else [[layer], [head]]))]
    assert axes[-1].get_xticklabels()[0].get_fontsize() == pytest.approx(font)
    assert ticks(axes[-1].get_xticklabels()) == [str(i % 10) for i in range(T)]


LENS3_P = [[[.1, .6, .2, .1], [.3, .2, .05, .45], [.25, .25, .4, .1]],
           [[.05, .15, .7, .1], [.1, .1, .1, .7], [.5, .2, .2, .1]],
           [[.05, .05, .1, .8], [.8, .1, .06, .04], [.1, .65, .15, .1]]]


def test_the_lens_heatmap_shows_the_final_predictions_probability_at_every_depth(figures, tmp_path):
    chars = CharTokenizer("ab é")
    lens = torch.stack([torch.tensor(LENS3_P).log(), torch.full((3, 3, 4), 0.25).log()], dim=1)
    lens_png(lens, ["a", "é", "中"], chars, tmp_path / "lens.png")
    fig = figures[0]
    ax, bar = fig.axes
    # the final depth predicts é, ␣, a; their probabilities at each depth:
    p_final = torch.tensor([[.1, .3, .25], [.1, .1, .2], [.8, .8, .65]])
    assert torch.allclose(torch.from_numpy(ax.images[0].get_array().data), p_final, atol=1e-6)
    assert ax.images[0].get_clim() == (0, 1) and ax.get_aspect() == "auto" and ax.images[0].get_cmap().name == "magma"
    assert {(t.get_ha(), t.get_va(), t.get_fontsize()) for t in ax.texts} == {("center", "center", 7)}
    assert {t.get_fontsize() for t in ax.get_xticklabels() + ax.get_yticklabels()} == {8} and ax.title.get_fontsize() == 10
    cells = [(t.get_position(), t.get_text(), t.get_color()) for t in ax.texts]
    tops = [["a", "é", "b"], ["b", "é", "␣"], ["é", "␣", "a"]]  # each depth's own top-1
    assert cells == [((t, d), tops[d][t], "black" if d == 2 else "white") for d in range(3) for t in range(3)]
    assert ticks(ax.get_xticklabels()) == ["a", "é", "\\u4e2d"]
    assert ticks(ax.get_yticklabels()) == ["emb", "after h.0", "after h.1"]
    assert ax.get_xlabel() == "input token (each column predicts the token after it)"
    assert bar.get_ylabel() == "probability of the final prediction"
    assert bar.get_position().width == pytest.approx(0.03 * (0.9 - 0.125))  # 3 % of the default axes' span
    assert ax.get_title() == ("logit lens: ln_f + lm_head on the residual stream after each block (text: top-1 at "
                              "that depth)")
    assert tuple(fig.get_size_inches()) == pytest.approx((6.0, 0.55 * 3 + 1.8))  # max(6, 0.42·3 + 2)


def test_a_lens_cell_is_written_in_black_only_above_60_percent(figures, tmp_path):
    lens = torch.tensor([[[[.3, .7]]], [[[.6, .4]]]]).log()  # the final 0.6 is float32's 0.6 exactly
    lens_png(lens, ["a"], CharTokenizer("ab"), tmp_path / "lens.png")
    assert [t.get_color() for t in figures[0].axes[0].texts] == ["white", "white"]

def test_a_long_lens_heatmap_widens_with_the_tokens(figures, tmp_path):
    chars = CharTokenizer("ab é")
    lens_png(torch.randn(2, 1, 20, 4), ["a"] * 20, chars, tmp_path / "lens.png")
    assert tuple(figures[0].get_size_inches()) == pytest.approx((0.42 * 20 + 2, 0.55 * 2 + 1.8))


def test_a_picture_is_written_into_new_folders_at_100_dpi_cropped_and_closed(tmp_path):
    plt = pyplot()
    full = plt.figure(figsize=(3, 2))
    later = plt.figure()  # the current figure now: saving `full` closes `full`, not this one
    ax = full.add_axes((0, 0, 1, 1))
    ax.imshow([[0, 1], [1, 0]], aspect="auto")
    ax.set_axis_off()  # the image fills the figure, nothing beyond it
    with matplotlib.rc_context({"savefig.dpi": 72}):  # a matplotlibrc's resolution does not apply
        out = pictures.save_png(full, tmp_path / "a" / "b" / "full.png")
    assert out == tmp_path / "a" / "b" / "full.png" and not plt.fignum_exists(full.number)
    assert plt.fignum_exists(later.number)
    plt.close(later)
    w, h = Image.open(out).size
    assert abs(w - (300 + 20)) <= 1 and abs(h - (200 + 20)) <= 1  # 3×2 inches at 100 dpi, 0.1 inch padding
    small = plt.figure(figsize=(4, 4))
    small.text(0.5, 0.5, "x")
    out = pictures.save_png(small, tmp_path / "a" / "b" / "small.png")  # the folder already there
    assert max(Image.open(out).size) < 100  # cropped to what is drawn, not 400×400


# The word's vectors at 4 depths (static, tok+pos, h.0, h.1) in 3 contexts, chosen so that the cosines are known:
REPS = torch.tensor([[[1., 0.], [1., 0.], [1., 0.]],     # one static vector: 1, 1, 1
                     [[1., 0.], [0., 1.], [1., 1.]],     # 0, cos 45° = .7071, .7071
                     [[1., 0.], [-1., 0.], [0., 2.]],    # -1, 0, 0
                     [[2., 1.], [1., 2.], [2., 2.]]])    # 4/5 = .8, 6/√40 = .9487, .9487
SIMS = {(0, 1): [1, 0, -1, .8], (0, 2): [1, 2 ** -.5, 0, 6 / 40 ** .5], (1, 2): [1, 2 ** -.5, 0, 6 / 40 ** .5]}


def test_the_similarity_table_by_hand():
    assert similarity_table(REPS).splitlines() == [
        "depth        1 vs 2    1 vs 3    2 vs 3",
        "---------------------------------------",
        "static       1.0000    1.0000    1.0000",
        "tok+pos      0.0000    0.7071    0.7071",
        "h.0         -1.0000    0.0000    0.0000",
        "h.1          0.8000    0.9487    0.9487"]


def test_pca_keeps_the_centred_points_distances_largest_component_first():
    x = torch.tensor([[1., 0, 0], [-1, 0, 0], [0, 2, 0], [0, -2, 0]]) + 5  # spread 2 along x, 4 along y
    xy = pca_2d(x)
    assert torch.allclose(xy.abs(), torch.tensor([[0., 1], [0, 1], [2, 0], [2, 0]]), atol=1e-5)
    line = pca_2d(torch.tensor([[3.], [5.]]))  # one dimension: the second coordinate is 0
    assert torch.allclose(line.abs(), torch.tensor([[1., 0], [1, 0]]), atol=1e-6)


def test_the_embeddings_picture_plots_each_pairs_similarity_and_each_depths_points(figures, tmp_path):
    embeddings_png(REPS, "cat", ["the cat", "a cat", "cat!"], tmp_path / "e.png")
    fig = figures[0]
    whole, zoom, *subs = fig.axes
    names = ["static", "tok+pos", "h.0", "h.1"]
    assert tuple(fig.get_size_inches()) == pytest.approx((9.0, 7.5))  # max(9, 2·4)
    assert whole.get_subplotspec().colspan == range(2) and zoom.get_subplotspec().colspan == range(2, 4)
    assert whole.get_subplotspec().rowspan == zoom.get_subplotspec().rowspan == range(1)
    assert whole.get_subplotspec().get_gridspec().get_height_ratios() == [1.4, 1]
    for ax, first in ((whole, 0), (zoom, 2)):
        assert [line.get_label() for line in ax.lines] == ["context 1 vs 2", "context 1 vs 3", "context 2 vs 3"]
        for line, pair in zip(ax.lines, SIMS):
            assert list(line.get_xdata()) == list(range(first, 4)) and line.get_marker() == "o"
            assert line.get_ydata().tolist() == pytest.approx(SIMS[pair][first:], abs=1e-6)
        assert ticks(ax.get_xticklabels()) == names[first:]
    assert whole.get_ylabel() == "cosine similarity"
    assert whole.get_title() == "'cat' in 3 contexts: one static vector, then contextual ones"
    assert zoom.get_title() == "after each block, zoomed in"
    assert ticks(zoom.get_legend().get_texts()) == ["context 1 vs 2", "context 1 vs 3", "context 2 vs 3"]
    assert [ax.get_title() for ax in subs] == names
    for d, ax in enumerate(subs):
        assert ax.get_subplotspec().rowspan == range(1, 2) and ax.get_subplotspec().colspan == range(d, d + 1)
        assert list(ax.get_xticks()) == [] and list(ax.get_yticks()) == []
        points = torch.tensor([c.get_offsets()[0].tolist() for c in ax.collections])  # one scatter per context
        assert [t.get_text() for t in ax.texts] == ["1", "2", "3"]
        assert [t.xy for t in ax.texts] == [tuple(p) for p in points.tolist()]
        assert torch.allclose(torch.cdist(points, points), torch.cdist(REPS[d], REPS[d]), atol=1e-5)
        assert [tuple(c.get_facecolor()[0]) for c in ax.collections] == [pyplot().get_cmap("tab10")(n) for n in range(3)]
    legend = [t for t in fig.texts if t.get_text().startswith("PCA")]
    assert [t.get_text() for t in legend] == ["PCA per depth; contexts\n1: 'the cat'\n2: 'a cat'\n3: 'cat!'"]
    assert legend[0].get_position() == (0.01, -0.02) and legend[0].get_va() == "top"
    # the type: titles 10 (8 per depth), ticks 8, point numbers 8, legends 7; points of 30 pt²; a faint grid
    assert whole.title.get_fontsize() == zoom.title.get_fontsize() == 10 and subs[0].title.get_fontsize() == 8
    assert {t.get_fontsize() for t in whole.get_xticklabels() + zoom.get_xticklabels() + subs[0].texts} == {8}
    assert {t.get_fontsize() for t in zoom.get_legend().get_texts() + legend} == {7} and zoom.get_legend()._loc == 3
    assert subs[0].collections[0].get_sizes().tolist() == [30] and whole.xaxis.get_gridlines()[0].get_alpha() == 0.3


@pytest.mark.parametrize("D, width, half", [(3, 9.0, 1), (6, 12.0, 3)])
def test_the_embeddings_picture_widens_with_depth_and_lists_ten_contexts_cut_at_70(figures, tmp_path, D, width, half):
    contexts = ["x" * 80] + [f"c{n}" for n in range(11)]
    embeddings_png(torch.randn(D, 12, 8), "x", contexts, tmp_path / "e.png")
    fig = figures[0]
    assert tuple(fig.get_size_inches()) == pytest.approx((width, 7.5))
    assert fig.axes[0].get_subplotspec().colspan == range(half)
    legend = next(t.get_text() for t in fig.texts if t.get_text().startswith("PCA")).splitlines()
    assert legend[1:] == [f"1: '{'x' * 70}'"] + [f"{n + 2}: 'c{n}'" for n in range(9)]
    tab10 = pyplot().get_cmap("tab10")
    assert [tuple(c.get_facecolor()[0]) for c in fig.axes[-1].collections] == [tab10(n % 10) for n in range(12)]
