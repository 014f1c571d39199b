"""The house rules of docs/design.md, checked over the whole package and the README:

- no measured figure (a time, a rate, a share, a speed-up, a loss value, a before -> after history, an issue number)
  in src/ or README.md outside a link to docs/benchmarks.md: figures live in docs/benchmarks.md only, with their
  command, machine and date, so that no copy of one can drift;
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
    "a time": rf"{NUMBER}\s?(?:ms|µs|ns)\b|{NUMBER}\s(?:s|secs?|seconds?|mins?|minutes?|hours?)\b",
    "a rate": rf"{NUMBER}\s?(?:[kKM]?tokens/s|tok/s|[kMGT]i?B/s|it/s|steps/s|[GT]?FLOP/?s|[GT]FLOPS)",
    "a share": rf"{NUMBER}\s?%",
    "a speed-up": rf"{NUMBER}\s?(?:x|×|times)\s+(?:faster|slower|quicker|fewer|less|more|smaller|larger)\b",
    "a loss value": rf"\bloss(?:es)?\s+(?:(?:of|at|near|about|around|below|under)\s+|[<>~≈=]\s*)?{NUMBER}",
    "an issue number": r"\bissues?\s+#?\d+",
    "a duration in words": r"\b(?:under|within|about|in)\s+(?:a\s+few|a|one)\s+(?:seconds?|minutes?|hours?)\b"
                           r"|\ba\s+few\s+(?:seconds|minutes|hours)\b",
}
# README prose only (src/ is full of settings written this way): a number read off a run, like 0.93 or 1.836
README_READING = r"(?<![\w.])\d+\.\d{2,}\b"
FIGURE = re.compile("|".join(f"(?P<k{i}>{pattern})" for i, pattern in enumerate(FIGURES.values())), re.IGNORECASE)
KINDS = list(FIGURES)

# settings and tolerances that read like figures, each with what it is
ALLOWED = [
    r"every 10 s",  # README: the plain progress line's interval (PLAIN_LINE_SECONDS), a setting
    r"10 s for in-flight requests",  # serve/api.py: --grace's default
    r"every 50 ms",  # bench/prepare.py: how often the bench samples a process's memory
    r"\(1/5/15 min\)",  # the load average's three windows
    r"at most 0\.55 of one process's bytes",  # README: FSDP's bound on 2 processes, tests/test_distributed.py
    r"(?:width|height):\s*\d+%|hsl\([^)]*\)|,\d+%,\d+%\)",  # playground.html: CSS lengths, hsl() colours
    r"Python ≥ \d+\.\d+",  # README: the Python version required
]
BENCHMARKS_LINK = r"\[[^\]]*\]\(docs/benchmarks\.md[^)]*\)"  # a figure may sit in the text of a link to them
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
    """Every measured figure in `root`'s README.md and in the text files under its src/gptlab, as FILE:LINE."""
    files = [p for p in sorted((root / "src" / "gptlab").rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".gz", ".pyc", ".so")]
    out = []
    for path in [root / "README.md", *files]:
        for line, kind, text in figures(path.read_text(encoding="utf-8"), readings=path.name == "README.md"):
            out.append(f"{path.relative_to(root)}:{line}: {kind}: {text!r}")
    return out


def test_no_measured_figure_in_the_code_the_help_texts_or_the_readme():
    assert measured_figures(ROOT) == []


PLANTED = [  # (text, the kind found in it)
    ("# a step takes 9.4 ms here", "a time"),
    ("decodes in 2.41 ms/step", "a time"),
    ("training took 17.7 s", "a time"),
    ("prepare reads 12,345 tokens/s", "a rate"),
    ("memory read 52.9 GB/s now", "a rate"),
    ("96% of the bandwidth floor", "a share"),
    ('"4x faster than transformers"', "a speed-up"),
    ("int8 is 2 times faster", "a speed-up"),
    ("to a validation loss of 1.836", "a loss value"),
    ("(val loss ~2.5)", "a loss value"),
    ("reach val loss < 1.88", "a loss value"),
    ("the step 1513 -> 1361 ms", "a history"),
    ("bf16 10.4 → 9.4", "a history"),
    ("with the changes of issue 16:", "an issue number"),
    ("on Tiny Shakespeare in under a minute", "a duration in words"),
    ("the suite (offline, a few minutes on 2 cores)", "a duration in words"),
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


def test_a_figure_planted_in_the_readme_or_a_module_is_found(tmp_path):
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(PACKAGE, tmp_path / "src" / "gptlab", ignore=shutil.ignore_patterns("__pycache__"))
    assert measured_figures(tmp_path) == []
    with open(tmp_path / "README.md", "a", encoding="utf-8") as f:
        f.write("\nThe fused step decodes at 415.7 tokens/s.\n")
    with open(tmp_path / "src" / "gptlab" / "sampling.py", "a", encoding="utf-8") as f:
        f.write("# measured: 1.2 ms -> 0.9 ms\n")
    readme_lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    sampling_lines = len((PACKAGE / "sampling.py").read_text(encoding="utf-8").splitlines())
    assert measured_figures(tmp_path) == [
        f"README.md:{readme_lines + 2}: a rate: '415.7 tokens/s'",
        f"src/gptlab/sampling.py:{sampling_lines + 1}: a history: '1.2 ms -> 0.9'"]


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
    "launch": {"distributed/distributed.py", "runs.py"},  # runs.launch is distributed.launch for a run's spec
    "from_dict": {"settings.py", "tokenizer.py"},  # each rebuilds its own module's object from its JSON
    # each C++ library's module says the same things of its own library (the decode kernel, the reference engine):
    # its source, flags, layout version and structs (named as in its C source), what the machine lacks, its build
    **{name: {"inference/native.py", "reference/native.py"} for name in (
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
