"""The house's shape, counted over the layering test's import graph (tests/test_layers.py): modules, packages,
rooms (a top-level module, or a package with everything inside it), import edges between modules and between
rooms, floors (the longest chain of rooms, each importing the next, counted in rooms) and that chain.

    python scripts/layout.py
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_layers import graph  # noqa: E402


def room(module: str) -> str:
    return module.split(".")[0]


def room_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for name, deps in modules.items():
        rooms.setdefault(room(name), set()).update(room(d) for d in deps if room(d) != room(name))
    return rooms


def longest_chain(edges: dict[str, set[str]]) -> list[str]:
    """The longest path through an acyclic graph, from an importer down to what it imports last."""

    @cache
    def down(node: str) -> tuple[str, ...]:
        return (node,) + max((down(d) for d in sorted(edges[node])), key=len, default=())

    return list(max((down(n) for n in sorted(edges)), key=len))


def main() -> None:
    modules = {n: d for n, d in graph().items() if n not in ("__init__", "__main__")}
    rooms = room_graph(modules)
    packages = sorted(r for r in rooms if any(m.startswith(r + ".") for m in modules))
    chain = longest_chain(rooms)
    print(f"modules: {len(modules)}  packages: {len(packages)}  module edges: {sum(map(len, modules.values()))}")
    print(f"rooms: {len(rooms)}  room edges: {sum(map(len, rooms.values()))}  floors: {len(chain)}")
    print("longest chain: " + " -> ".join(chain))
    print("packages: " + ", ".join(packages))


if __name__ == "__main__":
    main()
