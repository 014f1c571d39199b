"""What `pip install gptlab` gets: a wheel built from this checkout holds every file under src/gptlab, the files
that are not Python included (the bundled corpus and BPE ranks, the kernel's C++ source, the playground page), which
only pyproject.toml's package-data brings along. Built offline, with the setuptools of this environment (the test
extra asks for one that builds wheels by itself)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def shipped_files(tree: Path) -> set[str]:
    """Every file under `tree`/src/gptlab (caches left out), as its path inside a wheel: gptlab/..."""
    package = tree / "src"
    return {p.relative_to(package).as_posix() for p in (package / "gptlab").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def test_the_wheel_ships_every_file_under_src_gptlab_python_or_not(tmp_path):
    copy = tmp_path / "checkout"  # built from a copy: a build writes build/ and *.egg-info where it runs
    copy.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, copy / name)
    shutil.copytree(ROOT / "src", copy / "src", ignore=SKIPPED)
    out = tmp_path / "dist"
    build = "import sys\nfrom setuptools import build_meta\nprint(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(out)], cwd=copy, capture_output=True, text=True, check=False,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    wheel = out / done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {name for name in zf.namelist() if name.startswith("gptlab/")}
    tree = shipped_files(copy)
    assert {p for p in tree if not p.endswith(".py")}, "no file that is not Python under src/gptlab: wrong tree?"
    missing = sorted(tree - in_wheel)
    assert not missing, f"files under src/gptlab the wheel leaves out (pyproject.toml's package-data): {missing}"
    assert in_wheel == tree, f"the wheel holds files that are not in src/gptlab: {sorted(in_wheel - tree)}"
