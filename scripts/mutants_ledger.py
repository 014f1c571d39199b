"""What a mutant changes, read from mutmut's mutated files by comparing its AST with the original function's, for
scripts/mutants.py: the message-only mutants (left out of the score, never run) and the reviewed equivalent mutants
of docs/equivalent-mutants.toml, matched by what they change rather than by mutmut's positional names.

A listed mutation names its function ("gptlab.sampling:top_k_filter", "gptlab.engine:RunningBatch.__init__") and
the code it changes, before and after: a statement, a compound statement's header (`if k <= 0:`,
`def score(precision='fp32'):`), or an expression or one dict item inside a statement, compared by AST. A mutant of
that function matches when some node that holds its whole change reads `original` in the original function and
`mutated` in the mutant. Line numbers, formatting, comments, the function's place in the file and edits elsewhere in
the function (which renumber mutmut's mutants) do not enter into it; an edit of the listed code itself does (the
listing is then reported stale, to review again). Two identical statements of one function, mutated alike, are one
listing.
"""

from __future__ import annotations

import ast
import copy
import difflib
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")  # a compound statement's statements: not its header
FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)
MESSAGE_CALLS = {"print", "warn", "error", "warning", "info", "debug", "exception", "critical", "fail", "exit"}
MESSAGE_SUFFIXES = ("Error", "Exception", "Exit", "Warning")


def functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Every function at module level and in classes, by the name mutmut gives it."""
    found = {}
    for node in tree.body:
        for item in [node, *(node.body if isinstance(node, ast.ClassDef) else [])]:
            if isinstance(item, FUNCTION):
                found[item.name] = item
    return found


def real_name(mangled: str) -> str:
    """The name in src/ of mutmut's function `x_f` or `xǁClassǁmethod` (a mutant's suffix `__mutmut_N` or not):
    `f`, `Class.method`."""
    base = mangled.rpartition("__mutmut_")[0] or mangled
    return ".".join(base.split("ǁ")[1:]) if base.startswith("xǁ") else base.removeprefix("x_")


def function_key(key: str) -> str:
    """A mutant's key ("gptlab.engine.xǁEngineǁstep__mutmut_3") -> its function, as the ledger names it
    ("gptlab.engine:Engine.step")."""
    module, _, name = key.rpartition(".")
    return f"{module}:{real_name(name)}"


def _differences(a, b, parents: tuple) -> list[tuple[object, tuple]]:
    """The smallest nodes (with their ancestors) where ASTs `a` and `b` differ."""
    if type(a) is not type(b):
        return [(a, parents)]
    if isinstance(a, ast.AST):
        out = []
        for field in a._fields:
            out += _differences(getattr(a, field), getattr(b, field), (*parents, a))
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return [(a, parents)]
        return [d for x, y in zip(a, b) for d in _differences(x, y, parents)]
    return [] if a == b else [(a, parents)]


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _is_message_call(node) -> bool:
    if not isinstance(node, ast.Call):
        return False
    name = _call_name(node)
    return name in MESSAGE_CALLS or name.endswith(MESSAGE_SUFFIXES)


def _message_argument(call: ast.Call):
    """The message of a message call: its first positional argument that is not a number (ApiError(400, message,
    param) has a status first)."""
    return next((a for a in call.args if not (isinstance(a, ast.Constant) and isinstance(a.value, (int, float)))),
                None)


def _is_message_text(node: ast.Constant, parents: tuple) -> bool:
    """Whether string `node` is literal text of the innermost message call's message, or of an assert statement's
    message (shown only when the assertion fails): the message itself, or a literal part of it as an f-string or a
    sum (not inside a call or an expression that builds the message)."""
    for i in range(len(parents) - 1, -1, -1):
        if _is_message_call(parents[i]) or isinstance(parents[i], ast.Assert):
            path = [*parents[i + 1:], node]
            between = all(isinstance(p, (ast.JoinedStr, ast.BinOp)) for p in path[:-1])
            message = parents[i].msg if isinstance(parents[i], ast.Assert) else _message_argument(parents[i])
            return path[0] is message and between
    return False


def only_message_changed(original: ast.FunctionDef, mutant: ast.FunctionDef) -> bool:
    """Whether `mutant` differs from `original` only in the literal text of messages (see _is_message_text)."""
    diffs = _differences(original.body, mutant.body, ())
    if not diffs:
        return False
    for value, parents in diffs:
        if isinstance(value, str) and parents and isinstance(parents[-1], ast.Constant):
            node, parents = parents[-1], parents[:-1]  # the text of a string changed (or it became None)
        elif isinstance(value, ast.Constant) and isinstance(value.value, str):
            node = value  # a string replaced by another node
        else:
            return False
        if not _is_message_text(node, parents):
            return False
    return True


def changed_lines(source: str | list[str], original: ast.FunctionDef, mutant: ast.FunctionDef) -> list[str]:
    """The mutant's lines that differ from the original function's (stripped), to show a survivor.
    `source` may be given as its lines (a module's thousand mutants then split it once, not once each)."""
    real = original.name.rpartition("__mutmut_")[0].rpartition("ǁ")[2].removeprefix("x_")  # the name in src/
    lines = source.splitlines() if isinstance(source, str) else source
    old = "\n".join(lines[original.lineno - 1:original.end_lineno]).replace(original.name, real, 1).splitlines()
    new = "\n".join(lines[mutant.lineno - 1:mutant.end_lineno]).replace(mutant.name, real, 1).splitlines()
    return [line[1:].strip() for line in difflib.unified_diff(old, new, lineterm="", n=0)
            if line.startswith("+") and not line.startswith("+++")]


def _diff_paths(a, b, path: tuple) -> list[tuple]:
    """The paths (field names, list indices) below `a` and `b` to the places where they differ."""
    if type(a) is not type(b) or (isinstance(a, list) and len(a) != len(b)):
        return [path]
    if isinstance(a, ast.AST):
        return [p for field in a._fields for p in _diff_paths(getattr(a, field), getattr(b, field), (*path, field))]
    if isinstance(a, list):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _diff_paths(x, y, (*path, i))]
    return [] if a == b else [path]


