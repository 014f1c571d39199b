"""The house's walls: data flows one way through the modules (no module imports one that imports it back, lazy
imports inside functions included); each stage's package imports only the stages before it and is imported only by
the later ones that use it; model.py is the architecture alone; the core never reaches into the bench wing, the CLI
or the Hugging Face bridge; and the map of the modules in docs/design.md is the tree's."""

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gptlab"
HF_USERS = {"cli.verbs", "runs"}  # --init-from and import / export are the only ways into hf/ (gpt2_folders, hf_tokenizer)
BRIDGES = ("hf.", "ggml.")  # the interchange formats: Hugging Face's, and llama.cpp's GGUF (which reuses hf/'s pieces)
STAGES = ("data", "training", "distributed", "hf", "ggml")  # packages that are a stage's modules side by side: a bare __init__

# A room is a top-level module or a package with everything inside it. What each of these packages may import
# besides itself: the rooms before it, as the code has them.
MAY_IMPORT = {
    "data": {"errors", "machine", "config", "tokenizer", "chat", "rundir"},  # text -> token files -> batches: no model
    "distributed": {"errors", "machine", "config", "model", "runtime", "rundir", "sharded", "checkpoint"},
    "training": {"errors", "config", "tokenizer", "rundir", "data", "model", "heads", "lora", "runtime", "peak",
                 "optim", "plots", "checkpoint", "distributed", "reference"},
    "hf": {"errors", "config", "tokenizer", "chat", "rundir", "model", "lora", "checkpoint"},
    # GGUF: hf/'s tokenizer pieces and import writer; the GELU check reads the run's data and samples with the engine
    "ggml": {"errors", "config", "tokenizer", "chat", "rundir", "model", "lora", "checkpoint", "hf", "data", "engine"},
    # (sampling: a row's state chooses its tokens with it; it imports nothing but config)
    "inference": {"errors", "machine", "compiled", "config", "tokenizer", "model", "runtime", "checkpoint", "sampling"},
    # the naive C++ engine: the equations beside the model, needing nothing after the optimizer's groups
    "reference": {"errors", "machine", "compiled", "config", "model", "optim"},
    "serve": {"errors", "config", "tokenizer", "chat", "checkpoint", "inference", "engine", "textstream", "inspect"},
}
# ... and which rooms may import each of these packages besides itself: the later ones that use it, no others.
IMPORTED_ONLY_BY = {
    "training": {"runs", "bench"},  # nothing below the loop imports it
    "distributed": {"training", "runs", "cli"},
    "hf": {"runs", "cli", "bench", "ggml"},
    "ggml": {"cli", "bench"},
    "inspect": {"serve", "cli", "bench"},
    "serve": {"cli", "bench"},
    "bench": {"cli"},
    "reference": {"training", "cli", "bench"},
}


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


def room(module: str) -> str:
    """The room a module is in: itself when it is a top-level module, else its package ("data.prepare" -> "data")."""
    return module.split(".")[0]


def breaches(edges: dict[str, set[str]]) -> list[str]:
    """Every import in `edges` (module -> modules it imports) that MAY_IMPORT or IMPORTED_ONLY_BY forbids."""
    found = []
    for name, deps in sorted(edges.items()):
        for dep in sorted(deps):
            if room(dep) == room(name):
                continue
            if room(name) in MAY_IMPORT and room(dep) not in MAY_IMPORT[room(name)]:
                found.append(f"{name} imports {dep}: {room(name)}/ imports only {sorted(MAY_IMPORT[room(name)])}")
            if room(dep) in IMPORTED_ONLY_BY and room(name) not in IMPORTED_ONLY_BY[room(dep)]:
                found.append(f"{name} imports {dep}: only {sorted(IMPORTED_ONLY_BY[room(dep)])} import {room(dep)}/")
    return found


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
    """model.py imports torch, the standard library, config.py and ops.py (the two operations it is built from);
    ops.py imports torch and the standard library alone."""
    outside = {"torch", "__future__"} | set(sys.stdlib_module_names)
    for module, own in (("model.py", ("gptlab.config", "gptlab.ops")), ("ops.py", ())):
        for name in imports_of(PACKAGE / module):
            ours = any(name == o or name.startswith(f"{o}.") for o in own)
            assert ours or name.split(".")[0] in outside, f"{module} imports {name}"


