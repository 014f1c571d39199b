"""The docs hold together (issue 43's link checker): in README.md and every docs/**/*.md,

- every relative link and image (`[text](path)`, `[name]: path`) names a file or folder that exists, and every
  `#anchor` (`path.md#anchor`, or `#anchor` in the same file) is a heading of that file under GitHub's rule: the
  heading's text lowercased, punctuation dropped (letters, digits, `_`, `-` and spaces stay), each space a `-`,
  a repeated heading suffixed `-1`, `-2`, ...;
- every `gptlab ...` command in a shell code block (every line of a ```bash, ```sh or ```shell block; the `$ `
  lines of a ```console or bare ``` block, whose other lines are output; `\\` continuations joined, `&&`, `;` and
  `|` cutting a line into commands, a redirection ending one, `torchrun ... -m gptlab -- VERB` read as
  `gptlab VERB`) parses with the CLI's own parser (gptlab.cli.make_parser): parsed only, nothing
  runs. One rule skips a command: a shell placeholder in it (`[--flag ...]`, `...`, `…`, `<NAME>`), which
  PLACEHOLDER spells out.

Each check is also run on planted files (a broken link, a broken anchor, a bad flag), so that a checker that finds
nothing fails its own test."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from gptlab.errors import GptlabError

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(`{3,}|~{3,})[ \t]*([\w+-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
SHELL = {"bash", "sh", "shell"}  # every line a command; in TRANSCRIPT blocks only the `$ ` lines are
TRANSCRIPT = {"console", ""}
PROMPT = re.compile(r"^\s*\$\s+")
REDIRECT = re.compile(r"^\d*(?:>>?|<|&>)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)
INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
PLACEHOLDER = re.compile(r"\[--|\.\.\.|…|<[A-Za-z_]+>")  # `[--loss-chunk 256]`, `FILE ...`, `<RUN>`
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def docs(root: Path) -> list[Path]:
    """README.md and every Markdown file under docs/, in order."""
    return [p for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))] if p.is_file()]


def _blank(match: re.Match) -> str:
    """The match as spaces (its newlines kept), so that what is found after keeps its line number."""
    return re.sub(r"[^\n]", " ", match.group(0))


def prose(text: str) -> str:
    """`text` with its code blocks and inline code blanked: where links are looked for."""
    return INLINE_CODE.sub(_blank, FENCE.sub(_blank, text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text as rendered (links and images to their text, tags dropped), lowercased,
    every character but letters, digits, `_`, `-` and spaces dropped, each space made a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of a Markdown text: its headings' slugs (a repeated one suffixed -1, -2, ...), `<a id>`s."""
    seen: dict[str, int] = {}
    found = set(HTML_ANCHOR.findall(text))
    for _, heading in HEADING.findall(FENCE.sub(_blank, text)):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def broken_links(path: Path, root: Path) -> list[str]:
    """'FILE:LINE: TARGET (why)' for each relative link of `path` that names no file, or an anchor no heading has."""
    text = prose(path.read_text(encoding="utf-8"))
    out = []
    for match in [*LINK.finditer(text), *REFERENCE.finditer(text)]:
        target = match.group(1)
        if EXTERNAL.match(target):
            continue
        where = f"{path.relative_to(root).as_posix()}:{text.count(chr(10), 0, match.start()) + 1}: {target}"
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            out.append(f"{where} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text(encoding="utf-8")):
            out.append(f"{where} (no such heading)")
    return out


def commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, argv after `gptlab`) of every gptlab command in the shell code blocks of a Markdown text."""
    out = []
    for block in FENCE.finditer(text):
        kind = block.group(2).lower()
        if kind not in SHELL | TRANSCRIPT:
            continue
        first = text.count("\n", 0, block.start(3)) + 1
        lines = block.group(3).split("\n")
        at = 0
        while at < len(lines):
            line, start = lines[at], at
            while line.endswith("\\") and at + 1 < len(lines):
                at += 1
                line = line[:-1] + " " + lines[at]
            at += 1
            if kind in SHELL or PROMPT.match(line):
                out += [(first + start, argv) for argv in _gptlab_commands(line)]
    return out


def _gptlab_commands(line: str) -> list[list[str]]:
    """The gptlab commands of one shell line (a `$ ` prompt dropped; `&&`, `;`, `|` cut it; comments dropped; a
    redirection ends a command)."""
    line = PROMPT.sub("", line)
    out = []
    for part in re.split(r"&&|\|\|?|;", line):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:  # a quote opened in one part and closed in another: not a command of ours
            continue
        if PLACEHOLDER.search(" ".join(words)):
            continue
        words = words[:next((i for i, w in enumerate(words) if REDIRECT.match(w)), len(words))]
        if words[:1] == ["gptlab"]:
            out.append(words[1:])
        elif words[:1] == ["torchrun"] and "-m" in words and words[words.index("-m") + 1:][:1] == ["gptlab"]:
            rest = words[words.index("-m") + 2:]
            out.append(rest[1:] if rest[:1] == ["--"] else rest)
    return out


def refused(argv: list[str]) -> str | None:
    """Why the CLI's own parser refuses `argv` (the words after `gptlab`), or None where it parses."""
    from gptlab.cli import make_parser

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # what --help and --version print
            make_parser().parse_args(argv)
    except GptlabError as exc:
        return str(exc)
    except SystemExit as exc:  # --help and --version print and exit 0
        return None if exc.code in (0, None) else f"exit {exc.code}"
    return None


