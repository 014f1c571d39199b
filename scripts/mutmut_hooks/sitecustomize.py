"""Loaded by every Python process that scripts/mutants.py starts (its folder is on PYTHONPATH). mutmut 3 learns which
test reaches which function from the calls its trampolines record in the pytest process; a CLI subprocess's calls
would be lost. While mutmut collects those stats (MUTANT_UNDER_TEST=stats), a subprocess here loads mutmut's config
from the module's folder (its trampolines need it) and leaves the functions it called in MUTMUT_HITS_DIR when it
exits; mutmut_plugin.py hands them to the test that started it. Nothing happens outside such a run.

A process that multiprocessing spawns from a test (prepare's encoding workers) runs the parent's main script first,
which under mutmut is mutmut's own: it imports mutmut, whose config is looked for in the working folder (a test's
temporary one) and not found, and the worker dies. Such a process loads the config from the module's folder too."""

import os
import sys


def _load_mutmut_config() -> None:
    from mutmut.configuration import config

    here = os.getcwd()
    os.chdir(os.environ["MUTMUT_FOLDER"])
    try:
        config()
    finally:
        os.chdir(here)


if os.environ.get("MUTMUT_FOLDER") and "--multiprocessing-fork" in sys.argv:
    _load_mutmut_config()

if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get("MUTMUT_HITS_DIR"):
    import atexit
    import json

    from mutmut.state import state

    _load_mutmut_config()

    def _leave_hits() -> None:
        hits = sorted(state()._stats)
        if hits:
            path = os.path.join(os.environ["MUTMUT_HITS_DIR"], f"{os.getpid()}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(hits, f)
            os.replace(path + ".tmp", path)

    atexit.register(_leave_hits)
