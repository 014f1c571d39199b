"""inspect/heatmaps.py on sweeps, parts and head scores made by hand: the shares of the gap and the tables' text
worked out by hand (the no-gap guard crossed at its edge), and what each picture shows read back from the figure
matplotlib drew (titles, labels, colour scales, sizes) and from the PNG written; the page's cells, escaping and
colours."""

import os
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest
import torch
from PIL import Image

from gptlab.heads import HeadScores
from gptlab.inspect import heatmaps
from gptlab.inspect.heatmaps import (heads_png, heads_table, logit_png, logit_table, patch_html, patch_page,
                                     patch_png, patch_table, shares)
from gptlab.inspect.patching import LogitParts, PatchResult

VALUES = torch.tensor([[1.0, 2.0], [3.0, 0.5]])


def sweep(kind="resid_pre", method="activation", values=VALUES, clean=3.0, corrupt=1.0) -> PatchResult:
    """A sweep as patching.py builds it: layers L0.., positions 0.., heads H0.."""
    axes = {"resid_pre": ("layer", "pos"), "head_out": ("layer", "head"),
            "head_out_by_pos": ("layer", "pos", "head")}[kind]
    names = {"layer": "L{}", "pos": "{}", "head": "H{}"}
    ticks = tuple(tuple(names[a].format(i) for i in range(n)) for a, n in zip(axes, values.shape))
    return PatchResult(kind, method, values, axes, ticks, clean, corrupt)


@pytest.fixture
def drawn(monkeypatch):
    """The figures handed to save_png (still readable after it closes them)."""
    figures, save = [], heatmaps.save_png
    monkeypatch.setattr(heatmaps, "save_png", lambda fig, out: figures.append(fig) or save(fig, out))
    return figures


# ---- shares of the gap ------------------------------------------------------------------------------------------


def test_activation_shares_are_the_patched_change_over_the_gap_attribution_the_estimate_over_it():
    matrix, is_share = shares(sweep())  # gap 3 - 1 = 2
    assert is_share and matrix.tolist() == [[0.0, 0.5], [1.0, -0.25]]
    matrix, is_share = shares(sweep(method="attribution"))
    assert is_share and matrix.tolist() == [[0.5, 1.0], [1.5, 0.25]]
    matrix, is_share = shares(sweep(clean=-1.0, corrupt=1.0))  # a gap below zero is a gap
    assert is_share and matrix.tolist() == [[0.0, -0.5], [-1.0, 0.25]]


@pytest.mark.parametrize("clean, is_share", [(1e-6, False), (-1e-6, False), (2e-6, True), (-2e-6, True)])
def test_a_gap_up_to_one_millionth_is_no_gap_and_shows_the_raw_change(clean, is_share):
    matrix, share = shares(sweep(clean=clean, corrupt=0.0))
    assert share == is_share
    assert torch.allclose(matrix, VALUES / clean if is_share else VALUES)
    matrix, share = shares(sweep(method="attribution", clean=1.0 + 1e-7, corrupt=1.0))
    assert not share and torch.equal(matrix, VALUES)


# ---- the tables -------------------------------------------------------------------------------------------------


def test_the_patch_table_is_a_row_per_layer_and_a_column_per_token_at_least_six_wide():
    assert patch_table(sweep(), ["a", "b"]).splitlines() == [
        "activation patching, residual stream entering each block (share of the clean - corrupted gap restored)",
        "",
        "           0 a    1 b",
        "L0        0.00   0.50",
        "L1        1.00  -0.25"]
    assert patch_table(sweep(method="attribution", clean=1.0), ["a", "wordy"]).splitlines() == [
        "attribution patching, residual stream entering each block (change of the metric (no gap))",
        "",
        "            0 a 1 wordy",
        "L0         1.00    2.00",
        "L1         3.00    0.50"]


