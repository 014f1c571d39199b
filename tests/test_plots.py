"""plots.py: what a picture can draw (token labels, picture formats); the curves themselves are checked where they
are made (test_runs.py, test_cli.py)."""

import warnings

import pytest

from gptlab.plots import drawable, pyplot

LABELS = ["\r", "␍", "🦄", "日本", "a\rb🤖c", "\x0b", "héllo ж ␣↵→ 😀 ∅"]


def missing_glyphs(label, out) -> list[str]:
    """matplotlib's own warnings while it draws `label` as a tick label into the PNG `out`."""
    plt = pyplot()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fig, ax = plt.subplots()
        ax.set_xticks([0], [label])
        fig.savefig(out)
        plt.close(fig)
    return [str(w.message) for w in seen if "missing from font" in str(w.message)]


@pytest.mark.parametrize("label", LABELS)
def test_token_labels_are_drawn_without_missing_glyphs(tmp_path, label):
    assert not missing_glyphs(drawable(label), tmp_path / "x.png")
    if label != LABELS[-1]:  # the fixture can fail: this font lacks these characters
        assert missing_glyphs(label, tmp_path / "x.png")


def test_a_character_the_font_lacks_is_written_as_its_escape():
    assert drawable("\r") == drawable("␍") == "\\r" and drawable("\x0b") == "\\x0b"
    assert drawable("🦄") == "\\U0001f984" and drawable("日本") == "\\u65e5\\u672c"
    assert drawable("a\rb🤖c") == "a\\rb\\U0001f916c"
    assert drawable(LABELS[-1]) == LABELS[-1]  # what the font has stays as it is
