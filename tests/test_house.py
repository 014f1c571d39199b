"""The house rules of docs/design.md, checked over the whole package, the README and the guides:

- no measured figure (a time, a rate, a share, a speed-up, a loss value, a before -> after history, an issue number)
  in src/, README.md or docs/guides/*.md outside a link to docs/benchmarks.md: figures live in docs/benchmarks.md
  only, with their command, machine and date, so that no copy of one can drift;
- the README is one page: at most MAX_README_LINES lines (the rest is guides in docs/guides/);
- no Python module of more than MAX_MODULE_LINES lines, no function of more than MAX_FUNCTION_LINES (the C++
  kernel is not Python, and is not walked);
- no public name defined at the top of two modules (one name, one meaning), but for the few listed in SAME_MEANING.
- what test files share lives in tests/helpers.py: no test file imports conftest.py or another test file.

Each scanner is also run on planted examples, so that a scanner that finds nothing fails its own test.
"""

import ast
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gptlab"

# ---- measured figures ------------------------------------------------------------------------------------------

NUMBER = r"(?<![\w.])\d(?:[\d,]*\d)?(?:\.\d+)?"  # 12, 1,513, 9.4; not inside a name or another number
FIGURES = {  # what counts as a measured figure, by kind (at one place, the first kind that matches)
    "a history": rf"{NUMBER}\s?[^\s\d]{{0,5}}\s?(?:->|→)\s?{NUMBER}",
    "a time": rf"{NUMBER}\s?(?:ms|µs|ns)\b|{NUMBER}\s(?:s|secs?|seconds?|mins?|minutes?|hours?)\b"
              r"|(?<![\w.])\d+\.\d+s\b"  # 894.80s, as pytest prints it (a whole 429s or 1s is a plural)
              r"|(?<![\w.])\d+m\d+(?:\.\d+)?s\b"  # 1m55.418s, as time(1) prints it
              r"|(?<![\w.:])\d{1,2}:\d{2}:\d{2}(?![\w:])",  # 0:14:54
    "a rate": rf"{NUMBER}\s?(?:[kKM]\s?)?(?:tokens/s|tok/s|items/s|req(?:uest)?s/s|tokens\s+(?:per|a)\s+second\b)"
              rf"|{NUMBER}\s?(?:[kMGT]i?B/s|it/s|steps/s|[GT]?FLOP/?s|[GT]FLOPS)",
    "a share": rf"{NUMBER}\s?%|\b(?:tens|dozens)\s+of\s+percent\b",
    "a speed-up": rf"{NUMBER}\s?(?:x|×|times)\s+(?:faster|slower|quicker|fewer|less|more|smaller|larger)\b"
                  rf"|{NUMBER}(?:x|×)(?!\w)",  # 4.53x, 2×: a ratio read off a run (a size is written 6 x 384)
    "a loss value": rf"\bloss(?:es)?\s+(?:(?:of|at|near|about|around|below|under)\s+|[<>~≈=]\s*)?{NUMBER}",
    "a score": rf"\b(?:perplexity|accuracy|acc(?:_norm)?|mfu|kl\s+divergence|kld)\s+"
               rf"(?:(?:of|at|near|about|around|below|under)\s+|[<>~≈=:]\s*)?{NUMBER}",
    "an issue number": r"\bissues?\s+#?\d+",
    "a duration in words": r"\b(?:under|within|about|in)\s+(?:a\s+few|a|one)\s+(?:seconds?|minutes?|hours?)\b"
                           r"|\ba\s+few\s+(?:seconds|minutes|hours)\b|\bwithin\s+(?:seconds|minutes|hours)\b",
}
# README prose only (src/ is full of settings written this way): a number read off a run, like 0.93 or 1.836
README_READING = r"(?<![\w.])\d+\.\d{2,}\b"
FIGURE = re.compile("|".join(f"(?P<k{i}>{pattern})" for i, pattern in enumerate(FIGURES.values())), re.IGNORECASE)
KINDS = list(FIGURES)

# settings and tolerances that read like figures, each with what it is
ALLOWED = [
    r"every 10 s",  # README: the plain progress line's interval (PLAIN_LINE_SECONDS), a setting
    r"10 s for in-flight requests",  # serve/api.py: --grace's default
    r"\(1/5/15 min\)",  # the load average's three windows
    r"at most 0\.55 of one process's bytes",  # README: FSDP's bound on 2 processes, tests/test_distributed.py
    r"(?:width|height):\s*\d+%|hsl\([^)]*\)|,\d+%,\d+%\)",  # playground.html: CSS lengths, hsl() colours
    r"Python ≥ \d+\.\d+",  # README: the Python version required
]
BENCHMARKS_LINK = r"\[[^\]]*\]\((?:docs/|\.\./)benchmarks\.md[^)]*\)"  # a figure may sit in the text of a link to them
FORMAT_SPEC = r"\{[^{}\n]*:[^{}\n]*\}"  # an f-string's {value:.0%} prints a figure, it holds none
CODE = r"```.*?```|`[^`]+`"  # README code, where no reading of a run is looked for


