"""The chat walk-through of docs/guides/07-fine-tuning-and-chat.md, run as written on a small file in the same
format (SmolTalk's everyday conversations: OpenAI messages plus a topic field) over a tiny random GPT-2 instead of the
real one: its commands are read from the guide's code block, and only the steps and batch shrink (flags appended,
which win) so that it takes seconds. What it must show: each command succeeds, the run is a LoRA run on the imported
GPT-2 whose tokenizer has the chat template, and `gptlab chat` answers a turn."""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import hf_folder

from gptlab.checkpoint import load_run
from gptlab.cli import main
from gptlab.tokenizer import ChatTokenizer

ROOT = Path(__file__).resolve().parents[1]
GPTLAB = str(Path(sys.executable).parent / "gptlab")
SHRINK = {"train": ["--max-steps", "2", "--batch-size", "2", "--block-size", "128", "--grad-accum", "1", "--eval-interval", "2",
                    "--eval-batches", "1", "--precision", "fp32", "--quiet"],
          "prepare": ["--quiet"], "chat": ["--max-new-tokens", "6", "--seed", "3"]}


def walkthrough_commands() -> list[list[str]]:
    """The gptlab commands of the chat guide's walk-through block, continuation lines joined."""
    guide = (ROOT / "docs" / "guides" / "07-fine-tuning-and-chat.md").read_text(encoding="utf-8")
    start = guide.index("### A walk-through on real data")
    block = guide[guide.index("```bash", start) + 7:guide.index("```", guide.index("```bash", start) + 7)]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            words = shlex.split(part.strip())
            if words and words[0] == "gptlab":
                commands.append(words[1:])
    return commands


def test_the_readme_walk_through_runs_on_a_small_file_in_the_same_format(tmp_path):
    commands = walkthrough_commands()
    assert [c[0] for c in commands] == ["import", "prepare", "train", "chat"]
    hf_folder(tmp_path / "gpt2", seed=5, vocab_size=50257, n_embd=32, n_head=2, n_layer=2, n_positions=512)
    shutil.copy(ROOT / "tests" / "data" / "everyday-sample.jsonl", tmp_path / "everyday.jsonl")
    with pytest.MonkeyPatch.context() as mp:  # in this process, from the walk-through's folder
        mp.chdir(tmp_path)
        for argv in commands[:-1]:
            assert main([*argv, *SHRINK.get(argv[0], [])]) == 0, argv
    run = tmp_path / "runs" / "everyday"
    loaded = load_run(run)
    assert isinstance(loaded.tokenizer, ChatTokenizer) and loaded.model_cfg.vocab_size == 50257 + 4
    assert loaded.state.base and Path(loaded.state.base["run"]) == (tmp_path / "runs" / "gpt2").resolve()
    chat = commands[-1]
    proc = subprocess.run([GPTLAB, *chat, *SHRINK["chat"]], cwd=tmp_path, capture_output=True, text=True,
                          input="What's the capital of Japan?\n", timeout=300)  # a terminal's stdin: piped
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"assistant> .*", proc.stdout) and "Japan" in proc.stdout  # the turn, echoed, and its answer
