"""The pictures made from a trace: attention maps (a layer × head grid or one map), the logit lens (a table for
the terminal and a heatmap) and the contextual-embedding experiment (similarity against depth, PCA per layer).
matplotlib is imported when a picture is drawn (plots.pyplot, the Agg backend): nothing here needs a display."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from gptlab.inspect.trace import Trace, pairwise_cosine, token_label
from gptlab.plots import drawable, pyplot


def save_png(fig, out: str | Path) -> Path:
    """The figure written to `out` (its folder made), closed; returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    pyplot().close(fig)
    return out


def _label_axes(ax, labels: Sequence[str], x: bool, y: bool, size: float) -> None:
    ticks, labels = range(len(labels)), [drawable(label) for label in labels]
    ax.set_xticks(ticks, labels if x else [""] * len(labels), rotation=90, fontsize=size)
    ax.set_yticks(ticks, labels if y else [""] * len(labels), fontsize=size)
    ax.tick_params(length=0)


def panels(tr: Trace, layer: int | None, head: int | None) -> tuple[list[int], list[int]]:
    """The layers (rows) and heads (columns) of an attention picture: all, or the one given."""
    return (list(range(tr.n_layer)) if layer is None else [layer],
            list(range(tr.attention[0].size(1))) if head is None else [head])


def attention_png(tr: Trace, labels: Sequence[str], out: str | Path, layer: int | None = None,
                  head: int | None = None) -> Path:
    """Attention maps of the first row of the trace, query on the y axis, key on the x axis, as a PNG: every
    layer × head, or one layer's heads (layer), one head across layers (head), or one map at full size (both).
    Layers and heads count from 0. Returns the path."""
    plt = pyplot()
    layers, heads = panels(tr, layer, head)
    T = tr.ids.size(1)
    cell = 6.0 if len(layers) * len(heads) == 1 else max(2.0, min(4.5, 0.11 * T))
    fig, axes = plt.subplots(len(layers), len(heads), figsize=(cell * len(heads) + 1, cell * len(layers) + 0.6),
                             squeeze=False)
    size = max(3.0, min(9.0, 0.75 * 72 * cell / T))  # a tick label no taller than its row
    for r, lyr in enumerate(layers):
        for c, hd in enumerate(heads):
            ax = axes[r][c]
            ax.imshow(tr.attention[lyr][0, hd].float().numpy(), cmap="viridis", vmin=0, vmax=1,
                      interpolation="nearest")
            ax.set_title(f"layer {lyr} head {hd}", fontsize=9)
            _label_axes(ax, labels, x=r == len(layers) - 1, y=c == 0, size=size)
    fig.suptitle("attention: row = query token, column = key token it reads (colour = probability)", fontsize=10, y=1.0)
    fig.tight_layout()
    return save_png(fig, out)


