"""The README's ten-line tour, its chat lines run as written (issue 41: `--context 256` with char-quick, whose rows
hold 64 ids, had every conversation refused). The commands are read from the README's tour block: first the two
that leave the run `make run` leaves (`gptlab prepare`, `gptlab train`), then the three chat lines on a small
chats.jsonl in Tiny Shakespeare's characters; only the steps shrink (flags appended, which win) so that it takes
seconds. The chat guide shows the same three lines, word for word."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gptlab.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPTLAB = str(Path(sys.executable).parent / "gptlab")
SHRINK = {"train": ["--max-steps", "2", "--eval-batches", "1", "--quiet"], "prepare": ["--quiet"],
          "chat": ["--max-new-tokens", "4", "--seed", "1"]}
CHATS = [[{"role": "user", "content": "Who art thou, good friend?"}, {"role": "assistant", "content": f"I am {name}."},
          {"role": "user", "content": "What news from the court?"}, {"role": "assistant", "content": "None, my lord."}]
         for name in ("Romeo", "Juliet", "Hamlet", "Portia", "Viola", "Lear", "Puck", "Oberon", "Horatio", "Banquo")]
# each exchange fits in char-quick's 64 ids, a whole conversation does not: it is cut before its second question


CHAT_GUIDE = ROOT / "docs" / "guides" / "07-fine-tuning-and-chat.md"


def tour_commands(path: Path = ROOT / "README.md", after: str = "## A ten-line tour") -> list[list[str]]:
    """The gptlab commands of the first bash block after `after` in `path` (the README's tour), in order, comments
    dropped."""
    text = path.read_text(encoding="utf-8")
    start = text.index("```bash", text.index(after)) + len("```bash")
    block = text[start:text.index("```", start)]
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [words[1:] for words in commands if words and words[0] == "gptlab"]


def test_the_tour_s_chat_lines_run_as_written_on_the_run_make_run_leaves(tmp_path):
    commands = tour_commands()
    at = next(i for i, argv in enumerate(commands) if argv[:2] == ["prepare", "--chat"])
    chat_lines = commands[at:at + 3]
    assert [argv[0] for argv in chat_lines] == ["prepare", "train", "chat"] and ["prepare"] in commands and \
        ["train"] in commands, chat_lines
    chats = tmp_path / chat_lines[0][2]
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS), encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:  # in this process, from the tour's folder
        mp.chdir(tmp_path)
        for argv in (["prepare"], ["train"], *chat_lines[:2]):
            assert main([*argv, *SHRINK[argv[0]]]) == 0, argv
    proc = subprocess.run([GPTLAB, *chat_lines[2], *SHRINK["chat"]], cwd=tmp_path, capture_output=True, text=True,
                          input="Who art thou?\n", timeout=300)  # a terminal's stdin: piped
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "you> Who art thou?" in proc.stdout and "assistant>" in proc.stdout


def test_the_chat_guide_shows_the_tour_s_chat_lines_word_for_word():
    tour = tour_commands()
    at = next(i for i, argv in enumerate(tour) if argv[:2] == ["prepare", "--chat"])
    assert tour_commands(CHAT_GUIDE, "On the model `make run` leaves") == tour[at:at + 3]
