"""The catalogue of planted bugs: realistic mistakes, each a small edit of one source file, and the tests that must
fail when it is made. `make planted` (scripts/planted.py) makes each edit in a copy of src/, runs its tests against
that copy (CLI subprocesses included, through PYTHONPATH) and reports any that still pass; tests/test_planted.py
checks in `make test` that every edit still applies to today's code, so the catalogue cannot rot silently.

One module per area (serve, engine, data, ...), each with a list PLANTED of Planted entries."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


@dataclass(frozen=True)
class Planted:
    """A bug: `edits` (old text, new text), made in order to `path` (relative to the repository; each old text must
    occur exactly once when its turn comes), must fail at least one of `tests` (pytest node ids)."""

    name: str
    path: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]

    def __init__(self, name: str, path: str, edits, tests):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "edits", tuple((old, new) for old, new in edits))
        object.__setattr__(self, "tests", tuple([tests] if isinstance(tests, str) else tests))

    def apply(self, text: str) -> str:
        """`text` with the edits made; raises ValueError naming the edit whose old text is missing or not unique."""
        for old, new in self.edits:
            count = text.count(old)
            if count != 1:
                raise ValueError(f"{self.name}: {old!r} occurs {count} times in {self.path}, not once")
            text = text.replace(old, new)
        return text


def catalogue() -> list[Planted]:
    """Every planted bug of every area module in this package, in module order."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        found += importlib.import_module(f"{__name__}.{info.name}").PLANTED
    return found