def test_heads_by_position_are_a_row_per_layer_and_head_and_positions_past_the_tokens_are_numbers():
    values = torch.arange(12.0).reshape(2, 3, 2)  # (layer, pos, head)
    lines = patch_table(sweep("head_out_by_pos", values=values, clean=0.0, corrupt=0.0), ["x", "y"]).splitlines()
    assert lines[0] == "activation patching, each head's output at each position (change of the metric (no gap))"
    assert lines[2:] == ["           0 x    1 y      2",
                         "L0H0      0.00   2.00   4.00",
                         "L0H1      1.00   3.00   5.00",
                         "L1H0      6.00   8.00  10.00",
                         "L1H1      7.00   9.00  11.00"]
    lines = patch_table(sweep("head_out", clean=0.0, corrupt=0.0), ["x", "y"]).splitlines()
    assert lines[0].startswith("activation patching, each head's output (all positions) (")
    assert lines[2:] == ["            H0     H1", "L0        1.00   2.00", "L1        3.00   0.50"]


def test_the_logit_table_ranks_parts_by_size_whatever_their_sign_and_keeps_the_top_ones():
    parts = LogitParts(("embed", "L0H0", "L0H1", "L0 mlp"), torch.tensor([0.5, -2.0, 1.0, 0.25]), -0.25)
    assert logit_table(parts, top=3).splitlines() == [
        "direct logit attribution: the parts of logit difference -0.2500 (sum -0.2500), largest first",
        "  L0H0  -2.0000", "  L0H1  +1.0000", "  embed +0.5000"]
    labels = tuple(f"p{i}" for i in range(13))
    many = logit_table(LogitParts(labels, torch.arange(13.0), 78.0)).splitlines()
    assert len(many) == 13 and many[1] == "  p12 +12.0000" and many[-1] == "  p1  +1.0000"


def test_the_heads_table_has_each_heads_three_scores_the_chance_levels_and_the_best_of_each():
    scores = HeadScores(previous_token=torch.tensor([[0.1, 0.9], [0.2, 0.3]]),
                        duplicate_token=torch.tensor([[0.0, 0.05], [0.5, 0.25]]),
                        induction=torch.tensor([[0.125, 0.0], [0.0, 0.875]]), half=3)
    # chance with half 3: previous (1/2 + 1/3 + 1/4 + 1/5 + 1/6) / 5 = 0.29, the others (1/4 + 1/5 + 1/6) / 3
    assert heads_table(scores).splitlines() == [
        "head scores on 3 random tokens repeated once (chance: previous-token 0.290, duplicate-token 0.206, "
        "induction 0.206)",
        "head     previous-token  duplicate-token  induction",
        "L0H0              0.100            0.000      0.125",
        "L0H1              0.900            0.050      0.000",
        "L1H0              0.200            0.500      0.000",
        "L1H1              0.300            0.250      0.875",
        "best previous-token: L0H1 0.900; duplicate-token: L1H0 0.500; induction: L1H1 0.875"]


# ---- the pictures -----------------------------------------------------------------------------------------------


def ticks(labels) -> list[str]:
    return [t.get_text() for t in labels]


def test_the_patch_picture_is_a_heat_map_per_sweep_centred_on_zero_with_its_colour_bar(drawn, tmp_path):
    first = sweep()
    flat = sweep("head_out", method="attribution", values=torch.zeros(2, 2), clean=0.0, corrupt=0.0)
    out = patch_png([first, flat], ["a", "\x00"], tmp_path / "deep" / "patch.png", title="my prompts")
    assert out == tmp_path / "deep" / "patch.png" and Image.open(out).format == "PNG"
    (fig,) = drawn
    assert tuple(fig.get_size_inches()) == pytest.approx((4.2 * 2 + 1, 4.6))
    assert fig._suptitle.get_text() == "my prompts" and fig._suptitle.get_fontsize() == 10
    heat, zero, *bars = fig.axes
    assert [b.get_ylabel() for b in bars] == ["share of the gap restored", "metric change"]
    assert [b.get_position().height / heat.get_position().height for b in bars] == pytest.approx([0.8, 0.8])
    solids = [next(c for c in b.collections if type(c).__name__ == "QuadMesh") for b in bars]  # each bar's colours
    assert [(c.get_cmap().name, c.get_clim()) for c in solids] == [("RdBu", (-1.0, 1.0)), ("RdBu", (-1e-9, 1e-9))]
    assert heat.get_title() == "activation: residual stream entering each block"
    assert zero.get_title() == "attribution: each head's output (all positions)"
    (image,) = heat.images
    assert image.get_cmap().name == "RdBu" and image.get_clim() == (-1.0, 1.0)  # the largest share is 1
    assert image.get_array().tolist() == [[0.0, 0.5], [1.0, -0.25]] and image.get_interpolation() == "nearest"
    assert heat.get_aspect() == "auto" and heat.title.get_fontsize() == 9
    assert ticks(heat.get_xticklabels()) == ["0 a", "1 \\x00"] and ticks(heat.get_yticklabels()) == ["L0", "L1"]
    assert heat.get_xticklabels()[0].get_rotation() == 90 and heat.get_xticklabels()[0].get_fontsize() == 7
    assert heat.get_yticklabels()[0].get_fontsize() == 7
    assert zero.images[0].get_clim() == (-1e-9, 1e-9)  # nothing to scale: a tiny range, not a zero one
    assert ticks(zero.get_xticklabels()) == ["H0", "H1"]
    drawn.clear()
    with matplotlib.rc_context({"font.size": 14}):  # a user's matplotlibrc: the title keeps its own size
        patch_png([first], ["a", "b"], tmp_path / "one.png")
    assert drawn[0]._suptitle.get_text() == "activation patching" and drawn[0]._suptitle.get_fontsize() == 10
    assert tuple(drawn[0].get_size_inches()) == pytest.approx((5.2, 4.6))