def _blank(match: re.Match) -> str:
    """The match as spaces (its newlines kept), so that what is found keeps its line number."""
    return re.sub(r"[^\n]", " ", match.group(0))


def figures(text: str, readings: bool = False) -> list[tuple[int, str, str]]:
    """(line, kind, text) of each measured figure in `text`; `readings`: README prose, where a number with two
    or more decimals outside code counts too."""
    for pattern in (BENCHMARKS_LINK, FORMAT_SPEC, *ALLOWED):
        text = re.sub(pattern, _blank, text, flags=re.DOTALL)
    found = [(m, KINDS[int(m.lastgroup[1:])]) for m in FIGURE.finditer(text)]
    if readings:
        prose = re.sub(CODE, _blank, text, flags=re.DOTALL)
        found += [(m, "a reading") for m in re.finditer(README_READING, prose)]
    return sorted((text.count("\n", 0, m.start()) + 1, kind, m.group(0)) for m, kind in found)


def measured_figures(root: Path) -> list[str]:
    """Every measured figure in `root`'s README.md, its guides (docs/guides/*.md) and the text files under its
    src/gptlab, as FILE:LINE; in the Markdown files' prose a reading counts too."""
    files = [p for p in sorted((root / "src" / "gptlab").rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".gz", ".pyc", ".so")]
    out = []
    for path in [root / "README.md", *sorted((root / "docs" / "guides").glob("*.md")), *files]:
        for line, kind, text in figures(path.read_text(encoding="utf-8"), readings=path.suffix == ".md"):
            out.append(f"{path.relative_to(root)}:{line}: {kind}: {text!r}")
    return out


def test_no_measured_figure_in_the_code_the_help_texts_or_the_readme():
    assert (ROOT / "docs" / "guides").is_dir() and measured_figures(ROOT) == []


PLANTED = [  # (text, the kind found in it)
    ("# a step takes 9.4 ms here", "a time"),
    ("decodes in 2.41 ms/step", "a time"),
    ("training took 17.7 s", "a time"),
    ("2503 passed in 894.80s", "a time"),
    ("real\t1m55.418s", "a time"),
    ("the suite took 0:14:54 on 2 cores", "a time"),
    ("prepare reads 12,345 tokens/s", "a rate"),
    ("memory read 52.9 GB/s now", "a rate"),
    ("the recipe's rate, 25.4k tokens/s", "a rate"),
    ("eval scores 6.60 items/s", "a rate"),
    ("it decodes 200 tokens per second", "a rate"),
    ("96% of the bandwidth floor", "a share"),
    ("the bandwidth drifts by tens of percent", "a share"),
    ('"4x faster than transformers"', "a speed-up"),
    ("int8 is 2 times faster", "a speed-up"),
    ("bf16 products run 4.53x fp32's", "a speed-up"),
    ("(2× the bf16 step)", "a speed-up"),
    ("to a validation loss of 1.836", "a loss value"),
    ("(val loss ~2.5)", "a loss value"),
    ("reach val loss < 1.88", "a loss value"),
    ("validation perplexity 6.354", "a score"),
    ("MFU 53.5 of the bf16 peak", "a score"),
    ("an accuracy of 0.75 on the task", "a score"),
    ("the step 1513 -> 1361 ms", "a history"),
    ("bf16 10.4 → 9.4", "a history"),
    ("with the changes of issue 16:", "an issue number"),
    ("on Tiny Shakespeare in under a minute", "a duration in words"),
    ("the suite (offline, a few minutes on 2 cores)", "a duration in words"),
    ("the read bandwidth drifts within seconds", "a duration in words"),
]
NOT_FIGURES = [
    "training prints a plain progress line at most every 10 s instead",  # allowed: a setting
    "logits within 1e-5 of the reference",  # a tolerance
    'print(f"{share:.0%} of the floor, {seconds:.1f} s")',  # format specs, then a unit alone
    "the timings: [bench decode, 9.4 ms](docs/benchmarks.md#gptlab-bench-decode)",  # inside a link to them
    "GPT-2s imported into gptlab, 429s from a small queue",  # a model's plural, a status code's
    "def read_bandwidth(megabytes: int = 512, seconds: float = 1.0)",  # defaults
    "--max-tokens 512, --max-batch 16, --queue 64",
    "several times slower than one",  # words
    "a (16 x K) block, 4x4 tiles, a 0x1f mask, struct '<8sIIQ8x', f\"{ratio:.2f}x\"",  # sizes, hex, formats
    "429s from a small queue, the mask's 1s, --timeout in seconds, at 09:26 UTC",  # plurals, a unit, a clock
]


