"""The boundary rule's listing (docs/design.md, "Boundaries"): every size the code batches, chunks, tiles or
vectorises by, and every setting a user can change, each mapped to the tests that cross or vary it.

What is found here, and must have an entry in tests/boundaries.toml:
- constants: module-level integer constants of src/gptlab (NAME = 32, NAME = 1 << 20) and `constexpr int` of its
  C++ sources, keyed "MODULE.NAME" and "FILE:NAME" (path under src/gptlab);
- settings: every flag of every `gptlab` verb ("--top-k"), and every field a request to the server may carry
  ("api:top_logprobs").
An entry names its `tests` (pytest node ids, each function's source naming the constant or the setting), or, for a
constant that is no size the code cuts work by (a format version, a default handed to a peer), `not_an_edge` with
the reason. Hand-made entries under [edge] list the tile and block sizes that have no name (a kernel's row blocks).
scripts/boundaries.py prints draft entries for what has none.
"""

from __future__ import annotations

import argparse
import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "gptlab"
LISTING = ROOT / "tests" / "boundaries.toml"
CONSTANT = re.compile(r"_?[A-Z][A-Z0-9_]+")
CPP_CONSTANT = re.compile(r"constexpr\s+(?:int|int64_t|size_t)\s+([A-Z][A-Z0-9_]*)\s*=")
API_FIELD = re.compile(r"""body(?:\.get\(|\[)\s*"([a-z_]+)"|(?:UNSUPPORTED|CHAT_UNSUPPORTED) = \{([^}]*)\}""")


def _int_value(node: ast.AST) -> int | None:
    """The integer an expression of literals stands for (32, 1 << 20, 64 * 1024), else None."""
    try:
        value = eval(compile(ast.Expression(node), "<constant>", "eval"), {"__builtins__": {}})  # literals only
    except Exception:  # a name, a call: not a literal constant
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def constants(src: Path = SRC) -> set[str]:
    """Every module-level integer constant of the Python modules under `src` and every `constexpr int NAME` of its
    .h / .cpp files."""
    found = set()
    for path in sorted(src.rglob("*.py")):
        module = ".".join(("gptlab", *path.relative_to(src).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
            for target in targets:
                if isinstance(target, ast.Name) and CONSTANT.fullmatch(target.id) and _int_value(node.value) is not None:
                    found.add(f"{module}.{target.id}")
    for path in sorted(p for p in src.rglob("*") if p.suffix in (".h", ".cpp")):
        for name in CPP_CONSTANT.findall(path.read_text(encoding="utf-8")):
            found.add(f"{path.relative_to(src).as_posix()}:{name}")
    return found


def verbs(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of every verb and subcommand under `parser` ("bench", "chat"), depth first, each with its
    flags added (common.Verbs adds them on first use)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                add = getattr(action, "pending", {}).pop(name, None)
                if add is not None:
                    add(sub)
                yield (*path, name), sub
                yield from verbs(sub, (*path, name))


def flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every --flag of `parser` and of its verbs and their subcommands (flags added on first use too)."""
    return {o for p in [parser, *(sub for _, sub in verbs(parser))] for action in p._actions
            for o in action.option_strings if o.startswith("--") and o not in ("--help", "--version")}


def api_fields(src: Path = SRC) -> set[str]:
    """Every field a request to the server is read for (body.get("x"), body["x"]) or refused by name."""
    found = set()
    for path in sorted((src / "serve").glob("*.py")):
        for read, refused in API_FIELD.findall(path.read_text(encoding="utf-8")):
            found |= {read} if read else set(re.findall(r'"([a-z_]+)"\s*:', refused))
    return {f"api:{name}" for name in found}


def settings() -> set[str]:
    from gptlab.cli import make_parser

    return flags(make_parser()) | api_fields()


def listing(path: Path = LISTING) -> dict[str, dict[str, dict]]:
    """The listing: {"constant": {key: entry}, "setting": {...}, "edge": {...}}."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return {kind: data.get(kind, {}) for kind in ("constant", "setting", "edge")}


def functions_of_tests(root: Path = ROOT) -> dict[str, str]:
    """Every test function's node id (FILE::NAME) -> its source, with its decorators, the module-level
    assignments of the names they use (a parametrize list such as CASES) and the module's own functions it calls."""
    out = {}
    for path in sorted((root / "tests").glob("test_*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        assigned = {t.id: ast.get_source_segment(text, node) or "" for node in tree.body
                    if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
        helpers = {f.name: ast.get_source_segment(text, f) or "" for f in tree.body
                   if isinstance(f, ast.FunctionDef) and not f.name.startswith("test_")}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                parts = [ast.get_source_segment(text, d) or "" for d in node.decorator_list]
                used = {n.id for d in node.decorator_list for n in ast.walk(d) if isinstance(n, ast.Name)}
                parts += [assigned[name] for name in sorted(used) if name in assigned]
                called = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
                parts += [helpers[name] for name in sorted(called) if name in helpers]
                out[f"tests/{path.name}::{node.name}"] = "\n".join([*parts, ast.get_source_segment(text, node) or ""])
    return out


def words_of(key: str, entry: dict | None = None) -> list[str]:
    """What a test crossing or varying `key` names in its source: the constant's name, the flag (or its Python
    spelling, top_k for --top-k), the request field, or the words its entry gives as `names` (the library's name
    of what a flag sets, with_transformers for --no-transformers)."""
    if entry and entry.get("names"):
        return list(entry["names"])
    if key.startswith("api:"):
        return [f'"{key[4:]}"', f"{key[4:]}="]
    if key.startswith("--"):
        return [key, key[2:].replace("-", "_")]
    return [re.split(r"[.:]", key)[-1].lstrip("_")]


def mentions(source: str, key: str, entry: dict | None = None) -> bool:
    return any(re.search(rf"(?<![\w-]){re.escape(w)}" + ("" if w.endswith("=") else r"(?![\w-])"), source,
                         0 if w.isupper() else re.IGNORECASE) for w in words_of(key, entry))