def changed_nodes(original: ast.FunctionDef, mutant: ast.FunctionDef) -> list[tuple[ast.AST, ast.AST]]:
    """(original's node, mutant's node) for each node that holds every difference of the two functions (their
    names aside), innermost first, the functions themselves last; [] where they do not differ."""
    paths = [p for field in original._fields if field != "name"
             for p in _diff_paths(getattr(original, field), getattr(mutant, field), (field,))]
    if not paths:
        return []
    common = []
    for steps in zip(*paths):
        if len(set(steps)) != 1:
            break
        common.append(steps[0])
    pairs, a, b = [(original, mutant)], original, mutant
    for step in common:
        if isinstance(step, int) and isinstance(pairs[-1][0], ast.Dict):  # one item of a dict, as a dict of one
            pairs.append(tuple(ast.Dict(keys=[d.keys[step]], values=[d.values[step]]) for d in pairs[-1]))
        a, b = (a[step], b[step]) if isinstance(step, int) else (getattr(a, step), getattr(b, step))
        if isinstance(a, ast.AST):
            pairs.append((a, b))
    return pairs[::-1]


def shape(node: ast.AST) -> str:
    """What a ledger compares of a node: its ast.dump; of a compound statement or an except clause, its header
    only (its statements left out; a function's name and decorators too)."""
    if any(isinstance(getattr(node, field, None), list) for field in BLOCKS):
        node = copy.copy(node)
        for field in BLOCKS:
            if isinstance(getattr(node, field, None), list):
                setattr(node, field, [])
        if isinstance(node, FUNCTION):
            node.name, node.decorator_list = "", []
    return ast.dump(node)