@pytest.mark.parametrize("text, kind", PLANTED)
def test_each_kind_of_figure_is_found_on_its_line(text, kind):
    assert [(line, found) for line, found, _ in figures(f"first line\n\n{text}\n")] == [(3, kind)]


@pytest.mark.parametrize("text", NOT_FIGURES)
def test_settings_tolerances_format_specs_and_links_to_the_figures_are_not_figures(text):
    assert figures(text, readings=True) == []


def test_a_reading_counts_in_readme_prose_but_not_in_its_code_or_in_the_source():
    text = "after `wha` the lens gives `t` 0.93\n```\ngptlab sample --top-p 0.95\n```\n`torch==2.13.0`\n"
    assert figures(text, readings=True) == [(1, "a reading", "0.93")]
    assert figures(text) == []  # src/: init std 0.02, beta2 0.95 are settings


def test_a_figure_planted_in_the_readme_a_guide_or_a_module_is_found(tmp_path):
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs" / "guides", tmp_path / "docs" / "guides")
    shutil.copytree(PACKAGE, tmp_path / "src" / "gptlab", ignore=shutil.ignore_patterns("__pycache__"))
    assert measured_figures(tmp_path) == []
    guide = sorted((ROOT / "docs" / "guides").glob("*.md"))[-1]
    with open(tmp_path / "README.md", "a", encoding="utf-8") as f:
        f.write("\nThe fused step decodes at 415.7 tokens/s.\n")
    with open(tmp_path / "docs" / "guides" / guide.name, "a", encoding="utf-8") as f:
        f.write("\nThe naive step reaches a loss of 1.84 ([the bench](../benchmarks.md)).\n")
    with open(tmp_path / "src" / "gptlab" / "sampling.py", "a", encoding="utf-8") as f:
        f.write("# measured: 1.2 ms -> 0.9 ms\n")
    readme_lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    guide_lines = len(guide.read_text(encoding="utf-8").splitlines())
    sampling_lines = len((PACKAGE / "sampling.py").read_text(encoding="utf-8").splitlines())
    assert measured_figures(tmp_path) == [
        f"README.md:{readme_lines + 2}: a rate: '415.7 tokens/s'",
        f"docs/guides/{guide.name}:{guide_lines + 2}: a loss value: 'loss of 1.84'",
        f"docs/guides/{guide.name}:{guide_lines + 2}: a reading: '1.84'",
        f"src/gptlab/sampling.py:{sampling_lines + 1}: a history: '1.2 ms -> 0.9'"]


# ---- the README is one page --------------------------------------------------------------------------------------

MAX_README_LINES = 200  # every line: what it is, the two commands, a tour, a picture, the table of guides


def too_long(readme: Path) -> str | None:
    """'README.md: N lines' when `readme` is longer than MAX_README_LINES, else None."""
    lines = len(readme.read_text(encoding="utf-8").splitlines())
    return f"{readme.name}: {lines} lines (at most {MAX_README_LINES}; the rest is a guide)" \
        if lines > MAX_README_LINES else None


def test_the_readme_is_one_page():
    assert too_long(ROOT / "README.md") is None


