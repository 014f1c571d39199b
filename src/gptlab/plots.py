"""Pictures people would rather see than read: the loss curve of a run."""

from __future__ import annotations

import json
from pathlib import Path


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


def plot_loss(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path | None:
    """Train loss per logged step and the estimated train/val loss at each evaluation, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    if not steps and not evals:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    if steps:
        ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8, alpha=0.5, label="train (batch)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["train_loss"] for r in evals], "o-", label="train (estimate)")
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "s-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return Path(out_png)
