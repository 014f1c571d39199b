"""scripts/mutants.py (make mutants): which mutants it filters as message-only, the folder config it gives mutmut,
its refusal of an unknown module, and how the equivalents ledger finds a listed mutant by the code it changes
(scripts/mutants_ledger.py). Pure and fast; mutmut runs no test here (one test has it write its mutants)."""

import ast
import json
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutants_script", ROOT / "scripts" / "mutants.py")
mutants = sys.modules["mutants_script"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutants)
mutants_ledger = sys.modules["mutants_ledger"]  # what scripts/mutants.py imports from beside it


def _pair(original: str, mutant: str) -> tuple[ast.FunctionDef, ast.FunctionDef]:
    return ast.parse(original).body[0], ast.parse(mutant).body[0]


@pytest.mark.parametrize("original, mutant", [
    ('def f(n):\n    raise ValueError(f"n is {n}, must be > 0")', 'def f(n):\n    raise ValueError(f"XXn is {n}XX")'),
    ('def f(n):\n    raise GptlabError("bad " + str(n))', 'def f(n):\n    raise GptlabError("XXbad XX" + str(n))'),
    ('def f():\n    print("done", file=sys.stderr)', 'def f():\n    print("DONE", file=sys.stderr)'),
    ('def f():\n    log.warning("slow: %s", x)', 'def f():\n    log.warning("XXslow: %sXX", x)'),
    ('def f():\n    warnings.warn("old")', 'def f():\n    warnings.warn("XXoldXX")'),
    ('def f():\n    raise ApiError(400, "bad", "prompt")', 'def f():\n    raise ApiError(400, "BAD", "prompt")'),
    ('def f():\n    raise ValueError("bad")', 'def f():\n    raise ValueError(None)'),
    ('def f(x):\n    assert x, "x is set"', 'def f(x):\n    assert x, "XXx is setXX"'),
    ('def f(x):\n    assert x, f"x is {x}"', 'def f(x):\n    assert x, f"X IS {x}"'),
])
def test_a_changed_string_inside_a_message_call_is_message_only(original, mutant):
    assert mutants.only_message_changed(*_pair(original, mutant))


@pytest.mark.parametrize("original, mutant", [
    # the message's call changed, or something beside the string
    ('def f(n):\n    raise ValueError(f"n is {n}")', 'def f(n):\n    raise ValueError(f"n is {n + 1}")'),
    ('def f(n):\n    raise ValueError("bad")', 'def f(n):\n    raise ValueError()'),
    ('def f():\n    print("done", file=sys.stderr)', 'def f():\n    print("done", file=None)'),
    ('def f(s):\n    if s == "stop":\n        raise ValueError("x")', 'def f(s):\n    if s == "XXstopXX":\n'
     '        raise ValueError("x")'),
    ('def f(n):\n    raise ValueError(f"--{n.replace(\'_\', \'-\')} is bad")',
     'def f(n):\n    raise ValueError(f"--{n.replace(None, \'-\')} is bad")'),  # a TypeError instead
    # strings that are data, not messages: an API error's param and code, a key, a file's text
    ('def f():\n    raise ApiError(400, "bad", "prompt", "context_length_exceeded")',
     'def f():\n    raise ApiError(400, "bad", "XXpromptXX", "context_length_exceeded")'),
    ('def f(exc):\n    raise ApiError(400, str(exc), "prompt")',
     'def f(exc):\n    raise ApiError(400, str(exc), "PROMPT")'),
    ('def f():\n    raise ApiError(400, "bad", "prompt", "context_length_exceeded")',
     'def f():\n    raise ApiError(400, "bad", "prompt", "CONTEXT_LENGTH_EXCEEDED")'),
    ('def f(d):\n    return d["key"]', 'def f(d):\n    return d["XXkeyXX"]'),
    ('def f(p):\n    p.write_text("a\\n")', 'def f(p):\n    p.write_text("XXa\\nXX")'),
    ('def f(x):\n    return x.split(",")', 'def f(x):\n    return x.split("XX,XX")'),
    ('def f(x):\n    return x', 'def f(x):\n    return x'),  # no difference at all is not a message mutant
    ('def f(x):\n    assert x == "on", "x is on"', 'def f(x):\n    assert x == "XXonXX", "x is on"'),  # the test
])
def test_anything_else_is_kept(original, mutant):
    assert not mutants.only_message_changed(*_pair(original, mutant))


