"""Task results for people and for files: the printed table, and the JSON kept in the run's evals/ folder (written
atomically; no run lock is taken, so a run can be judged while it trains)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gptlab.rundir import write_atomic
from gptlab.tasks.measure import TaskScores

EVALS = "evals"  # in a run folder


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def result_path(run: str | Path, task: str | Path, sha256: str, step: int, precision: str, num_fewshot: int,
                limit: int | None, seed: int) -> Path:
    """RUN/evals/TASK-SHA8-stepN-PRECISION[-Kshot-seedS][-limitL].json: one file per task file, its content, the
    checkpoint, the precision and the settings that change the score (the seed draws the few-shot examples)."""
    parts = [Path(task).stem, sha256[:8], f"step{step}", precision]
    parts += [f"{num_fewshot}shot", f"seed{seed}"] if num_fewshot else []
    parts += [f"limit{limit}"] if limit is not None else []
    return Path(run) / EVALS / ("-".join(parts) + ".json")


def save_result(path: Path, header: dict[str, Any], scores: TaskScores) -> None:
    """The header (run, checkpoint, task file and its sha256, precision, few-shot settings) and the scores, each
    measure with its interval and every item's log-likelihoods, as JSON at `path`, replaced atomically."""
    body = {**header, "kind": scores.kind, "items": scores.items, "cropped": scores.cropped,
            "seconds": round(scores.seconds, 3), "measures": {k: asdict(m) for k, m in scores.measures.items()},
            "per_item": scores.per_item}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(body, indent=1) + "\n").encode())


def table(rows: list[tuple[str, TaskScores]]) -> str:
    """One line per task and measure: value, bootstrap interval, items, items/s."""
    lines = [f"{'task':<32} {'kind':<18} {'measure':<15} {'value':>7} {'95% interval':>17} {'items':>6} "
             f"{'items/s':>8}"]
    for name, s in rows:
        for measure, m in s.measures.items():
            lines.append(f"{name[-32:]:<32} {s.kind:<18} {measure:<15} {m.value:>7.4f} "
                         f"{f'[{m.low:.4f}, {m.high:.4f}]':>17} {s.items:>6} {s.items / max(s.seconds, 1e-9):>8.1f}")
    return "\n".join(lines)
