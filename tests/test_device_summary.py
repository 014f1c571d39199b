"""The line at the end of every test run (tests/conftest.py) saying which device paths ran, from real outcomes."""

import shutil
import subprocess
import sys
from pathlib import Path

SESSION = '''
import pytest

def test_plain():
    pass

@pytest.mark.device_path("bf16 native")
def test_that_fails():
    raise AssertionError

@pytest.mark.device_path("torch.compile")
def test_that_skips_inside():
    pytest.skip("no C++ compiler")

@pytest.mark.device_path("cuda")
@pytest.mark.skipif(True, reason="no CUDA device")
def test_on_a_gpu():
    pass

@pytest.mark.device_path("cuda")
@pytest.mark.skipif(True, reason="no CUDA device")
def test_on_a_gpu_too():
    pass
'''


def test_the_summary_names_each_device_path_with_what_its_tests_did(tmp_path):
    for name in ("conftest.py", "helpers.py"):  # conftest.py imports helpers
        shutil.copy(Path(__file__).with_name(name), tmp_path)
    (tmp_path / "test_session.py").write_text(SESSION)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 1  # test_that_fails
    lines = [line for line in out.stdout.splitlines() if line.startswith("device paths: ")]
    assert lines == ["device paths: cpu ran; fused decode (native) not run; int8 native (VNNI) not run; bf16 native "
                     "FAILED (1); arm64 under qemu not run; torch.compile skipped (no C++ compiler); cuda skipped (no CUDA device); mps not run"], \
        out.stdout[-3000:]