def test_a_survivors_changed_line_is_what_the_report_shows():
    source = ("def x_f__mutmut_orig(a):\n    b = a + 1\n    return b\n\n"
              "def x_f__mutmut_1(a):\n    b = a - 1\n    return b\n")
    funcs = mutants.functions(ast.parse(source))
    assert mutants.changed_lines(source, funcs["x_f__mutmut_orig"], funcs["x_f__mutmut_1"]) == ["b = a - 1"]


def test_a_modules_folder_config_narrows_mutmut_and_keeps_pytests_settings(tmp_path):
    module = mutants.MODULES["sampling"]
    text = mutants.module_config(ROOT, module)
    parsed = tomllib.loads(text)
    table = parsed["tool"]["mutmut"]
    assert table["only_mutate"] == ["src/gptlab/sampling.py"]
    assert table["pytest_add_cli_args_test_selection"] == list(module.tests)
    assert table["pytest_add_cli_args"][-2:] == ["-p", "mutmut_plugin"]
    assert parsed["tool"]["pytest"]["ini_options"] == tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["pytest"]["ini_options"]
    assert text.count("[tool.mutmut]") == 1


def test_every_modules_sources_and_tests_exist():
    for name, module in mutants.MODULES.items():
        for path in (*module.sources, *module.tests):
            file, _, test = path.partition("::")
            assert (ROOT / file).is_file(), f"{name}: {path}"
            assert not test or f"def {test}(" in (ROOT / file).read_text(encoding="utf-8"), f"{name}: {path}"