def lens_top(lens: torch.Tensor, top: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Top `top` next-token probabilities and ids at every depth and position of row 0: (depths, T, top) each."""
    probs = torch.softmax(lens[:, 0].float(), dim=-1)  # (depths, T, V)
    return probs.topk(top, dim=-1)


def lens_table(lens: torch.Tensor, tokenizer, ids: Sequence[int], top: int = 1) -> str:
    """The logit lens as text: one line per position (the token read there), one column per depth (emb, then
    after each block h.0, h.1, ...), each cell the `top` most likely next tokens with their probabilities."""
    values, indices = lens_top(lens, top)
    depths = ["emb"] + [f"h.{i}" for i in range(lens.size(0) - 1)]
    rows = [["pos", "token"] + depths]
    for t, token in enumerate(ids):
        cells = [" ".join(f"{token_label(tokenizer, int(i))} {p:.2f}" for p, i in zip(values[d, t].tolist(),
                                                                                     indices[d, t].tolist()))
                 for d in range(len(depths))]
        rows.append([str(t), token_label(tokenizer, int(token))] + cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def lens_png(lens: torch.Tensor, labels: Sequence[str], tokenizer, out: str | Path) -> Path:
    """Heatmap of the probability, at every depth (rows) and position (columns), of the token the model finally
    predicts there; each cell is written with the lens's own top-1 token at that depth."""
    plt = pyplot()
    probs = torch.softmax(lens[:, 0].float(), dim=-1)  # (depths, T, V)
    final = probs[-1].argmax(-1)  # (T,): the model's prediction at each position
    p_final = probs.gather(-1, final.expand(probs.size(0), -1)[..., None])[..., 0]  # (depths, T)
    top = probs.argmax(-1)  # (depths, T)
    D, T = p_final.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.42 * T + 2), 0.55 * D + 1.8))
    image = ax.imshow(p_final.numpy(), cmap="magma", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    for d in range(D):
        for t in range(T):
            ax.text(t, d, drawable(token_label(tokenizer, int(top[d, t]))), ha="center", va="center", fontsize=7,
                    color="black" if p_final[d, t] > 0.6 else "white")
    ax.set_xticks(range(T), [drawable(label) for label in labels], fontsize=8)
    ax.set_yticks(range(D), ["emb"] + [f"after h.{i}" for i in range(D - 1)], fontsize=8)
    ax.set_xlabel("input token (each column predicts the token after it)")
    fig.colorbar(image, ax=ax, fraction=0.03, label="probability of the final prediction")
    ax.set_title("logit lens: ln_f + lm_head on the residual stream after each block (text: top-1 at that depth)",
                 fontsize=10)
    return save_png(fig, out)


def depth_names(n_layer: int) -> list[str]:
    return ["static", "tok+pos"] + [f"h.{i}" for i in range(n_layer)]


def pca_2d(x: torch.Tensor) -> torch.Tensor:
    """(N, C) -> (N, 2): the points on their first two principal components (0 where fewer exist)."""
    centred = x.float() - x.float().mean(0)
    u, s, _ = torch.linalg.svd(centred, full_matrices=False)
    coords = u * s  # (N, min(N, C))
    return torch.nn.functional.pad(coords, (0, max(0, 2 - coords.size(1))))[:, :2]


def embeddings_png(reps: torch.Tensor, word: str, contexts: Sequence[str], out: str | Path) -> Path:
    """The contextual-embedding experiment: cosine similarity of the word's vectors between each pair of contexts
    at every depth (top), and the vectors projected on their first two principal components per depth (bottom)."""
    plt = pyplot()
    sims = pairwise_cosine(reps)
    D, N = reps.size(0), reps.size(1)
    names = depth_names(D - 2)
    fig = plt.figure(figsize=(max(9.0, 2.0 * D), 7.5))
    grid = fig.add_gridspec(2, D, height_ratios=[1.4, 1])
    half = max(1, D // 2)
    whole, zoom = fig.add_subplot(grid[0, :half]), fig.add_subplot(grid[0, half:])
    for ax, first in ((whole, 0), (zoom, 2)):  # every depth; the blocks alone, on their own scale
        for i in range(N):
            for j in range(i + 1, N):
                ax.plot(range(first, D), sims[first:, i, j].numpy(), marker="o", label=f"context {i + 1} vs {j + 1}")
        ax.set_xticks(range(first, D), names[first:], fontsize=8)
        ax.grid(alpha=0.3)
    whole.set_ylabel("cosine similarity")
    whole.set_title(drawable(f"{word!r} in {N} contexts: one static vector, then contextual ones"), fontsize=10)
    zoom.set_title("after each block, zoomed in", fontsize=10)
    zoom.legend(fontsize=7, loc="lower left")
    colours = plt.get_cmap("tab10")
    for d in range(D):
        sub = fig.add_subplot(grid[1, d])
        xy = pca_2d(reps[d])
        for n in range(N):
            sub.scatter(xy[n, 0], xy[n, 1], color=colours(n % 10), s=30)
            sub.annotate(str(n + 1), (float(xy[n, 0]), float(xy[n, 1])), fontsize=8)
        sub.set_title(names[d], fontsize=8)
        sub.set_xticks([])
        sub.set_yticks([])
    legend = "\n".join(f"{n + 1}: {c[:70]!r}" for n, c in enumerate(contexts[:10]))
    fig.text(0.01, -0.02, "PCA per depth; contexts\n" + drawable(legend), fontsize=7, va="top")
    return save_png(fig, out)


def similarity_table(reps: torch.Tensor) -> str:
    """Cosine similarity per depth (rows) for each pair of contexts (columns), as text."""
    sims = pairwise_cosine(reps)
    N = reps.size(1)
    pairs = [(i, j) for i in range(N) for j in range(i + 1, N)]
    names = depth_names(reps.size(0) - 2)
    head = f"{'depth':<9}" + "".join(f"{f'{i + 1} vs {j + 1}':>10}" for i, j in pairs)
    lines = [head, "-" * len(head)]
    for d, name in enumerate(names):
        lines.append(f"{name:<9}" + "".join(f"{sims[d, i, j].item():>10.4f}" for i, j in pairs))
    return "\n".join(lines)