def site_shapes(original: ast.FunctionDef, mutant: ast.FunctionDef) -> list[tuple[str, str]]:
    """(original, mutated) shape of each statement, header or expression that holds the mutant's change, innermost
    first: what a listed mutation's code may name."""
    return [(shape(a), shape(b)) for a, b in changed_nodes(original, mutant)
            if isinstance(a, (ast.expr, ast.stmt, ast.excepthandler)) and not isinstance(a, ast.Expr)]


def code_shape(text: str) -> str:
    """The shape of a ledger's code: one statement, one expression, or one compound statement's header (a line
    ending in ':': `if x > 0:`, `elif x:`, `except KeyError:`, `def f(a=1) -> int:`). ValueError if none."""
    text = textwrap.dedent(text).strip()
    text = "if" + text[4:] if text.startswith("elif ") else text
    tries = [(text, lambda t: t.body), (f"({text})", lambda t: t.body), (f"{text} ...", lambda t: t.body),
             (f"try: ...\n{text} ...", lambda t: t.body[0].handlers)]
    for candidate, nodes in tries:
        try:
            found = nodes(ast.parse(candidate))
        except (SyntaxError, AttributeError):
            continue
        if len(found) == 1:
            return shape(found[0].value if isinstance(found[0], ast.Expr) else found[0])
    raise ValueError(f"not one statement, expression or header: {text!r}")


@dataclass(frozen=True)
class Mutation:
    function: str  # "gptlab.module:function" or "gptlab.module:Class.method"
    original: str
    mutated: str
    reason: str
    shapes: tuple[str, str]

    def __str__(self) -> str:
        return f"{self.function}: {self.original!r} -> {self.mutated!r}"


def load_equivalents(path: Path) -> dict[str, list[Mutation]]:
    """docs/equivalent-mutants.toml: [[equivalent]] tables, each a reason and the mutations it covers
    ([[equivalent.mutation]]: function, original, mutated) -> the mutations by function."""
    if not path.exists():
        return {}
    listed: dict[str, list[Mutation]] = {}
    for entry in tomllib.loads(path.read_text(encoding="utf-8")).get("equivalent", []):
        if not str(entry.get("reason", "")).strip() or not entry.get("mutation"):
            raise SystemExit(f"mutants: {path}: an entry lacks a reason or its mutations: {entry}")
        for item in entry["mutation"]:
            missing = {"function", "original", "mutated"} - set(item)
            if missing:
                raise SystemExit(f"mutants: {path}: a mutation lacks {', '.join(sorted(missing))}: {item}")
            try:
                shapes = (code_shape(item["original"]), code_shape(item["mutated"]))
            except ValueError as e:
                raise SystemExit(f"mutants: {path}: {item['function']}: {e}") from None
            mutation = Mutation(item["function"], item["original"], item["mutated"], entry["reason"], shapes)
            same = listed.setdefault(mutation.function, [])
            if shapes[0] == shapes[1] or any(m.shapes == shapes for m in same):
                what = "changes nothing" if shapes[0] == shapes[1] else "is listed twice; keep one"
                raise SystemExit(f"mutants: {path}: {mutation} {what}")
            same.append(mutation)
    return listed


def find(listed: dict[str, list[Mutation]], key: str, original: ast.FunctionDef | None,
         mutant: ast.FunctionDef | None) -> Mutation | None:
    """The listed mutation that mutant `key` (its function's original and its own AST) makes, if any."""
    candidates = listed.get(function_key(key))
    if not candidates or original is None or mutant is None:
        return None
    for pair in site_shapes(original, mutant):
        for mutation in candidates:
            if mutation.shapes == pair:
                return mutation
    return None


def module_of(source: str) -> str:
    """A source's dotted module, as mutmut's keys begin: src/gptlab/data/prepare.py -> gptlab.data.prepare."""
    return source.removeprefix("src/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