def test_the_logit_picture_is_a_bar_per_part_green_adding_red_taking_first_part_on_top(drawn, tmp_path):
    parts = LogitParts(("embed", "L0H0", "L0 mlp"), torch.tensor([0.0, -2.0, 1.5]), -0.5)
    out = logit_png(parts, tmp_path / "dla.png")
    assert Image.open(out).size[0] > 300
    (fig,) = drawn
    (ax,) = fig.axes
    assert tuple(fig.get_size_inches()) == pytest.approx((7, 0.22 * 3 + 1.2))
    bars = ax.patches
    assert [b.get_width() for b in bars] == [0.0, -2.0, 1.5] and [b.get_y() + b.get_height() / 2 for b in bars] \
        == [0, 1, 2]
    green, red = (0x2C / 255, 0xA0 / 255, 0x2C / 255, 1.0), (0xD6 / 255, 0x27 / 255, 0x28 / 255, 1.0)
    assert [tuple(b.get_facecolor()) for b in bars] == [pytest.approx(green), pytest.approx(red),
                                                       pytest.approx(green)]
    assert ticks(ax.get_yticklabels()) == ["embed", "L0H0", "L0 mlp"] and ax.get_yticklabels()[0].get_fontsize() == 7
    assert ax.yaxis_inverted()  # the first part at the top
    (line,) = ax.lines
    assert list(line.get_xdata()) == [0, 0] and line.get_color() == "#444" and line.get_linewidth() == 0.8
    assert ax.get_title() == "direct logit attribution (logit difference -0.500)" and ax.title.get_fontsize() == 9


def test_the_heads_picture_is_three_layer_by_head_maps_from_zero_to_one_with_chance_in_the_titles(drawn, tmp_path):
    scores = HeadScores(*(torch.rand(3, 2, generator=torch.Generator().manual_seed(s)) for s in range(3)), half=3)
    heads_png(scores, tmp_path / "heads.png")
    (fig,) = drawn
    assert tuple(fig.get_size_inches()) == pytest.approx((3.2 * 3 + 1, 0.5 * 3 + 2.2))
    *maps, bar = fig.axes
    assert [ax.get_title() for ax in maps] == ["previous-token (chance 0.29)", "duplicate-token (chance 0.21)",
                                               "induction (chance 0.21)"]
    for ax, kind in zip(maps, ("previous_token", "duplicate_token", "induction")):
        (image,) = ax.images
        assert image.get_array().tolist() == getattr(scores, kind).tolist()
        assert image.get_cmap().name == "viridis" and image.get_clim() == (0, 1) and ax.get_aspect() == "auto"
        assert ticks(ax.get_xticklabels()) == ["H0", "H1"] and ticks(ax.get_yticklabels()) == ["L0", "L1", "L2"]
        assert ax.get_xticklabels()[0].get_fontsize() == 7 and ax.get_yticklabels()[0].get_fontsize() == 7
        assert ax.title.get_fontsize() == 9
    assert bar.get_ylim() == (0.0, 1.0)  # one colour bar for the three maps
    assert bar.get_position().height / maps[0].get_position().height == pytest.approx(0.8)  # shrunk to 0.8


