"""Pictures people would rather see than read: the loss curve of a run, and the validation curves of several."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from gptlab.errors import GptlabError

PICTURE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg")  # formats matplotlib writes with no extra software
NATS_PER_TOKEN, BITS_PER_BYTE = "nats / token", "bits / byte"  # the units of a validation curve
# train --probe induction's keys in an evaluation row: each head's induction score, and a uniform pattern's
HEAD_KEY, CHANCE_KEY = re.compile(r"induction/(L\d+H\d+)"), "induction/chance"


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash: skip it
    return rows


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@functools.cache
def _font_characters() -> frozenset[int]:
    """The code points the default font draws (matplotlib's DejaVu Sans unless configured otherwise)."""
    from matplotlib import font_manager, ft2font

    return frozenset(ft2font.FT2Font(font_manager.findfont(font_manager.FontProperties())).get_charmap())


def drawable(label: str) -> str:
    """`label` (a token's text, a run's name) with each character the pictures' font cannot draw written as its
    escape (\\x0d, \\u4e2d, \\U0001f984): matplotlib would draw a box and warn that the glyph is missing. A line
    break stays one (matplotlib breaks the line there)."""
    font = _font_characters()
    return "".join(ch if ch == "\n" or ord(ch) in font else escape(ch) for ch in label)


def escape(ch: str) -> str:
    """A character as Python writes its escape: \\xNN, \\uNNNN or \\UNNNNNNNN."""
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def check_picture_path(path: str | Path, flag: str = "--out") -> Path:
    """`path`, when its suffix names a picture format written here; GptlabError naming the suffixes otherwise
    (matplotlib would add .png to a bare name, and refuse .json only after the picture is drawn)."""
    path = Path(path)
    if path.suffix.lower() not in PICTURE_SUFFIXES:
        raise GptlabError(f"{flag} {path}: a picture's name must end in {', '.join(PICTURE_SUFFIXES)}; for "
                          f"example {path.with_suffix('.png').name if path.suffix else path.name + '.png'}")
    return path


def _save(fig, out_png: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(out_png)
    pyplot().close(fig)
    return Path(out_png)


def plot_loss(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path | None:
    """Train loss per logged step and the estimated train/val loss at each evaluation, as a PNG; where the
    evaluations carry each head's induction score (train --probe induction), those curves in another panel beside it."""
    plt = pyplot()
    rows = read_metrics(metrics_path)
    steps = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    if not steps and not evals:
        return None
    heads = head_curves(evals)
    fig, axes = plt.subplots(1, 2 if heads else 1, figsize=(13 if heads else 8, 4.5), dpi=120, squeeze=False)
    ax = axes[0][0]
    if steps:
        ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8, alpha=0.5, label="train (batch)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["train_loss"] for r in evals], "o-", label="train (estimate)")
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "s-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats / token)")
    ax.set_title(drawable(title or "loss"))
    ax.grid(alpha=0.3)
    ax.legend()
    if heads:
        _draw_heads(axes[0][1], heads, [(r["step"], r[CHANCE_KEY]) for r in evals if CHANCE_KEY in r])
    return _save(fig, out_png)


def head_curves(evals: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{"L1H0": (steps, induction scores), ...}: each head's curve over the evaluation rows that carry it."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for row in evals:
        for key, value in row.items():
            match = HEAD_KEY.fullmatch(key)
            if match:
                steps, scores = curves.setdefault(match.group(1), ([], []))
                steps.append(row["step"])
                scores.append(value)
    return curves


def _draw_heads(ax, heads: dict[str, tuple[list[int], list[float]]], chance: list[tuple[int, float]]) -> None:
    """Every head's induction score over steps, thin; the head that ends highest drawn bold and named."""
    best = max(heads, key=lambda name: heads[name][1][-1])
    for name, (steps, scores) in heads.items():
        if name != best:
            ax.plot(steps, scores, lw=0.8, alpha=0.4, color="grey")
    ax.plot(*heads[best], "o-", lw=2, color="C3", label=f"{best} (best)")
    if chance:
        ax.plot([s for s, _ in chance], [c for _, c in chance], "--", color="black", lw=0.8,
                label="chance (uniform attention)")
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_ylabel("induction score")
    ax.set_title(f"induction score of each of {len(heads)} heads")
    ax.grid(alpha=0.3)
    ax.legend()


def continued_clock(rows: list[dict]) -> list[tuple[dict, float]]:
    """(row, seconds since the run began) for each metrics row that carries a time: each resumed session's clock
    (elapsed_s starts again at 0) continues where the previous one stopped."""
    out, offset, last = [], 0.0, 0.0
    for row in rows:
        elapsed = row.get("elapsed_s")
        if elapsed is None:
            continue
        if elapsed < last:  # a resumed session
            offset += last
        last = elapsed
        out.append((row, offset + elapsed))
    return out


def validation_curve(rows: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """(steps, validation losses, seconds since the run began) of the evaluations in a run's metrics rows."""
    evals = [(row, seconds) for row, seconds in continued_clock(rows) if row.get("kind") == "eval"]
    return [r["step"] for r, _ in evals], [r["val_loss"] for r, _ in evals], [s for _, s in evals]


def plot_runs(curves: dict[str, tuple[list[int], list[float], list[float]]], out_png: str | Path,
              unit: str = NATS_PER_TOKEN) -> Path:
    """The validation loss of several runs ({name: validation_curve(...)}, its losses in `unit`) against steps and
    against seconds, side by side, as one picture (see check_picture_path)."""
    check_picture_path(out_png)
    plt = pyplot()
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120, sharey=True)
    for name, (steps, losses, seconds) in curves.items():
        by_step.plot(steps, losses, "o-", ms=3, label=drawable(name))
        by_time.plot(seconds, losses, "o-", ms=3, label=drawable(name))
    by_step.set_xlabel("step")
    by_time.set_xlabel("seconds of training")
    by_step.set_ylabel(f"validation loss ({unit})")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend()
    return _save(fig, out_png)
