"""A pytest plugin that scripts/mutants.py adds to mutmut's pytest runs (`-p mutmut_plugin`).

- While mutmut collects its stats, each test is credited, before mutmut's own teardown hook reads them, with the
  functions that the subprocesses it started called (left in MUTMUT_HITS_DIR by sitecustomize.py). Without it a
  function that only a `python -m gptlab` subprocess reaches has "no tests" and its mutants are never run.
- Every pytest run mutmut starts (one per mutant) shares one folder of compiled decode kernels (MUTMUT_KERNELS)
  instead of tests/conftest.py's fresh one per session: mutmut mutates no C++, so the kernel is the same for every
  mutant, and compiling it per mutant would be most of the run's time.
- Module-scoped fixtures: what a test's setup calls (in-process or in a subprocess) is credited to every test of its
  file, and each test's time gains its file's longest setup (mutmut times the call alone), so a mutant reached only
  by a fixture runs against the tests that read the fixture, under a time limit that covers building it."""

import json
import os
from pathlib import Path

import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if os.environ.get("MUTMUT_KERNELS"):
        os.environ["GPTLAB_KERNELS"] = os.environ["MUTMUT_KERNELS"]


def _subprocess_hits(item) -> None:
    """The functions the test's subprocesses called so far, added to mutmut's record of the test's calls."""
    folder = os.environ.get("MUTMUT_HITS_DIR")
    if not folder:
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


_setup_hits: dict[str, set] = {}  # test file -> the functions its tests' setups (fixtures) called


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """A module-scoped fixture (a trained run, a server) is built in the setup of the first test that asks for it, so
    mutmut credits what it calls to that test alone, and a mutant there is run against it alone while the file's
    other tests, which read the fixture, are the ones that would fail. What any setup of a file calls is credited,
    at the end of the stats run, to every test of the file."""
    if os.environ.get("MUTANT_UNDER_TEST") != "stats":
        yield
        return
    from mutmut.state import state

    before = set(state()._stats)
    yield
    _subprocess_hits(item)
    _setup_hits.setdefault(item.nodeid.split("::")[0], set()).update(set(state()._stats) - before)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        _subprocess_hits(item)


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


_setup_s: dict[str, float] = {}  # test file -> its longest setup seen in the stats run


def pytest_runtest_logreport(report):
    if report.when == "setup" and os.environ.get("MUTANT_UNDER_TEST") == "stats":
        file = report.nodeid.split("::")[0]
        _setup_s[file] = max(_setup_s.get(file, 0.0), report.duration)


def pytest_sessionfinish(session):
    """mutmut times a test by its call alone, so a test whose file builds a module-scoped fixture (a trained model,
    a run with four loggers: 10-30 s) gets a time limit far under what it needs when a mutant runs it alone, and a
    good mutant is counted a timeout. Each test's time, as mutmut saves it after this stats run, gains the longest
    setup of its file (its module fixtures are built for it when it runs alone)."""
    if os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    from mutmut.state import state

    durations = state().duration_by_test
    for nodeid in durations:
        file = nodeid.split("::")[0]
        durations[nodeid] += _setup_s.get(file, 0.0)
        for function in _setup_hits.get(file, ()):
            state().tests_by_mangled_function_name[function].add(nodeid.removeprefix("mutants/"))
