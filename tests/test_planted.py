"""The catalogue of planted bugs (tests/planted) keeps what a refactor cannot break: unique names, files that exist,
tests that exist. Whether each edit still applies is `python scripts/planted.py --check` (a stale entry is reported
there and by `make planted`, for whoever changed the code to re-anchor it), not a failing test here: what is tested
here is that a refactor (a reformat, a renamed local) leaves each entry applying or reporting itself stale, and the
matcher itself, on tiny planted sources. Running the catalogue (each bug against its tests) is `make planted`."""

import ast
import importlib.util
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from planted import ROOT, Planted, Stale, catalogue
from planted._match import lex

BUGS = catalogue()


def test_the_catalogue_is_not_empty_and_names_are_unique():
    names = [bug.name for bug in BUGS]
    assert names and len(names) == len(set(names))


@pytest.mark.parametrize("bug", BUGS, ids=lambda bug: bug.name)
def test_every_entry_names_a_file_that_exists_a_function_and_its_edits(bug):
    assert (ROOT / bug.path).is_file(), bug.path
    assert bug.function is None or all(part.isidentifier() for part in bug.function.split("."))
    assert bug.edits and all(isinstance(old, str) and old.strip() and isinstance(new, str) for old, new in bug.edits)


@pytest.mark.parametrize("bug", BUGS, ids=lambda bug: bug.name)
def test_every_named_test_exists(bug):
    for node in bug.tests:
        file, _, name = node.partition("::")
        source = (ROOT / file).read_text(encoding="utf-8")
        assert Path(ROOT / file).is_file() and (not name or f"def {name.split('[')[0]}(" in source), node


# ---- the matcher, on tiny planted sources ------------------------------------------------------------------------

SOURCE = '''def f(x):
    y = x + 1
    return y


def g(x):
    y = x + 1
    return scale(y, 2, [1, 2])
'''


def planted(function, *edits, path="m.py"):
    return Planted("test: a bug", path, function, edits, "tests/test_planted.py")


def test_an_edit_is_made_in_its_function_only_though_another_holds_the_same_text():
    assert planted("g", ("y = x + 1", "y = x - 1")).apply(SOURCE) == SOURCE.replace(
        "    y = x + 1\n    return scale", "    y = x - 1\n    return scale")
    assert planted("f", ("y = x + 1", "y = x - 1")).apply(SOURCE) == SOURCE.replace("y = x + 1", "y = x - 1", 1)


def test_a_pattern_matches_across_reflowed_lines_a_trailing_comma_and_wrapping_parentheses():
    reflowed = SOURCE.replace("    return scale(y, 2, [1, 2])", "    return (\n        scale(\n            y,\n"
                                                                 "            2,\n            [1, 2],\n        )\n    )")
    edited = planted("g", ("return scale(y, 2, [1, 2])", "return scale(y, 3, [1, 2])")).apply(reflowed)
    assert "            3,\n" in edited and edited.count("\n") == reflowed.count("\n")
    edited = planted("g", ("scale(y, 2, [1, 2])", "scale(y, 2, [2, 1]) + 1")).apply(reflowed)
    assert ast.dump(ast.parse(edited)) == ast.dump(ast.parse(SOURCE.replace("[1, 2])", "[2, 1]) + 1")))


def test_a_whole_line_edit_is_re_indented_where_the_function_moved():
    moved = "class C:\n" + "".join(f"    {line}" if line.strip() else line for line in SOURCE.splitlines(True))
    bug = Planted("test: a bug", "m.py", "C.f", [("    y = x + 1\n", "    y = x + 1\n    y = -y\n")], "t.py")
    assert "        y = x+1\n        y = -y\n        return y" in bug.apply(moved.replace("x + 1", "x+1"))


@pytest.mark.parametrize("source, why", [
    (SOURCE.replace("y = x + 1\n    return y", "y = x * 2\n    return y"), "edit 1 matches 0 times in f of m.py"),
    (SOURCE.replace("    return y", "    y = x + 1\n    return y"), "edit 1 matches 2 times in f of m.py (lines 2, 3)"),
    (SOURCE.replace("def f(", "def h("), "no function f in m.py"),
    (SOURCE.replace("def f(x):\n    y = x + 1\n", "def f(x):\n    y = 0\n"), "(it is in g now, line 7)"),
    (SOURCE.replace("y", "z"), "edit 1 matches 0 times"),  # the local renamed
])
def test_an_entry_whose_pattern_is_not_once_in_its_function_is_stale(source, why):
    with pytest.raises(Stale, match=why.replace("(", r"\(").replace(")", r"\)")):
        planted("f", ("y = x + 1", "y = x - 1")).apply(source)


def test_an_edit_that_breaks_the_syntax_or_reads_a_renamed_local_is_stale():
    with pytest.raises(Stale, match="does not compile"):
        planted("f", ("return y", "return y +")).apply(SOURCE)
    renamed = SOURCE.replace("y", "z")
    with pytest.raises(Stale, match="edit 1 reads y, which m.py no longer has"):
        planted("f", ("x + 1", "y + 1")).apply(renamed)
    assert "z = x - 1" in planted("f", ("x + 1", "x - 1")).apply(renamed)


def test_comments_are_skipped_unless_the_pattern_holds_one_and_a_tuple_of_one_keeps_its_comma():
    commented = SOURCE.replace("    y = x + 1\n    return y", "    y = x + 1  # one more\n    return y  # done")
    assert "y = x - 1  # one more" in planted("f", ("y = x + 1\n    return y", "y = x - 1\n    return y")).apply(commented)
    assert "return -y  # done" in planted("f", ("return y  # done", "return -y  # done")).apply(commented)
    with pytest.raises(Stale, match="0 times"):
        planted("f", ("return y  # not done", "return -y")).apply(commented)
    assert [t.kind for t in lex("f(a,)", True)][-2] == "optional" and [t.kind for t in lex("(a,)", True)][-2] == "code"