def bad_commands(path: Path, root: Path) -> list[str]:
    """'FILE:LINE: gptlab ARGS (why)' for each command of `path`'s shell blocks that the CLI refuses."""
    out = []
    for line, argv in commands(path.read_text(encoding="utf-8")):
        why = refused(argv)
        if why is not None:
            out.append(f"{path.relative_to(root).as_posix()}:{line}: gptlab {shlex.join(argv)} ({why})")
    return out


# ---- the docs as they are ----------------------------------------------------------------------------------------

def test_every_relative_link_and_anchor_in_the_docs_resolves():
    assert [problem for path in docs(ROOT) for problem in broken_links(path, ROOT)] == []


def test_every_gptlab_command_in_the_docs_shell_blocks_parses_with_the_cli():
    found = [(path, argv) for path in docs(ROOT) for _, argv in commands(path.read_text(encoding="utf-8"))]
    assert len(found) > 50 and {argv[0] for _, argv in found} >= {"prepare", "train", "sample", "eval", "serve",
                                                                   "chat", "inspect", "bench", "import", "export"}
    assert [problem for path in docs(ROOT) for problem in bad_commands(path, ROOT)] == []


# ---- the checker, on planted files -------------------------------------------------------------------------------

@pytest.mark.parametrize("heading, anchor", [
    ("## Quick start", "quick-start"),
    ("## `gptlab eval --task`", "gptlab-eval---task"),
    ("### AMD EPYC Zen 4 (EPYC-A): this CPU's build", "amd-epyc-zen-4-epyc-a-this-cpus-build"),
    ("## Looking inside: attention, the logit lens", "looking-inside-attention-the-logit-lens"),
    ("## Serve [the API](../x.md) & more", "serve-the-api--more"),
    ("## snake_case stays, CamelCase lowers", "snake_case-stays-camelcase-lowers"),
])
def test_anchors_follow_github_s_rule(heading, anchor):
    assert slug(heading.lstrip("# ")) == anchor


def test_a_repeated_heading_gets_a_numbered_anchor_and_code_is_no_heading():
    text = "# Top\n## Notes\n```bash\n# a comment, not a heading\n```\n## Notes\n## Notes\n"
    assert anchors(text) == {"top", "notes", "notes-1", "notes-2"}


