"""The house rules of DESIGN.md, checked over the whole package:

- no public name defined at the top of two modules (one name, one meaning), but for the few listed in SAME_MEANING.

Each scanner is also run on planted examples, so that a scanner that finds nothing fails its own test.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gptlab"

# ---- one name, one meaning ---------------------------------------------------------------------------------------

# public names defined at the top of two modules that mean the same thing in both
SAME_MEANING = {
    "data_dir_for": {"cli/common.py", "runs.py"},  # the CLI's is runs.data_dir_for, imported on first use
    "launch": {"distributed/distributed.py", "runs.py"},  # runs.launch is distributed.launch for a run's spec
    "from_dict": {"config.py", "tokenizer.py"},  # each rebuilds its own module's object from its JSON
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
