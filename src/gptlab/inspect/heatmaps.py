"""What patching and the head detectors found, as a reader takes it in: tables for the terminal, heat maps and bar
charts as PNG (matplotlib's Agg backend, nothing needs a display), and one self-contained HTML page (no script, no
request: coloured tables, each cell's value in its tooltip).

A patching value is shown as the share of the gap it restores: (patched - corrupted) / (clean - corrupted) for
activation patching, the estimated change / (clean - corrupted) for attribution patching; 1 is "this activation
alone carries the clean answer", 0 "it carries nothing of it". When the two prompts give the same metric there is
no gap, and the raw change is shown instead.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import torch

from gptlab.heads import SCORE_KINDS, HeadScores
from gptlab.inspect.patching import LogitParts, PatchResult
from gptlab.inspect.pictures import save_png
from gptlab.plots import drawable, pyplot

GAP = 1e-6  # |clean - corrupted| below this is no gap to share out
TITLES = {"resid_pre": "residual stream entering each block", "attn_out": "attention output of each block",
          "mlp_out": "MLP output of each block", "head_out": "each head's output (all positions)",
          "head_out_by_pos": "each head's output at each position"}


def shares(result: PatchResult) -> tuple[torch.Tensor, bool]:
    """(the heat map's matrix as shares of the clean-corrupted gap, whether it is a share; else the raw change)."""
    matrix, _, _ = result.heatmap()
    gap = result.clean - result.corrupt
    change = matrix - result.corrupt if result.method == "activation" else matrix
    return (change / gap, True) if abs(gap) > GAP else (change, False)


def _axes_labels(result: PatchResult, tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """Row and column labels of a heat map (the sweep's: L0 / L0H1, H1), positions named by their tokens."""
    _, rows, cols = result.heatmap()
    if "pos" in result.axes:
        cols = [f"{i} {tokens[i]}" if i < len(tokens) else str(i) for i in range(len(cols))]
    return rows, cols


def patch_table(result: PatchResult, tokens: Sequence[str]) -> str:
    """One sweep as text: a row per layer (or layer and head), a column per position or head."""
    matrix, is_share = shares(result)
    rows, cols = _axes_labels(result, tokens)
    unit = "share of the clean - corrupted gap restored" if is_share else "change of the metric (no gap)"
    head = [f"{result.method} patching, {TITLES[result.kind]} ({unit})", ""]
    width = max(6, *(len(drawable(c)) for c in cols))
    lines = [" " * 8 + " ".join(drawable(c).rjust(width) for c in cols)]
    for label, values in zip(rows, matrix.tolist()):
        lines.append(label.ljust(8) + " ".join(f"{v:{width}.2f}" for v in values))
    return "\n".join(head + lines)


def _heat(ax, matrix: torch.Tensor, rows: list[str], cols: list[str], title: str) -> object:
    limit = max(float(matrix.abs().max()), 1e-9)
    image = ax.imshow(matrix.float().numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto",
                      interpolation="nearest")
    ax.set_xticks(range(len(cols)), [drawable(c) for c in cols], rotation=90, fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_title(title, fontsize=9)
    return image


def patch_png(results: Sequence[PatchResult], tokens: Sequence[str], out: str | Path, title: str = "") -> Path:
    """Every sweep as a heat map side by side (red: restores the clean answer, blue: works against it)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results) + 1, 4.6), squeeze=False)
    for ax, result in zip(axes[0], results):
        matrix, is_share = shares(result)
        rows, cols = _axes_labels(result, tokens)
        image = _heat(ax, matrix, rows, cols, f"{result.method}: {TITLES[result.kind]}")
        fig.colorbar(image, ax=ax, shrink=0.8, label="share of the gap restored" if is_share else "metric change")
    fig.suptitle(title or "activation patching", fontsize=10)
    fig.tight_layout()
    return save_png(fig, out)


def logit_table(parts: LogitParts, top: int = 12) -> str:
    """Direct logit attribution as text: the parts that add most to the logit difference, largest |part| first."""
    ranked = sorted(parts.items(), key=lambda item: -abs(item[1]))[:top]
    width = max(len(label) for label, _ in ranked)
    lines = [f"direct logit attribution: the parts of logit difference {parts.logit_diff:.4f} "
             f"(sum {float(parts.values.sum()):.4f}), largest first"]
    return "\n".join(lines + [f"  {label.ljust(width)} {value:+.4f}" for label, value in ranked])


def logit_png(parts: LogitParts, out: str | Path) -> Path:
    """Direct logit attribution as a bar per part (green adds to the answer's lead, red takes from it)."""
    plt = pyplot()
    labels, values = list(parts.labels), parts.values.float().tolist()
    fig, ax = plt.subplots(figsize=(7, 0.22 * len(labels) + 1.2))
    ax.barh(range(len(labels)), values, color=["#2ca02c" if v >= 0 else "#d62728" for v in values])
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(0, color="#444", linewidth=0.8)
    ax.set_title(f"direct logit attribution (logit difference {parts.logit_diff:.3f})", fontsize=9)
    fig.tight_layout()
    return save_png(fig, out)


def heads_table(scores: HeadScores) -> str:
    """Each head's three scores, a line per head, and each kind's chance level (a uniform pattern)."""
    chance = scores.chance()
    layers, heads = scores.induction.shape
    lines = [f"head scores on {scores.half} random tokens repeated once (chance: "
             + ", ".join(f"{k.replace('_', '-')} {chance[k]:.3f}" for k in SCORE_KINDS) + ")",
             "head     previous-token  duplicate-token  induction"]
    for layer in range(layers):
        for h in range(heads):
            values = [float(getattr(scores, k)[layer, h]) for k in SCORE_KINDS]
            lines.append(f"L{layer}H{h}".ljust(9) + f"{values[0]:14.3f} {values[1]:16.3f} {values[2]:10.3f}")
    best = [f"{k.replace('_', '-')}: L{scores.best(k)[0]}H{scores.best(k)[1]} {scores.best(k)[2]:.3f}"
            for k in SCORE_KINDS]
    return "\n".join(lines + ["best " + "; ".join(best)])


def heads_png(scores: HeadScores, out: str | Path) -> Path:
    """The three scores as layer x head heat maps (0 to 1), chance marked in each title."""
    plt = pyplot()
    layers, heads = scores.induction.shape
    fig, axes = plt.subplots(1, 3, figsize=(3.2 * 3 + 1, 0.5 * layers + 2.2), squeeze=False)
    for ax, kind in zip(axes[0], SCORE_KINDS):
        image = ax.imshow(getattr(scores, kind).float().numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(heads), [f"H{h}" for h in range(heads)], fontsize=7)
        ax.set_yticks(range(layers), [f"L{layer}" for layer in range(layers)], fontsize=7)
        ax.set_title(f"{kind.replace('_', '-')} (chance {scores.chance()[kind]:.2f})", fontsize=9)
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8)
    return save_png(fig, out)


def _cell(value: float, limit: float) -> str:
    """A table cell coloured red (positive) or blue (negative) as strongly as |value| / limit."""
    strength = min(abs(value) / limit, 1.0) if limit > 0 else 0.0
    rgb = "214,39,40" if value >= 0 else "31,119,180"
    return f'<td title="{value:.6g}" style="background:rgba({rgb},{strength:.3f})">{value:.2f}</td>'


def _html_table(matrix: torch.Tensor, rows: list[str], cols: list[str]) -> str:
    limit = float(matrix.abs().max())
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(f"<tr><th>{html.escape(r)}</th>{''.join(_cell(v, limit) for v in values)}</tr>"
                   for r, values in zip(rows, matrix.tolist()))
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


_STYLE = ("body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em}"
          "td,th{border:1px solid #ddd;padding:2px 5px;font-size:12px;text-align:right;font-family:monospace}"
          "th{background:#f4f4f4}.note{color:#666;font-size:13px}")


def patch_page(results: Sequence[PatchResult], parts: LogitParts | None, tokens: Sequence[str],
               title: str) -> str:
    """The page's text: each sweep a coloured table, then the direct logit attribution."""
    sections = []
    for result in results:
        matrix, is_share = shares(result)
        rows, cols = _axes_labels(result, tokens)
        unit = "share of the clean - corrupted gap restored" if is_share else "change of the metric"
        sections.append(f'<h3 class="sweep">{result.method} patching: {TITLES[result.kind]}</h3>'
                        f'<p class="note">{unit}; metric clean {result.clean:.4f}, corrupted {result.corrupt:.4f}'
                        f"</p>{_html_table(matrix, rows, cols)}")
    if parts is not None:
        matrix = parts.values.reshape(-1, 1)
        sections.append(f'<h3 class="dla">direct logit attribution (logit difference {parts.logit_diff:.4f})</h3>'
                        f"{_html_table(matrix, list(parts.labels), ['adds'])}")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="Content-Security-Policy" '
            f"content=\"default-src 'none'; style-src 'unsafe-inline'\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h2>{html.escape(title)}</h2>{''.join(sections)}</body></html>")


def patch_html(results: Sequence[PatchResult], parts: LogitParts | None, tokens: Sequence[str], out: str | Path,
               title: str) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(patch_page(results, parts, tokens, title), encoding="utf-8")
    return out
