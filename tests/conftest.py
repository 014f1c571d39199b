import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import CORPUS, unselectable_ids
from hypothesis import HealthCheck, settings

import gptlab
from gptlab.data.prepare import prepare

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package: Playwright's own browser download cannot reach its host
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through Playwright (the attention page and the playground are checked in it). Per module:
    while Playwright's sync API is open, its event loop counts as running in the main thread, and a later test's
    asyncio.run() (bench serve's clients) would fail, in whatever order the modules run."""
    if not CHROMIUM.exists() or shutil.which("chromium") is None:
        pytest.skip("no chromium (Debian's package: apt-get install chromium; make setup installs it as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="no playwright (pip install -e '.[test]')")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


# Property-based tests are derandomised (the same examples every run) with a fixed budget; a test may ask for fewer.
settings.register_profile("gptlab", derandomize=True, database=None, max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("gptlab")

_kernels = pytest.StashKey[tuple]()  # GPTLAB_KERNELS before the session, and the session's kernel folder


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_configure(config):
    """Before any test module is collected: the fused decode kernel (gptlab.inference.native) is compiled once per test
    session into a temporary folder, for every test and every CLI subprocess, never into the user's cache; and
    the device_path marker is declared (see the summary at the end of this file)."""
    config.addinivalue_line("markers", "device_path(name): the device path a test exercises (default: cpu), "
                                       "named in the summary at the end")
    shared = os.environ.get("GPTLAB_TEST_KERNELS") if os.environ.get("PYTEST_XDIST_WORKER") else None
    if shared:  # a pytest-xdist worker: the controller's folder (builds are published atomically, so workers share)
        config.stash[_kernels] = (None, None)
        os.environ["GPTLAB_KERNELS"] = shared
        _share_the_cores(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    else:
        config.stash[_kernels] = (os.environ.get("GPTLAB_KERNELS"), tempfile.mkdtemp(prefix="gptlab-kernels-"))
        os.environ["GPTLAB_KERNELS"] = os.environ["GPTLAB_TEST_KERNELS"] = config.stash[_kernels][1]
    # CLI subprocesses import the gptlab these tests import: a mutation tool's or a planted bug's copy of src/, not
    # the editable install's src/ (what is imported first wins, and PYTHONPATH comes before site-packages)
    src = str(Path(gptlab.__file__).resolve().parents[1])
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != src]
    os.environ["PYTHONPATH"] = os.pathsep.join([src, *others])


def _share_the_cores(workers: int) -> None:
    """`make test` runs the suite in pytest-xdist workers, one per core: each worker, and the CLI subprocesses its
    tests start (OMP_NUM_THREADS, which gptlab.runtime.set_threads keeps), takes its share of the cores, not all of
    them (two workers of two threads each on two cores wait on each other's spinning threads)."""
    from gptlab.machine import usable_cores

    threads = max(1, usable_cores() // max(1, workers))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_unconfigure(config):
    before, kernels = config.stash[_kernels]
    if kernels is None:  # a worker: the controller removes the folder
        return
    os.environ.pop("GPTLAB_TEST_KERNELS", None)
    shutil.rmtree(kernels, ignore_errors=True)
    if before is None:
        os.environ.pop("GPTLAB_KERNELS", None)
    else:
        os.environ["GPTLAB_KERNELS"] = before


@pytest.fixture(scope="session")
def fused_kernel():
    """The fused decode kernel (gptlab.inference.native), this CPU's build, built. Skips, naming what is missing, on
    a machine without g++ (every CPU has a build: the plain one at least); on a machine with it a kernel that fails
    to build fails every test that uses it (KernelBuildError, with the compiler's message)."""
    from gptlab.inference import native

    reason = native.missing()
    if reason is not None:
        pytest.skip(f"the fused decode step cannot run here: {reason}")
    return native.build_library()


@pytest.fixture(scope="session")
def vnni_kernel(fused_kernel):
    """The fused decode kernel with its int8 VNNI product. Skips on a CPU without AVX512-VNNI; on one with it, a
    kernel built without it (or not built: see fused_kernel) fails every test that uses it."""
    from gptlab.inference import native

    if not native.cpu_has_int8_vnni():
        pytest.skip("no AVX512-VNNI on this CPU")
    assert native.has_int8_vnni(fused_kernel), "this CPU has AVX512-VNNI but the kernel was built without it"
    return fused_kernel


@pytest.fixture(autouse=True)
def _no_cached_peak(tmp_path_factory, monkeypatch):
    """Tests never read or write the user's measured-peak cache (~/.cache/gptlab)."""
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(CORPUS, encoding="utf-8")
    return path


@pytest.fixture
def char_data(tmp_path, corpus_file):
    out = tmp_path / "data"
    prepare([str(corpus_file)], out, "char", quiet=True)
    return out


# ---- which device paths ran: one line at the end of the run -------------------------------------------------

PATHS = ["cpu", "fused decode (native)", "int8 native (VNNI)", "bf16 native", "arm64 under qemu", "torch.compile",
         "cuda", "mps"]  # the summary's order
_outcomes: dict[str, dict] = {}  # device path -> {"passed": n, "failed": n, "skipped": [reasons]}


def pytest_collection_modifyitems(items):
    for item in items:
        for mark in item.iter_markers("parametrize"):
            if isinstance(mark.kwargs.get("ids"), (list, tuple)) and (bad := unselectable_ids(mark.kwargs["ids"])):
                raise pytest.UsageError(f"{item.nodeid}: the parametrize ids {bad} hold a backslash or a character "
                                        "outside printable ASCII; pytest escapes them again when it collects twice "
                                        "in one process (mutmut does), so the test cannot be run by its id: "
                                        "spell the ids without them")
        marker = item.get_closest_marker("device_path")
        item.user_properties.append(("device_path", marker.args[0] if marker else "cpu"))


def pytest_runtest_logreport(report):
    path = dict(report.user_properties).get("device_path", "cpu")
    seen = _outcomes.setdefault(path, {"passed": 0, "failed": 0, "skipped": []})
    if report.failed:
        seen["failed"] += 1
    elif report.skipped:
        seen["skipped"].append(report.longrepr[2].removeprefix("Skipped: ") if isinstance(report.longrepr, tuple)
                               else "skipped")
    elif report.when == "call":
        seen["passed"] += 1


def pytest_terminal_summary(terminalreporter):
    """e.g. "device paths: cpu ran; fused decode (native) ran; ...; cuda skipped (no CUDA device)": from the
    outcomes of the tests marked with each path, so a green run cannot hide a path that was never tried."""
    if not _outcomes:  # nothing ran (--collect-only)
        return
    parts = []
    for path in PATHS + sorted(set(_outcomes) - set(PATHS)):
        seen = _outcomes.get(path)
        if seen is None:
            parts.append(f"{path} not run")
        elif seen["failed"]:
            parts.append(f"{path} FAILED ({seen['failed']})")
        elif seen["passed"]:
            parts.append(f"{path} ran" + (f" ({len(seen['skipped'])} skipped)" if seen["skipped"] else ""))
        else:
            parts.append(f"{path} skipped ({'; '.join(dict.fromkeys(seen['skipped']))})")
    terminalreporter.write_line("device paths: " + "; ".join(parts))


@pytest.fixture(scope="session")
def reference_engine():
    """The naive C++ engine (gptlab.reference.library), built. Skips only where there is no C++ compiler; on a machine
    with one, an engine that fails to build fails every test that uses it (compiled.BuildError, with the compiler's
    message)."""
    from gptlab.reference import library

    reason = library.missing()
    if reason is not None:
        pytest.skip(reason)
    return library.load_library()
