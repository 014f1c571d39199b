"""scripts/mutants.py (make mutants): which mutants it filters as message-only, the folder config it gives mutmut,
and its refusal of an unknown module. Pure and fast; mutmut itself is not run here."""

import ast
import json
import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutants_script", ROOT / "scripts" / "mutants.py")
mutants = sys.modules["mutants_script"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutants)


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
])
def test_anything_else_is_kept(original, mutant):
    assert not mutants.only_message_changed(*_pair(original, mutant))


def test_the_changed_line_is_what_the_equivalents_list_names():
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
    assert all(entry["reason"].strip() for entry in listed.values())


def test_a_mutant_listed_twice_is_refused_naming_it(tmp_path):
    entry = '[[equivalent]]\nmutant = "gptlab.x.x_f__mutmut_{}"\nline = "x = 1"\nreason = "{}"\n\n'
    path = tmp_path / "equivalents.toml"
    path.write_text(entry.format(1, "first") + entry.format(2, "other") + entry.format(1, "second"))
    with pytest.raises(SystemExit, match=r"gptlab\.x\.x_f__mutmut_1 is listed twice"):
        mutants.load_equivalents(path)


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
