"""plots.py: what a picture can draw (token labels, picture formats); the curves themselves are checked where they
are made (test_runs.py, test_cli.py)."""

import json
import warnings

import pytest

from gptlab.plots import drawable, plot_loss, plot_runs, pyplot

LABELS = ["\r", "␍", "🦄", "日本", "a\rb🤖c", "\x0b", "héllo ж ␣↵→ 😀 ∅\nnext line"]


def missing_glyphs(label, out) -> list[str]:
    """matplotlib's own warnings while it draws `label` as a tick label into the PNG `out`."""
    def draw():
        plt = pyplot()
        fig, ax = plt.subplots()
        ax.set_xticks([0], [label])
        fig.savefig(out)
        plt.close(fig)
    return warned(draw)


def warned(draw) -> list[str]:
    """matplotlib's warnings of a missing glyph while `draw()` runs."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        draw()
    return [str(w.message) for w in seen if "missing from font" in str(w.message)]


@pytest.mark.parametrize("label", LABELS)
def test_token_labels_are_drawn_without_missing_glyphs(tmp_path, label):
    assert not missing_glyphs(drawable(label), tmp_path / "x.png")
    if label != LABELS[-1]:  # the fixture can fail: this font lacks these characters
        assert missing_glyphs(label, tmp_path / "x.png")


def test_a_character_the_font_lacks_is_written_as_its_escape():
    assert drawable("\r") == "\\x0d" and drawable("␍") == "\\u240d" and drawable("\x0b") == "\\x0b"
    assert drawable("🦄") == "\\U0001f984" and drawable("日本") == "\\u65e5\\u672c"
    assert drawable("a\rb🤖c") == "a\\x0db\\U0001f916c"
    assert drawable(LABELS[-1]) == LABELS[-1]  # what the font has stays as it is, a line break too


def test_run_names_in_curves_and_titles_are_drawn_without_missing_glyphs(tmp_path):
    name = "runs/🦄\rrun"
    assert not warned(lambda: plot_runs({name: ([5, 10], [2.0, 1.5], [1.0, 2.0])}, tmp_path / "c.png"))
    rows = [{"kind": "train", "step": 1, "loss": 3.0}, {"kind": "eval", "step": 1, "train_loss": 3.0, "val_loss": 3.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not warned(lambda: plot_loss(tmp_path / "metrics.jsonl", tmp_path / "loss.png", title=name))
    assert (tmp_path / "c.png").stat().st_size and (tmp_path / "loss.png").stat().st_size
