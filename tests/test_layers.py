"""The house's walls: data flows one way through the modules (no module imports one that imports it back, lazy
imports inside functions included), model.py is the architecture alone, and the core never reaches into the
bench wing, the CLI or the Hugging Face bridge."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gptlab"
HF_USERS = {"cli.verbs", "runs"}  # --init-from and import / export are the only ways into hf/ (hf, hf_tokenizer)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__") or "__init__"


def imports_of(path: Path) -> set[str]:
    """Every module a file imports anywhere in it (top level or inside a function), as full dotted names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from gptlab import x`
    return names


def graph() -> dict[str, set[str]]:
    """gptlab module -> the gptlab modules it imports (a package counts as its __init__)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out = {}
    for name, path in files.items():
        own = {n.removeprefix("gptlab.") for n in imports_of(path) if n.startswith("gptlab.")}
        out[name] = {n for n in own if n in files and n != name}
    return out


def test_the_modules_import_one_way():
    edges = graph()
    state: dict[str, str] = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        if state.get(node) == "open":
            pytest.fail("import cycle: " + " -> ".join(trail[trail.index(node):] + [node]))
        state[node] = "open"
        for nxt in sorted(edges[node]):
            visit(nxt, trail + [node])
        state[node] = "done"

    for node in sorted(edges):
        visit(node, [])


def test_model_py_is_the_architecture_alone():
    allowed = {"torch", "gptlab.config", "__future__"} | set(sys.stdlib_module_names)
    for name in imports_of(PACKAGE / "model.py"):
        top = name.split(".")[0]
        assert top in allowed or name == "gptlab.config" or name.startswith("gptlab.config."), \
            f"model.py imports {name}"
        assert not name.startswith("gptlab.") or name.startswith("gptlab.config"), f"model.py imports {name}"


def test_the_core_never_imports_the_bench_wing_the_cli_or_hf():
    for name, deps in graph().items():
        if name in ("cli", "__main__") or name.startswith(("cli.", "bench")):
            continue
        assert not any(d == "cli" or d.startswith(("cli.", "bench")) for d in deps), f"{name} imports {deps}"
        if name not in HF_USERS and not name.startswith("hf."):
            assert not any(d == "hf" or d.startswith("hf.") for d in deps), f"{name} imports {deps}"


def test_the_checker_sees_lazy_imports(tmp_path):
    """The walls above are only as good as the import reader: it must see imports inside functions."""
    (tmp_path / "m.py").write_text("def f():\n    from gptlab.bench import peak\n    import gptlab.cli\n")
    assert {"gptlab.bench", "gptlab.bench.peak", "gptlab.cli"} <= imports_of(tmp_path / "m.py")


def test_the_readme_map_lists_every_module_in_an_order_the_imports_follow():
    """The README's module table is the pipeline's map: every module is in it, and each imports only rows above
    its own (a package's modules share its row and may import each other)."""
    readme = (PACKAGE.parents[1] / "README.md").read_text()
    table = readme[readme.index("| module | what it does |"):].split("\n\n")[0]
    rows = [line.split("`")[1].removesuffix(".py").rstrip("/") for line in table.splitlines()[2:]]
    row_of = {name: (name.split(".")[0] if name.split(".")[0] in rows else name) for name in graph()}
    missing = sorted(n for n, row in row_of.items() if row not in rows and n not in ("__init__", "__main__"))
    assert not missing, f"modules missing from the README's map: {missing}"
    for name, deps in graph().items():
        if name in ("__init__", "__main__"):
            continue
        for dep in deps:
            if row_of[dep] != row_of[name]:
                assert rows.index(row_of[dep]) < rows.index(row_of[name]), f"{name} imports {dep}, listed below it"