def plant(root: Path, guide: str) -> Path:
    """A README linking to one guide, `guide` the guide's text; the guide's path."""
    (root / "docs" / "guides").mkdir(parents=True)
    (root / "docs" / "images").mkdir()
    (root / "docs" / "images" / "a.png").write_bytes(b"")
    (root / "README.md").write_text("# R\n\n[the guide](docs/guides/one.md#first-steps), ![a](docs/images/a.png)\n")
    path = root / "docs" / "guides" / "one.md"
    path.write_text(guide, encoding="utf-8")
    return path


GOOD = """# One

## First steps

Back to [the README](../../README.md#r), [below](#first-steps), [a picture](../images/a.png),
[the source](../../README.md), `[not a link](nowhere.md)`, [the web](https://example.com/x.md#y).

```bash
gptlab train --preset char-small --max-steps 20    # a comment
gptlab sample --prompt "ROMEO:" \\
    --precision int8 && gptlab runs | head
torchrun --nproc_per_node=2 -m gptlab -- train --preset char-small
gptlab bench train --preset finetune [--loss-chunk 256]
```

```
$ gptlab chat --run runs/chat --temperature 0 > transcript.txt
gptlab: using runs/chat/checkpoints/best-00002000 (an output line)
```

```python
gptlab = "train --no-such-flag"
```
[ref]: ../images/a.png
"""


def test_the_checker_passes_good_files_and_finds_their_commands(tmp_path):
    guide = plant(tmp_path, GOOD)
    assert [broken_links(p, tmp_path) for p in docs(tmp_path)] == [[], []]
    assert bad_commands(guide, tmp_path) == []
    assert commands(GOOD) == [(9, ["train", "--preset", "char-small", "--max-steps", "20"]),
                              (10, ["sample", "--prompt", "ROMEO:", "--precision", "int8"]), (10, ["runs"]),
                              (12, ["train", "--preset", "char-small"]),  # the placeholder line is skipped
                              (17, ["chat", "--run", "runs/chat", "--temperature", "0"])]  # output is no command


def test_the_checker_fails_on_a_broken_link_a_broken_anchor_and_a_bad_flag(tmp_path):
    guide = plant(tmp_path, GOOD.replace("../images/a.png)", "../images/b.png)")
                 .replace("README.md#r)", "README.md#quick-start)").replace("(#first-steps)", "(#first-step)")
                 .replace("--max-steps 20", "--max-stepz 20").replace("--precision int8", "--precision int4"))
    (tmp_path / "README.md").write_text("# R\n\n[gone](docs/guides/two.md) [anchor](docs/guides/one.md#one)\n")
    assert [broken_links(p, tmp_path) for p in docs(tmp_path)] == [
        ["README.md:3: docs/guides/two.md (no such file)"],
        ["docs/guides/one.md:5: ../../README.md#quick-start (no such heading)",
         "docs/guides/one.md:5: #first-step (no such heading)", "docs/guides/one.md:5: ../images/b.png (no such file)"]]
    bad = bad_commands(guide, tmp_path)
    assert [b.split(" (")[0] for b in bad] == [
        "docs/guides/one.md:9: gptlab train --preset char-small --max-stepz 20",
        "docs/guides/one.md:10: gptlab sample --prompt ROMEO: --precision int4"], bad
    assert "--max-stepz" in bad[0] and "int4" in bad[1]


def test_the_placeholder_rule_is_the_only_skip():
    assert _gptlab_commands("gptlab export RUN --format hf --out DIR") == [["export", "RUN", "--format", "hf",
                                                                            "--out", "DIR"]]
    for line in ("gptlab eval --task FILE ...", "gptlab sample --run <RUN>", "gptlab train [--fsdp]",
                 "gptlab prepare a.txt …"):
        assert _gptlab_commands(line) == [], line
    assert refused(["export", "RUN", "--format", "hf", "--out", "DIR"]) is None
    assert refused(["train", "--no-such-flag"]) is not None