def test_a_readme_one_line_too_long_is_found_at_the_boundary(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("line\n" * MAX_README_LINES, encoding="utf-8")
    assert too_long(readme) is None
    readme.write_text("line\n" * (MAX_README_LINES + 1), encoding="utf-8")
    assert too_long(readme) == "README.md: 201 lines (at most 200; the rest is a guide)"


# ---- sizes -------------------------------------------------------------------------------------------------------

MAX_MODULE_LINES = 400  # every line of the file, blank lines, comments and docstrings included
MAX_FUNCTION_LINES = 50  # from its `def` line to its last line, docstring and nested functions included


def oversized(package: Path) -> list[str]:
    """Every module under `package` longer than MAX_MODULE_LINES and every function longer than
    MAX_FUNCTION_LINES, as 'PATH: N lines' / 'PATH:LINE NAME: N lines'."""
    out = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(package).as_posix()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            out.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return out


def test_no_module_over_400_lines_and_no_function_over_50():
    assert oversized(PACKAGE) == []


def test_the_size_limits_are_found_at_their_boundaries(tmp_path):
    def function(name: str, lines: int) -> str:  # `def` + a docstring + lines - 2 statements
        return f"def {name}():\n    '''doc'''\n" + "    x = 1\n" * (lines - 2)

    (tmp_path / "fits.py").write_text(function("fifty", 50) + "\n" * 350)  # 50 + 350 = 400 lines
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text(function("fifty_one", 51) + "\n" * 350)  # 401 lines
    nested = "class C:\n    def method(self):\n        def inner():\n" + "            x = 1\n" * 49
    (tmp_path / "nested.py").write_text(nested)  # method: 51 lines, inner: 50
    assert oversized(tmp_path) == ["nested.py:2 method: 51 lines", "sub/long.py: 401 lines",
                                   "sub/long.py:1 fifty_one: 51 lines"]


# ---- one name, one meaning ---------------------------------------------------------------------------------------

# public names defined at the top of two modules that mean the same thing in both
SAME_MEANING = {
    "launch": {"distributed/processes.py", "runs.py"},  # runs.launch is distributed.launch for a run's spec
    "from_dict": {"settings.py", "tokenizer.py"},  # each rebuilds its own module's object from its JSON
    # each C++ library's module says the same things of its own library (the decode kernel, the reference engine):
    # its source, flags, layout version and structs (named as in its C source), what the machine lacks, its build
    **{name: {"inference/native.py", "reference/library.py"} for name in (
        "SOURCE", "FLAGS", "LAYOUT_VERSION", "Layer", "Model", "STRUCTS", "missing", "build_library", "load_library")},
}


def defined_twice(package: Path) -> dict[str, set[str]]:
    """Public names (not _private) bound at the top of more than one module under `package` (functions, classes,
    assignments; imports are uses, not definitions) -> those modules."""
    where: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            else:
                names = []
            for name in names:
                if not name.startswith("_") and name not in ("log", "__all__"):
                    where.setdefault(name, set()).add(path.relative_to(package).as_posix())
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_no_public_name_is_defined_in_two_modules_with_two_meanings():
    assert defined_twice(PACKAGE) == SAME_MEANING


def test_a_name_defined_in_two_modules_is_found(tmp_path):
    (tmp_path / "serve").mkdir()
    (tmp_path / "runs.py").write_text("import os\nfrom x import describe\ndef describe(run): pass\nlog = 1\n")
    (tmp_path / "serve" / "app.py").write_text("PRECISIONS = {}\ndef _private(): pass\nlog = 2\n")
    (tmp_path / "config.py").write_text("PRECISIONS: tuple = ()\nclass describe: pass\ndef _private(): pass\n")
    assert defined_twice(tmp_path) == {"describe": {"config.py", "runs.py"},
                                       "PRECISIONS": {"config.py", "serve/app.py"}}


# ---- what tests share --------------------------------------------------------------------------------------------

def shared_imports(folder: Path) -> list[str]:
    """Imports of conftest or of a test file (test_*) in the Python files directly in `folder`, at the top or inside
    a function, as 'FILE:LINE MODULE': what test files share belongs in helpers.py."""
    out = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            top = [m for m in modules if m.split(".")[0] == "conftest" or m.split(".")[0].startswith("test_")]
            out += [f"{path.name}:{node.lineno} {m}" for m in top]
    return out


def test_test_files_share_helpers_through_helpers_py_only():
    assert shared_imports(ROOT / "tests") == []


def test_an_import_of_conftest_or_of_a_test_file_is_found(tmp_path):
    (tmp_path / "test_a.py").write_text("import os\nfrom helpers import tree\nfrom conftest import CORPUS\n")
    (tmp_path / "test_b.py").write_text("def f():\n    from test_a import x\n    import test_c as t\n"
                                        "code = 'import test_b'  # a string is no import\n")
    assert shared_imports(tmp_path) == ["test_a.py:3 conftest", "test_b.py:2 test_a", "test_b.py:3 test_c"]


# ---- the design is written down ----------------------------------------------------------------------------------

def test_the_design_is_written_in_the_repository_and_names_every_package():
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert packages and [p for p in packages if f"`{p}/`" not in design] == []
    assert "tests/boundaries.toml" in design and "## Boundaries" in design


# ---- one module, one name ----------------------------------------------------------------------------------------

def modules_named_alike(package: Path) -> dict[str, list[str]]:
    """Module file names found at more than one place under `package` (a package's __init__.py and __main__.py
    aside) -> those places: a name that means two things to whoever reads an import or a traceback."""
    where: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py") and "__pycache__" not in path.parts:
            where.setdefault(path.name, []).append(path.relative_to(package).as_posix())
    return {name: places for name, places in where.items() if len(places) > 1}


def test_no_two_modules_share_a_name():
    assert modules_named_alike(PACKAGE) == {}


def test_two_modules_with_one_name_are_found(tmp_path):
    for name in ("model.py", "reference/model.py", "reference/__init__.py", "serve/__init__.py", "serve/app.py",
                 "__main__.py", "cli/__main__.py", "hf/hf.py", "hf/peft.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('"""a module"""\n')
    assert modules_named_alike(tmp_path) == {"model.py": ["model.py", "reference/model.py"]}
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "peft.py").write_text("")
    assert modules_named_alike(tmp_path) == {"model.py": ["model.py", "reference/model.py"],
                                             "peft.py": ["bench/peft.py", "hf/peft.py"]}
