"""Run the catalogue of planted bugs (tests/planted): each edit made in a fresh copy of src/, its tests run against
that copy, and a table of which tests caught it. An entry that no longer applies to the code (its function gone, its
pattern found 0 or 2+ times there, the edited file not compiling) is reported as "STALE name: why", for whoever
changed the code to re-anchor it. Exits 1 if any planted bug survives or is stale.

    python scripts/planted.py                 # every entry
    python scripts/planted.py serve engine    # entries whose name starts with one of these areas
    python scripts/planted.py --check         # only make each edit (no test run): which entries are stale
    python scripts/planted.py --list          # the catalogue, without running it
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from planted import Planted, Stale, catalogue  # noqa: E402


def edited(bug: Planted, root: Path = ROOT) -> str:
    """The source of `bug`'s file under `root` with the bug made; raises Stale, saying why, where it cannot be."""
    path = root / bug.path
    if not path.is_file():
        raise Stale(f"no file {bug.path}")
    return bug.apply(path.read_text(encoding="utf-8"))


def run_one(bug: Planted, scratch: Path) -> tuple[bool, str]:
    """(caught, the last line pytest printed) for `bug` made in a copy of src/ under `scratch`; raises Stale where
    it no longer applies."""
    text = edited(bug)
    copy = scratch / "src"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(ROOT / "src", copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (scratch / bug.path).write_text(text, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(ROOT / "tests")]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", "-p", "no:randomly",  # -q: addopts
           "--rootdir", str(ROOT), *(str(ROOT / t) for t in bug.tests)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    counts = [line for line in done.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    last = counts[-1].strip() if counts else (done.stdout + done.stderr).strip()[-200:]
    # rc 1: a test failed (caught); 0: every test passed (survived); anything else: the run itself broke
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{bug.name}: pytest exited {done.returncode}: {last}\n{done.stdout[-2000:]}")
    return done.returncode == 1, str(last)


def check(bugs: list[Planted]) -> int:
    """Make each bug's edits (no test run) and report the stale entries; 1 if there is one."""
    stale = 0
    for bug in bugs:
        try:
            edited(bug)
        except Stale as why:
            stale += 1
            print(f"STALE {bug.name}: {why}", flush=True)
    print(f"planted --check: {len(bugs) - stale} apply, {stale} stale of {len(bugs)}")
    return 1 if stale else 0


def run(bugs: list[Planted]) -> int:
    """Run each bug against its tests, a line each; 1 if one survived or is stale."""
    survivors, stale = [], []
    with tempfile.TemporaryDirectory(prefix="gptlab-planted-") as scratch:
        for i, bug in enumerate(bugs, 1):
            start = time.monotonic()
            try:
                caught, last = run_one(bug, Path(scratch))
            except Stale as why:
                stale.append(bug.name)
                print(f"[{i:>3}/{len(bugs)}] STALE {bug.name}: {why}", flush=True)
                continue
            mark = "caught  " if caught else "SURVIVED"
            print(f"[{i:>3}/{len(bugs)}] {mark} {bug.name}  ({time.monotonic() - start:.0f} s: {last})", flush=True)
            if not caught:
                survivors.append(bug.name)
    caught = len(bugs) - len(survivors) - len(stale)
    print(f"planted: {caught} caught, {len(survivors)} survived, {len(stale)} stale of {len(bugs)}")
    return 1 if survivors or stale else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("areas", nargs="*", help="only the entries whose name starts with one of these")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument("--check", action="store_true", help="only make each edit, and report the stale entries")
    args = parser.parse_args(argv)
    bugs = [b for b in catalogue() if not args.areas or b.name.split(":")[0] in args.areas]
    if args.list:
        for bug in bugs:
            print(f"{bug.name}\n    {bug.path}, in {bug.function or 'the top level'}; caught by {', '.join(bug.tests)}")
        return 0
    return check(bugs) if args.check else run(bugs)


if __name__ == "__main__":
    sys.exit(main())
