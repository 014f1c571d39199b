"""The catalogue of planted bugs: realistic mistakes, each a small edit of one source file, and the tests that must
fail when it is made. `make planted` (scripts/planted.py) makes each edit in a copy of src/, runs its tests against
that copy (CLI subprocesses included, through PYTHONPATH) and reports any that still pass.

One module per area (serve, engine, data, ...), each with a list PLANTED of entries such as

    Planted("engine: top-k ties broken unstably", "src/gptlab/sampling.py", "top_k_filter",
            [("stable=True).indices[..., :k]", "stable=False).indices[..., :k]")],
            "tests/test_sampling.py::test_top_k_keeps_the_k_largest_ties_toward_the_lower_id")

that is: a name (its area, a colon, the mistake); the file; the function the bug is planted into, qualified
("Class.method", "outer.inner"; a class for its body; for C++ the function's bare name; None for the module's top
level); the edits (pattern, replacement), made in order; the tests (pytest node ids), one of which at least must fail.

A pattern is found by its tokens, not its characters: it and the function's source are compared as streams of
tokens (Python's tokenize; a rough C-like lexer for .cpp and .h), blind to line breaks, indentation, the trailing
comma a formatter adds before a closing bracket and the parentheses it wraps a long expression in (after `=`,
`return`, `if`, ...); strings are compared exactly; the source's comments are skipped unless the pattern holds one.
The pattern must match exactly once inside the function. Where the file still holds the pattern's characters as
written, the replacement takes their place; else only the tokens where pattern and replacement differ are
replaced (re-indented if the function moved), and the source's layout around them stays.

An entry is *stale* when its file or function is gone, a pattern matches 0 or more than 1 times in the function,
its replacement reads a name that neither the pattern nor the file holds (a local renamed since), or the edited
file does not compile (C++: its brackets do not balance). Planted.apply then raises Stale; `make planted` and
`python scripts/planted.py --check` report it ("STALE name: why", saying where the pattern is now if it moved to
another function) for whoever changed the code to re-anchor it; `make test` does not fail on it
(tests/test_planted.py checks what a refactor cannot break). The tokens, the functions and the splice are in
_match.py (its `enclosing` names the function a new entry's pattern is in).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path

from ._match import Stale, planted

__all__ = ["ROOT", "Planted", "Stale", "catalogue"]

ROOT = Path(__file__).resolve().parents[2]  # the repository


@dataclass(frozen=True)
class Planted:
    """A bug: `edits` (pattern, replacement), made in order inside `function` of `path` (relative to the repository;
    None: the module's top level), must fail at least one of `tests` (pytest node ids)."""

    name: str
    path: str
    function: str | None
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]

    def __init__(self, name: str, path: str, function: str | None, edits, tests):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "function", function)
        object.__setattr__(self, "edits", tuple((old, new) for old, new in edits))
        object.__setattr__(self, "tests", tuple([tests] if isinstance(tests, str) else tests))

    def apply(self, text: str) -> str:
        """`text` (the file's source) with the edits made; raises Stale, saying why, where they no longer apply."""
        return planted(text, self.path, self.function, self.edits)


def catalogue() -> list[Planted]:
    """Every planted bug of every area module in this package (not _match.py), in module order."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            found += importlib.import_module(f"{__name__}.{info.name}").PLANTED
    return found