# ---- the page ---------------------------------------------------------------------------------------------------


def test_a_cell_is_coloured_by_sign_as_strongly_as_its_size_against_the_largest():
    cell = heatmaps._cell
    assert cell(0.5, 2.0) == '<td title="0.5" style="background:rgba(214,39,40,0.250)">0.50</td>'
    assert cell(-3.0, 2.0) == '<td title="-3" style="background:rgba(31,119,180,1.000)">-3.00</td>'
    assert cell(0.0, 2.0) == '<td title="0" style="background:rgba(214,39,40,0.000)">0.00</td>'
    assert cell(0.123456789, 0.0) == '<td title="0.123457" style="background:rgba(214,39,40,0.000)">0.12</td>'
    assert cell(-2.0, 2.0).endswith("rgba(31,119,180,1.000)\">-2.00</td>")


def test_the_page_has_a_table_per_sweep_and_the_logit_parts_escaped_and_self_contained():
    parts = LogitParts(("<embed>", "L0H0"), torch.tensor([1.0, -0.5]), 0.5)
    page = patch_page([sweep()], parts, ["<b>", "&"], "a < b")
    assert page.startswith('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="Content-'
                           "Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
                           "<title>a &lt; b</title><style>body{")
    assert page.endswith("</style></head><body><h2>a &lt; b</h2>"
                         '<h3 class="sweep">activation patching: residual stream entering each block</h3>'
                         '<p class="note">share of the clean - corrupted gap restored; metric clean 3.0000, '
                         "corrupted 1.0000</p>"
                         "<table><tr><th></th><th>0 &lt;b&gt;</th><th>1 &amp;</th></tr>"
                         '<tr><th>L0</th><td title="0" style="background:rgba(214,39,40,0.000)">0.00</td>'
                         '<td title="0.5" style="background:rgba(214,39,40,0.500)">0.50</td></tr>'
                         '<tr><th>L1</th><td title="1" style="background:rgba(214,39,40,1.000)">1.00</td>'
                         '<td title="-0.25" style="background:rgba(31,119,180,0.250)">-0.25</td></tr></table>'
                         '<h3 class="dla">direct logit attribution (logit difference 0.5000)</h3>'
                         "<table><tr><th></th><th>adds</th></tr>"
                         '<tr><th>&lt;embed&gt;</th><td title="1" style="background:rgba(214,39,40,1.000)">1.00</td>'
                         '</tr><tr><th>L0H0</th><td title="-0.5" style="background:rgba(31,119,180,0.500)">-0.50'
                         "</td></tr></table></body></html>")
    flat = patch_page([sweep(clean=1.0)], None, ["a", "b"], "t")
    assert '<p class="note">change of the metric; metric clean 1.0000' in flat and 'class="dla"' not in flat


def test_the_page_is_written_as_utf8_into_folders_it_makes_whatever_the_locale(tmp_path):
    out = patch_html([sweep()], None, ["é", "中"], tmp_path / "new" / "deeper" / "patch.html", "ü")
    assert out == tmp_path / "new" / "deeper" / "patch.html"
    assert out.read_bytes().decode("utf-8") == patch_page([sweep()], None, ["é", "中"], "ü")
    # a process whose locale encoding is ASCII (the C locale, neither coerced nor in UTF-8 mode), as on a bare
    # container: the page is UTF-8 still
    script = ("import sys, torch; sys.path.insert(0, 'tests'); from test_heatmaps import sweep; "
              "from gptlab.inspect.heatmaps import patch_html; import locale; "
              "assert locale.getencoding() == 'ANSI_X3.4-1968', locale.getencoding(); "
              f"patch_html([sweep()], None, ['\\u00e9', '\\u4e2d'], {str(tmp_path / 'c.html')!r}, '\\u00fc')")
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0"}
    subprocess.run([sys.executable, "-X", "utf8=0", "-c", script], env=env, check=True, cwd=Path(__file__).parent.parent)
    assert (tmp_path / "c.html").read_bytes().decode("utf-8") == out.read_text(encoding="utf-8")
