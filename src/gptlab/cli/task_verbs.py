"""`gptlab eval --task FILE.jsonl` (or a folder of them): a run judged on benchmark tasks (gptlab/tasks)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gptlab.cli.common import announce
from gptlab.errors import GptlabError


def add_task_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", action="append", metavar="FILE",
                   help="a task file (JSONL: multiple choice, HellaSwag's records, schema or language modelling) or "
                        "a folder of them, to score the run on instead of text; repeatable")
    p.add_argument("--limit", type=int, help="score only the first N items of each task file")
    p.add_argument("--num-fewshot", type=int, default=0,
                   help="worked examples from the same file before each item (never the item itself; default 0)")
    p.add_argument("--seed", type=int, default=1234, help="which few-shot examples are drawn (default 1234)")
    p.add_argument("--no-save", action="store_true", help="print the scores without writing them to RUN/evals/")
    p.add_argument("--lm-eval", metavar="TASKS",
                   help="run lm-evaluation-harness tasks (comma-separated names) on the run through gptlab's harness "
                        "model, with --limit and --num-fewshot; needs the eval extra (pip install 'gptlab[eval]')")
    p.add_argument("--lm-eval-include", metavar="FOLDER",
                   help="a folder of the harness's task YAML files to add to (or, with --lm-eval-only-include, "
                        "use instead of) its own tasks")
    p.add_argument("--lm-eval-only-include", action="store_true",
                   help="only the tasks under --lm-eval-include (faster: the harness's own are not indexed)")


def eval_harness(args: argparse.Namespace, run: str | Path) -> int:
    """lm-evaluation-harness's tasks on the run through the `gptlab` harness model; prints the harness's table."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError:
        raise GptlabError("--lm-eval needs lm-evaluation-harness: pip install 'gptlab[eval]' (or lm-eval)") from None
    from gptlab.tasks.harness import GptlabLM

    if args.limit is not None and args.limit < 1:
        raise GptlabError(f"--limit must be >= 1, not {args.limit}")
    manager = TaskManager(include_path=args.lm_eval_include, include_defaults=not args.lm_eval_only_include)
    names = [n.strip() for n in args.lm_eval.split(",") if n.strip()]
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise GptlabError(f"lm-evaluation-harness has no task {', '.join(unknown)}; see `lm-eval ls tasks` (or give "
                          "its folder with --lm-eval-include)")
    model = GptlabLM(run=run, precision=args.precision, device=args.device)
    announce(model)
    results = lm_eval.simple_evaluate(model=model, tasks=names, task_manager=manager, limit=args.limit,
                                      num_fewshot=args.num_fewshot or None, random_seed=args.seed,
                                      fewshot_random_seed=args.seed)  # the seed that draws the examples
    print(make_table(results))
    for name, counts in results["n-samples"].items():
        print(f"gptlab: {name}: {counts['effective']} of {counts['original']} items scored, precision "
              f"{model.precision}", file=sys.stderr)
    return 0


def task_files(names: list[str]) -> list[Path]:
    """The task files named: each file, and each folder's *.jsonl files in name order; GptlabError for a name that
    is neither, or a folder without any."""
    files: list[Path] = []
    for name in names:
        path = Path(name)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise GptlabError(f"task folder {path} holds no .jsonl files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise GptlabError(f"task file {path} does not exist")
    return files


def eval_tasks(args: argparse.Namespace, run: str | Path) -> int:
    """Score the run on every task file, print the table (or JSON), keep each result in RUN/evals/."""
    from tqdm import tqdm

    from gptlab.inference.loading import load_for_inference
    from gptlab.runtime import resolve_device
    from gptlab.tasks.items import read_task
    from gptlab.tasks.measure import evaluate_items
    from gptlab.tasks.report import file_sha256, result_path, save_result, table

    if args.limit is not None and args.limit < 1:
        raise GptlabError(f"--limit must be >= 1, not {args.limit}")
    if args.num_fewshot < 0:
        raise GptlabError(f"--num-fewshot must be >= 0, not {args.num_fewshot}")
    files = task_files(args.task)
    tasks = [(f, read_task(f)) for f in files]  # every file checked before the model is loaded
    ready = load_for_inference(run, resolve_device(args.device), args.precision, decode=False)
    announce(ready)
    rows, saved = [], []
    for path, items in tasks:
        total = min(len(items), args.limit or len(items))
        with tqdm(total=total, desc=path.name, unit="item", leave=False, disable=None) as bar:
            scores = evaluate_items(ready.model.model, ready.tokenizer, items, str(path), ready.precision,
                                    args.num_fewshot, args.seed, args.limit, bar.update)
        rows.append((str(path), scores))
        sha = file_sha256(path)
        header = {"run": str(run), "checkpoint": str(ready.checkpoint.path), "step": ready.checkpoint.step,
                  "task": str(path), "sha256": sha, "precision": ready.precision, "num_fewshot": args.num_fewshot,
                  "seed": args.seed, "limit": args.limit}
        if not args.no_save:
            out = result_path(run, path, sha, ready.checkpoint.step, ready.precision, args.num_fewshot, args.limit,
                              args.seed)
            save_result(out, header, scores)
            saved.append(out)
    if args.json:
        print(json.dumps([{"task": name, "kind": s.kind, "items": s.items, "cropped": s.cropped,
                           "measures": {k: vars(m) for k, m in s.measures.items()}} for name, s in rows], indent=2))
    else:
        print(table(rows))
    for name, s in rows:
        if s.cropped:
            print(f"gptlab: {name}: {s.cropped} item(s) had their context cut at the start to fit the model's "
                  "context", file=sys.stderr)
    for out in saved:
        print(f"gptlab: saved {out}", file=sys.stderr)
    return 0