def test_the_core_never_imports_the_bench_wing_the_cli_or_the_bridges():
    for name, deps in graph().items():
        if name in ("cli", "__main__") or name.startswith(("cli.", "bench")):
            continue
        assert not any(d == "cli" or d.startswith(("cli.", "bench")) for d in deps), f"{name} imports {deps}"
        assert name.startswith("ggml.") or not any(d == "ggml" or d.startswith("ggml.") for d in deps), \
            f"{name} imports {deps}"
        if name not in HF_USERS and not name.startswith(BRIDGES):
            assert not any(d == "hf" or d.startswith("hf.") for d in deps), f"{name} imports {deps}"


def test_each_stage_imports_only_the_stages_before_it_and_only_its_users_import_it():
    assert breaches(graph()) == []


def test_the_stage_walls_are_seen_when_broken():
    """The rules above fail on an import that crosses them: the data stage reaching for the model, a module below
    the loop importing it, inference importing the engine above it, anyone but the CLI importing serve/."""
    edges = graph()
    for name, dep in [("data.prepare", "model"), ("evaluate", "training.train"), ("inference.fused", "engine"),
                      ("runs", "serve.app"), ("checkpoint", "distributed.fsdp"), ("sampling", "hf.gpt2_folders")]:
        broken = {**edges, name: edges[name] | {dep}}
        assert any(b.startswith(f"{name} imports {dep}:") for b in breaches(broken)), (name, dep)


def test_only_the_distributed_stage_and_sharded_checkpoints_import_torch_distributed():
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if room(name) == "distributed" or name == "sharded":
            continue
        used = sorted(n for n in imports_of(path) if n.startswith(("torch.distributed", "torch.nn.parallel")))
        assert not used, f"{name} imports {used}"


def test_every_package_says_what_it_is_and_a_stages_package_imports_nothing():
    """Each package's __init__ has a docstring; a stage's (its modules side by side) imports nothing, so that
    importing one module of it loads no other and no import can run back through it."""
    for init in PACKAGE.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init.relative_to(PACKAGE)} has no docstring"
    for stage in STAGES:
        assert imports_of(PACKAGE / stage / "__init__.py") == set(), f"{stage}/__init__.py imports something"


def test_the_checker_sees_lazy_imports(tmp_path):
    """The walls above are only as good as the import reader: it must see imports inside functions."""
    (tmp_path / "m.py").write_text("def f():\n    from gptlab.bench import device_peak\n    import gptlab.cli\n")
    assert {"gptlab.bench", "gptlab.bench.device_peak", "gptlab.cli"} <= imports_of(tmp_path / "m.py")


def design_map() -> list[tuple[str, str]]:
    """docs/design.md's module table: (what each row names, `name.py` or `name/`; the whole row), in order."""
    design = (PACKAGE.parents[1] / "docs" / "design.md").read_text(encoding="utf-8")
    table = design[design.index("| module | what it does |"):].split("\n\n")[0]
    return [(line.split("`")[1], line) for line in table.splitlines()[2:]]


def test_the_design_map_is_the_tree():
    """One row per top-level module (`name.py`) and one per package (`name/`), nothing else; a package's row names
    each module in it (`name.py`) and no other."""
    named = [name for name, _ in design_map()]
    modules = {p.name for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}
    packages = {f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert len(named) == len(set(named)), f"rows named twice: {sorted(n for n in named if named.count(n) > 1)}"
    tree = modules | packages
    assert set(named) == tree, f"not in the map: {sorted(tree - set(named))}; not in the tree: {sorted(set(named) - tree)}"
    for name, row in design_map():
        if name.endswith("/"):
            inside = {p.relative_to(PACKAGE / name).as_posix() for p in (PACKAGE / name).rglob("*.py")} - {"__init__.py"}
            listed = set(re.findall(r"`([\w/]+\.py)`", row))
            assert listed == inside, f"{name}'s row names {sorted(listed - inside)} (not in it) and leaves out " \
                f"{sorted(inside - listed)}"


def test_the_design_map_lists_every_module_in_an_order_the_imports_follow():
    """docs/design.md's module table is the pipeline's map: every module is in it, and each imports only rows above
    its own (a package's modules share its row and may import each other)."""
    rows = [name.removesuffix(".py").rstrip("/") for name, _ in design_map()]
    row_of = {name: (name.split(".")[0] if name.split(".")[0] in rows else name) for name in graph()}
    missing = sorted(n for n, row in row_of.items() if row not in rows and n not in ("__init__", "__main__"))
    assert not missing, f"modules missing from docs/design.md's map: {missing}"
    for name, deps in graph().items():
        if name in ("__init__", "__main__"):
            continue
        for dep in deps:
            if row_of[dep] != row_of[name]:
                assert rows.index(row_of[dep]) < rows.index(row_of[name]), f"{name} imports {dep}, listed below it"