def test_a_cpp_edit_is_found_in_its_function_whatever_the_layout():
    cpp = "static int f(int k) {\n    return k + 1;\n}\n\nint g(int k) noexcept {\n    return k + 1;  // same\n}\n"
    bug = planted("g", ("return k + 1;", "return k + 2;"), path="m.cpp")
    assert bug.apply(cpp) == cpp.replace("k + 1;  //", "k + 2;  //")
    assert "k +\n        2;" in bug.apply(cpp.replace("k + 1;  //", "k +\n        1;  //"))
    with pytest.raises(Stale, match="brackets do not balance"):
        planted("f", ("return k + 1;", "return (k + 1;"), path="m.cpp").apply(cpp)


# ---- a refactor: the module reformatted, a local renamed ---------------------------------------------------------

REFACTORED = ["src/gptlab/sampling.py", "src/gptlab/data/conversations.py", "src/gptlab/lora.py"]


def function_node(tree: ast.Module, qualified: str) -> ast.AST:
    """The definition called `qualified` (Class.method, outer.inner) in `tree`."""
    node = tree
    for part in qualified.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part)
    return node


def renamed(text: str, function: str, name: str, to: str) -> str:
    """`text` with the local `name` of `function` written `to`: each parameter and ast.Name of that name in it (not
    an attribute, not a keyword argument)."""
    lines = text.splitlines(keepends=True)
    spots = [(n.lineno, n.col_offset) for n in ast.walk(function_node(ast.parse(text), function))
             if isinstance(n, ast.Name) and n.id == name or isinstance(n, ast.arg) and n.arg == name]
    for row, col in sorted(spots, reverse=True):
        line = lines[row - 1].encode()  # the offsets count bytes
        lines[row - 1] = (line[:col] + to.encode() + line[col + len(name.encode()):]).decode()
    return "".join(lines)


def the_local(text: str, bugs: list[Planted]) -> tuple[str, str]:
    """(function, local) such that the entries planted into that function of `text` hold that name of a parameter
    or an assigned local of it (not self) most often of all."""
    held = Counter()
    for function in sorted({bug.function for bug in bugs if bug.function}):
        node = function_node(ast.parse(text), function)
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        names |= {n.arg for n in ast.walk(node) if isinstance(n, ast.arg)} - {"self", "cls"}
        held.update((function, t.text) for bug in bugs if bug.function == function for old, _ in bug.edits
                    for t in lex(old, True, True) if t.text in names)
    return held.most_common(1)[0][0]


@pytest.mark.parametrize("path", REFACTORED)
def test_a_reformat_and_a_renamed_local_leave_each_entry_applying_or_stale(path, tmp_path):
    pytest.importorskip("ruff", reason="ruff formats the module (pip install -e '.[test]')")
    original = (ROOT / path).read_text(encoding="utf-8")
    copy = tmp_path / Path(path).name
    copy.write_text(original, encoding="utf-8")
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", "--config", str(ROOT / "pyproject.toml"), str(copy)],
                   check=True)
    formatted = copy.read_text(encoding="utf-8")
    bugs = [bug for bug in BUGS if bug.path == path]
    function, local = the_local(original, bugs)
    refactored = renamed(formatted, function, local, local + "_renamed")
    assert formatted != original and refactored != formatted and compile(refactored, path, "exec")
    applied, stale = {}, []
    for bug in bugs:
        try:
            applied[bug.name] = bug.apply(refactored)  # compiles, or it would be Stale; anything else fails the test
        except Stale:
            stale.append(bug.name)
    touched = {bug.name for bug in bugs if bug.function == function
               and local in {t.text for old, new in bug.edits for t in lex(old + "\n" + new, True, True)}}
    assert stale and set(stale) <= touched, f"stale though the rename did not touch them: {set(stale) - touched}"
    for bug in bugs:
        assert bug.name in stale or applied[bug.name] != refactored
        if bug.function != function:  # the same bug as on today's code: the same tree once renamed
            want = renamed(bug.apply(original), function, local, local + "_renamed")
            assert ast.dump(ast.parse(applied[bug.name])) == ast.dump(ast.parse(want)), bug.name


# ---- the report: make planted and --check --------------------------------------------------------------------

def script():
    spec = importlib.util.spec_from_file_location("planted_script", ROOT / "scripts" / "planted.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stale_entry_is_reported_and_counted_by_make_planted_and_check(capsys):
    gone = Planted("test: a stale bug", "src/gptlab/sampling.py", "no_such_function", [("a", "b")], "t.py::t")
    missing = Planted("test: a bug in no file", "src/gptlab/no_such_module.py", None, [("a", "b")], "t.py::t")
    runner = script()
    assert runner.check([gone, missing]) == 1
    out = capsys.readouterr().out
    assert "STALE test: a stale bug: no function no_such_function in src/gptlab/sampling.py\n" in out
    assert "STALE test: a bug in no file: no file src/gptlab/no_such_module.py\n" in out
    assert out.endswith("planted --check: 0 apply, 2 stale of 2\n")
    assert runner.run([gone]) == 1  # stale before any test is run
    assert capsys.readouterr().out.endswith("planted: 0 caught, 0 survived, 1 stale of 1\n")
