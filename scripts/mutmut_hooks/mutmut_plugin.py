"""A pytest plugin that scripts/mutants.py adds to mutmut's pytest runs (`-p mutmut_plugin`).

- While mutmut collects its stats, each test is credited, before mutmut's own teardown hook reads them, with the
  functions that the subprocesses it started called (left in MUTMUT_HITS_DIR by sitecustomize.py). Without it a
  function that only a `python -m gptlab` subprocess reaches has "no tests" and its mutants are never run.
- Every pytest run mutmut starts (one per mutant) shares one folder of compiled decode kernels (MUTMUT_KERNELS)
  instead of tests/conftest.py's fresh one per session: mutmut mutates no C++, so the kernel is the same for every
  mutant, and compiling it per mutant would be most of the run's time."""

import json
import os
from pathlib import Path

import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if os.environ.get("MUTMUT_KERNELS"):
        os.environ["GPTLAB_KERNELS"] = os.environ["MUTMUT_KERNELS"]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    folder = os.environ.get("MUTMUT_HITS_DIR")
    if os.environ.get("MUTANT_UNDER_TEST") != "stats" or not folder:
        return
    from mutmut.state import state

    credited = []
    for path in sorted(Path(folder).glob("*.json")):
        credited += json.loads(path.read_text())
        path.unlink()
    if credited:  # logged beside the hits: test, function reached through a subprocess, whether in-process too
        with open(Path(folder).parent / "subprocess-credits.tsv", "a") as log:
            log.writelines(f"{item.nodeid}\t{name}\t{name in state()._stats}\n" for name in sorted(set(credited)))
        state()._stats.update(credited)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """In a mutant's run, the tests mutmut chose for it run fastest first (their times from mutmut's stats run), so a
    killed mutant is usually found by its cheapest test; mutmut passes them in no particular order. The verdict is
    the same: every selected test still runs until one fails."""
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if "__mutmut_" not in mutant:
        return
    try:
        durations = json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    items.sort(key=lambda item: durations.get(item.nodeid, float("inf")))
