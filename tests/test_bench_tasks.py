"""`gptlab bench eval` (bench/tasks.py): one tiny run; both contenders score the same items, so their acc agree."""

import json

from gptlab.bench.tasks import run_eval_bench, synthetic_items
from gptlab.cli import main


def test_the_bench_times_both_sides_on_the_same_items(capsys):
    report = run_eval_bench(items=6, shape="tiny", batch_sizes=(1, 3), as_json=True)
    printed = json.loads(capsys.readouterr().out)
    assert printed["speedup"] == report["speedup"] > 0 and printed["items"] == 6
    names = [row["contender"] for row in report["rows"]]
    assert names[0].startswith("gptlab eval --task") and names[1:] == [
        "lm-evaluation-harness hf model (fp32, batch 1)", "lm-evaluation-harness hf model (fp32, batch 3)"]
    assert len({row["acc"] for row in report["rows"]}) == 1  # the same choices picked: the same numbers
    fastest = min(row["seconds"] for row in report["rows"][1:])
    assert report["speedup"] == fastest / report["rows"][0]["seconds"]


def test_synthetic_items_are_hellaswag_shaped_and_seeded():
    items = synthetic_items(5)
    assert items == synthetic_items(5) and items != synthetic_items(5, seed=1)
    assert all(len(item.continuations) == 4 and 0 <= item.label < 4 for item in items)
    assert [item.line for item in items] == [1, 2, 3, 4, 5]


def test_bad_bench_flags_are_one_line(capsys):
    assert main(["bench", "eval", "--items", "0"]) == 2
    assert "--items must be >= 1, not 0" in capsys.readouterr().err
    assert main(["bench", "eval", "--batch-sizes", "4", "0"]) == 2
    assert "--batch-sizes must each be >= 1, not 0" in capsys.readouterr().err
