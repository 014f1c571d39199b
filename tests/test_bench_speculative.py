"""`gptlab bench speculative` (gptlab.bench.speculative): its prompts, its arithmetic worked out by hand, and a run
end to end on a tiny trained run (the same tokens with speculation and without, checked by the bench itself)."""

import random
import re

import pytest
from helpers import run_bad, tiny_run

from gptlab.bench.speculative import Decoded, passages, prompt_text, run_speculative, summary

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "64", "--batch-size", "4",
        "--eval-interval", "5", "--eval-batches", "2", "--log-interval", "5", "--precision", "fp32", "--quiet"]
TEXT = "\n".join(f"line {i} of the text with words to change" for i in range(40))


def test_passages_are_whole_lines_drawn_with_the_seed():
    got = passages(TEXT, 3, 4, seed=5)
    assert got == passages(TEXT, 3, 4, seed=5) and got != passages(TEXT, 3, 4, seed=6)
    assert all(len(p.splitlines()) == 4 and p in TEXT for p in got)


def test_each_task_prompts_as_its_name_says():
    passage = "one two three four five six\nseven eight"
    assert prompt_text("repeat", passage, random.Random(0)) == passage + "\n\nOnce more:\none two three four five six\n"
    edit = prompt_text("edit", passage, random.Random(0))
    head, _, tail = edit.partition("\n\nThe same, one word changed:\n")
    assert head == passage and tail.endswith("and") and passage.startswith(tail[:-len("and")])
    assert prompt_text("open", passage, random.Random(0)) == passage + "\n"


def test_the_summary_is_worked_out_by_hand():
    off = Decoded(tokens=100, seconds=4.0)  # 25 tokens/s
    auto = Decoded(tokens=100, seconds=2.0, proposed=80, kept=60)  # 50 tokens/s; 100 tokens in 40 steps
    row, line = summary("repeat", off, auto, floor=200.0)
    assert line == ("repeat: 2.00x (50.0 vs 25.0 tokens/s; 75% of 80 proposed tokens kept; 2.50 tokens a step; "
                    "0.25x the floor)")
    assert row.split() == ["repeat", "25.0", "50.0", "2.00x", "75%", "2.50", "200.0", "0.25x"]
    assert "0% of 0" in summary("open", off, Decoded(tokens=100, seconds=5.0), 200.0)[1]  # nothing proposed
    assert "nanx" in summary("open", Decoded(), auto, 200.0)[1]  # no rate to compare with


@pytest.mark.device_path("fused decode (native)")
def test_a_run_is_benched_end_to_end(tmp_path, capsys, fused_kernel):
    run = tiny_run(tmp_path, 10, TINY)
    lines = run_speculative(run=str(run), precision="fp32", prompts=2, new_tokens=12)
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in lines] == ["repeat", "edit", "open", "predicted"]
    assert "100% of" in lines[3]  # the true answer predicted: every proposed token kept
    assert "batch 1, 2 prompts a task" in out and int(re.search(r"of (\d+) proposed", lines[0]).group(1)) > 0 and "12 new tokens each" in out and "auto/floor" in out


def test_new_tokens_must_leave_room_for_a_prompt(tmp_path, capsys):
    run = tiny_run(tmp_path, 2, TINY)  # a context of 64
    assert "leaves no room for a prompt" in run_bad(capsys, "bench", "speculative", "--run", str(run),
                                                     "--new-tokens", "49", "--precision", "fp32")
    assert "--prompts must be >= 1" in run_bad(capsys, "bench", "speculative", "--prompts", "0")
