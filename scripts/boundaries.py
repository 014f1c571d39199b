"""Draft entries of tests/boundaries.toml for every constant and setting that has none: the tests whose source names
it (up to three, from different files where there are several), or a note that no test does yet. A draft is a start,
not a verdict: read each named test, keep those that cross the edge or run a non-default value through the whole
path, and write the test that is missing.

    python scripts/boundaries.py            # drafts for what is missing
    python scripts/boundaries.py --all      # drafts for everything (to compare with the listing)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from boundaries import constants, listing, mentions, settings, functions_of_tests  # noqa: E402


REFUSALS = ("refus", "bad", "error", "one_line", "one_clear_line", "invalid", "damaged", "sweep", "spellings")


def draft(key: str, tests: dict[str, str]) -> list[str]:
    """Up to three tests naming `key`, one per file first, tests of refusals last (a refused value runs nothing)."""
    named = sorted((node for node, source in tests.items() if mentions(source, key)
                    and (not key.startswith("api:") or node.startswith("tests/test_serve"))),
                   key=lambda node: any(word in node for word in REFUSALS))
    picked, files = [], set()
    for node in named:
        if node.split("::")[0] not in files:
            picked.append(node)
            files.add(node.split("::")[0])
    return (picked + [n for n in named if n not in picked])[:3]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="draft every key, listed or not")
    args = parser.parse_args()
    listed = listing()
    tests = functions_of_tests()
    for kind, found in (("constant", constants()), ("setting", settings())):
        for key in sorted(found if args.all else found - set(listed[kind])):
            nodes = draft(key, tests)
            print(f"[{kind}.{json.dumps(key)}]")
            print(f"tests = {json.dumps(nodes)}" if nodes else 'tests = []  # none names it yet: write one')
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