def test_an_unknown_module_is_refused_in_one_line(capsys):
    assert mutants.main(["nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown module nosuch" in err and "sampling" in err


def test_the_equivalents_list_parses_and_each_entry_has_a_reason():
    listed = mutants.load_equivalents(ROOT / "docs" / "equivalent-mutants.toml")
    assert listed and all(m.reason.strip() for mutations in listed.values() for m in mutations)


def _ledger(tmp_path, *mutations: tuple[str, str, str], reason: str = "the same") -> Path:
    path = tmp_path / "equivalents.toml"
    items = "".join(f'[[equivalent.mutation]]\nfunction = "{f}"\noriginal = "{o}"\nmutated = "{m}"\n'
                    for f, o, m in mutations)
    path.write_text(f'[[equivalent]]\nreason = "{reason}"\n{items}')
    return path


def test_a_mutation_listed_twice_is_refused_naming_it(tmp_path):
    path = _ledger(tmp_path, ("gptlab.x:f", "y = g(a, b=1)", "y = g(a)"), ("gptlab.x:f", "y = g(a, b=2)", "y = g(a)"),
                   ("gptlab.x:f", "y = g(a,\\n      b=1)  # the same code, another layout", "y = g(a, )"))
    with pytest.raises(SystemExit, match=r"gptlab\.x:f: 'y = g\(a,.*is listed twice"):
        mutants.load_equivalents(path)


@pytest.mark.parametrize("code", ["if k <= 0 or k > n:", "elif k:", "except (KeyError, ValueError) as e:",
                                  "def f(a, b='x') -> int:", "for i in range(n - 1):", "with open(p) as f:",
                                  "return x + 1", "x[i] = (a +\n   b)", "a +\n b", "{'step': ([P, P], i)}"])
def test_a_listed_code_is_a_statement_an_expression_or_a_header(code):
    assert mutants_ledger.code_shape(code)


# a mutmut-made file (mutmut 3 writes each function's original and its mutants beside it, by these names): pick's
# mutant 2 drops sorted's key=None, its default (an equivalent mutant)
PLANTED = '''
class Box:
    def xǁBoxǁpick__mutmut_orig(self, items):
        total = len(items)
        order = sorted(items, key=None)
        return order[:total]

    def xǁBoxǁpick__mutmut_1(self, items):
        total = len(items)
        order = sorted(items, key=None)
        return order[:total + 1]

    def xǁBoxǁpick__mutmut_2(self, items):
        total = len(items)
        order = sorted(items)
        return order[:total]
'''
# the same class reformatted, pick moved below a new method, and a statement added before the listed one: the
# listed mutant is now pick's mutant 3
MOVED = '''
class Box:
    def xǁBoxǁsize__mutmut_orig(self):
        return 1

    def xǁBoxǁpick__mutmut_orig(self, items):
        if not items: return []
        total = len(
            items)  # every item
        order = sorted(
            items,
            key=None,
        )
        return order[:total]

    def xǁBoxǁpick__mutmut_1(self, items):
        if items: return []
        total = len(items)
        order = sorted(items, key=None)
        return order[:total]

    def xǁBoxǁpick__mutmut_2(self, items):
        if not items: return []
        total = len(items)
        order = sorted(items, key=None)
        return order[:total + 1]

    def xǁBoxǁpick__mutmut_3(self, items):
        if not items: return []
        total = len(items)
        order = sorted(items)
        return order[:total]
'''


def _tally(tmp_path, source: str, survivors: list[int]):
    """scripts/mutants.py's counts and notes for a planted module gptlab.x whose pick mutants `survivors` survived
    (the others were killed)."""
    module = mutants.Module(("src/gptlab/x.py",), ())
    mutated = tmp_path / "mutants" / "src" / "gptlab" / "x.py"
    mutated.parent.mkdir(parents=True, exist_ok=True)
    mutated.write_text(source, encoding="utf-8")
    names = [n for n in mutants.functions(ast.parse(source)) if not n.endswith("_orig")]
    codes = {f"gptlab.x.{n}": 0 if int(n.rpartition("_")[2]) in survivors else 1 for n in names}
    mutated.with_name("x.py.meta").write_text(json.dumps({"exit_code_by_key": codes}))
    listed = mutants.load_equivalents(_ledger(tmp_path, ("gptlab.x:Box.pick", "order = sorted(items, key=None)",
                                                         "order = sorted(items)")))
    return mutants.tally(tmp_path, module, listed)


def test_a_listed_mutation_is_found_by_its_code_after_a_reformat_a_move_and_an_edit_elsewhere(tmp_path):
    counts, notes = _tally(tmp_path, PLANTED, survivors=[2])
    assert (counts["equivalent"], counts["survived"], notes) == (1, 0, [])
    counts, notes = _tally(tmp_path, MOVED, survivors=[3])
    assert (counts["equivalent"], counts["survived"], notes) == (1, 0, [])
    counts, notes = _tally(tmp_path, MOVED, survivors=[2, 3])  # another survivor is not taken for it
    assert (counts["equivalent"], counts["survived"]) == (1, 1) and "x.xǁBoxǁpick__mutmut_2" in notes[0]


def test_a_listed_mutation_whose_code_changed_is_reported_stale_and_not_counted(tmp_path):
    edited = PLANTED.replace("sorted(items, key=None)", "sorted(items, key=None, reverse=True)").replace(
        "sorted(items)", "sorted(items, reverse=True)")
    counts, notes = _tally(tmp_path, edited, survivors=[2])
    assert (counts["equivalent"], counts["survived"]) == (0, 1)
    assert "  stale listing gptlab.x:Box.pick: 'order = sorted(items, key=None)' -> 'order = sorted(items)' " \
           "(no mutant makes this change now)" in notes
    counts, notes = _tally(tmp_path, PLANTED, survivors=[])  # found, but killed: the review was wrong, or is stale
    assert counts["equivalent"] == 0 and any("stale listing gptlab.x:Box.pick" in n and "(killed: " in n
                                              for n in notes)


def test_mutmuts_own_mutants_of_a_reformatted_and_edited_function_still_match(tmp_path):
    """As above, with the files mutmut writes: the module formatted by ruff (its calls spread one argument a line)
    and a statement added before the listed one, so mutmut numbers the listed mutant differently."""
    pytest.importorskip("ruff", reason="ruff formats the module (pip install -e '.[test]')")
    file_mutation = pytest.importorskip("mutmut.mutation.file_mutation", reason="pip install -e '.[mutants]'")
    source = "def pick(items, n=2):\n    total = len(items)\n    order = sorted(items, key=None)\n    return order[:n]\n"
    listed = mutants.load_equivalents(_ledger(tmp_path, ("gptlab.x:pick", "order = sorted(items, key=None)",
                                                         "order = sorted(items, )")))

    def matching(text: str) -> list[str]:
        mutated = file_mutation.mutate_file_contents("src/gptlab/x.py", text)
        funcs = mutants.functions(ast.parse(mutated.code))
        return [n for n in mutated.mutant_names if mutants_ledger.find(
            listed, f"gptlab.x.{n}", funcs["x_pick__mutmut_orig"], funcs[n])]

    assert matching(source) == ["x_pick__mutmut_6"]
    edited = tmp_path / "x.py"
    edited.write_text(source.replace("    total", "    items = list(items)\n    total").replace(
        "sorted(items, key=None)", "sorted(items, key=None)  # a note"))
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", "--line-length", "20", str(edited)], check=True)
    assert "key=None,\n" in edited.read_text()  # one argument a line
    assert matching(edited.read_text()) == ["x_pick__mutmut_8"]  # the new line's 2 mutants come first
    assert matching(source.replace("key=None)", "key=None, reverse=True)")) == []


def test_a_sample_runs_n_mutants_drawn_by_seed_and_leaves_the_rest_out_of_the_score(tmp_path):
    module = mutants.Module(("src/gptlab/x.py",), ())
    meta = tmp_path / "mutants" / "src" / "gptlab" / "x.py.meta"
    meta.parent.mkdir(parents=True)
    (meta.parent / "x.py").write_text("")
    codes = {f"gptlab.x.x_f__mutmut_{i}": (1 if i < 5 else None) for i in range(1, 31)}  # 4 killed, 26 not run

    def run(size, seed=0):
        meta.write_text(json.dumps({"exit_code_by_key": codes}))
        marked = mutants.mark_sample(tmp_path, module, size, seed)
        return marked, json.loads(meta.read_text())["exit_code_by_key"]

    marked, after = run(10)
    assert marked == 16 and list(after.values()).count(None) == 10 and list(after.values()).count(35) == 16
    assert all(after[k] == 1 for k, c in codes.items() if c == 1)  # results already in are kept
    assert run(10)[1] == after and run(10, seed=1)[1] != after  # the draw is the seed's
    codes.update((k, c) for k, c in after.items())
    assert run(None) == (0, {k: (1 if c == 1 else None) for k, c in codes.items()})  # no sample: every mutant runs
    counts = dict.fromkeys(mutants.COLUMNS, 0) | {"generated": 30, "killed": 9, "survived": 1, "not sampled": 20}
    assert mutants.score(counts) == "90.0 % (sample of 10)"



def test_survivors_of_a_sample_are_tested_again_when_the_tests_change(tmp_path):
    """New tests: the sample's survivors are run again (whatever the new sample's size, 0 included), its kills stand,
    and the new draw comes from the rest."""
    module = mutants.Module(("src/gptlab/x.py",), ())
    meta = tmp_path / "mutants" / "src" / "gptlab" / "x.py.meta"
    meta.parent.mkdir(parents=True)
    (meta.parent / "x.py").write_text("")
    codes = {f"gptlab.x.x_f__mutmut_{i}": (1 if i < 5 else 0 if i < 8 else 35) for i in range(1, 31)}
    meta.write_text(json.dumps({"exit_code_by_key": codes}))
    (tmp_path / "tests-fingerprint").write_text("old")
    again = mutants.forget_for_new_tests(tmp_path, module, "new")
    assert again == {f"gptlab.x.x_f__mutmut_{i}" for i in (5, 6, 7)}
    assert mutants.mark_sample(tmp_path, module, 0, again=again) == 23
    after = json.loads(meta.read_text())["exit_code_by_key"]
    assert [k for k, c in after.items() if c is None] == sorted(again) and list(after.values()).count(1) == 4
    assert mutants.forget_for_new_tests(tmp_path, module, "old") == frozenset()  # the same tests: nothing again


def test_the_kernels_sources_are_copied_into_mutmuts_copy_of_src(tmp_path):
    """mutmut refreshes the Python files of its copy of src/, not the C++ kernel's: a decode.cpp of an older layout
    beside a newer native.py fails every decoding test. The run copies the csrc files in (a new one and a changed
    one), and leaves a folder with no copy of src/ yet alone."""
    csrc = tmp_path / "repo" / "src" / "gptlab" / "inference" / "csrc"
    csrc.mkdir(parents=True)
    (csrc / "decode.cpp").write_text("constexpr int LAYOUT_VERSION = 3;")
    (csrc / "simd.h").write_text("// new")
    copy = tmp_path / "folder" / "mutants" / "src" / "gptlab" / "inference"
    (copy / "csrc").mkdir(parents=True)
    (copy / "csrc" / "decode.cpp").write_text("constexpr int LAYOUT_VERSION = 2;")
    mutants.refresh_native_sources(tmp_path / "repo", tmp_path / "folder")
    assert (copy / "csrc" / "decode.cpp").read_text() == "constexpr int LAYOUT_VERSION = 3;"
    assert (copy / "csrc" / "simd.h").read_text() == "// new"
    mutants.refresh_native_sources(tmp_path / "repo", tmp_path / "empty")  # nothing generated there yet
    assert not (tmp_path / "empty").exists()


TWICE = """
import sys, pytest
args = ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", sys.argv[1]]
first = pytest.main(["--collect-only"] + args + [sys.argv[1]])
second = pytest.main(["--collect-only"] + args + [sys.argv[1] + "/test_ids.py::test_one[" + sys.argv[2] + "]"])
print("EXITS", first, second)
"""


@pytest.mark.parametrize("explicit, found", [("a.c", True), ("a\\\\.c", False)])
def test_an_id_pytest_escapes_cannot_be_found_by_a_second_collection_and_the_suite_refuses_one(tmp_path, explicit,
                                                                                             found):
    """Why tests/conftest.py refuses such ids: mutmut's worker collects the module's tests once, then runs a
    mutant's tests by their ids in the same process; an explicit id with a backslash (escaped again at the second
    collection) is not found, pytest exits with its usage error, and mutmut counted each such mutant a timeout
    (the 291 false timeouts of lora's run of 2026-12-07)."""
    (tmp_path / "test_ids.py").write_text(
        "import pytest\n@pytest.mark.parametrize('x', [1], ids=[%r])\ndef test_one(x):\n    pass\n"
        % explicit.replace("\\\\", "\\"))
    out = subprocess.run([sys.executable, "-c", TWICE, str(tmp_path), explicit], capture_output=True, text=True,
                         cwd=tmp_path).stdout
    assert ("EXITS 0 0" if found else "EXITS 0 4") in out, out
    from helpers import unselectable_ids
    assert unselectable_ids(["a.c", "sample --prompt Zebra snowman", 3, None]) == []
    assert unselectable_ids(["a.c", explicit.replace("\\\\", "\\"), "tab\there", "Zebra ☃"]) == (
        ["tab\there", "Zebra ☃"] if found else ["a\\.c", "tab\there", "Zebra ☃"])
