"""What the machine offers, read in one place: the CPU's model and features from /proc/cpuinfo (a file written here
by hand), and the cache folder from the environment."""

import os
import shutil
from pathlib import Path

import pytest

from gptlab import machine
from gptlab.inference import native

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Fake 9000 @ 2.00GHz
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl

processor\t: 1
model name\t: a second processor, never read
flags\t\t: fpu avx512_vnni
"""


@pytest.fixture
def fake_cpu(tmp_path, monkeypatch):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    monkeypatch.setattr(machine, "CPUINFO", path)
    monkeypatch.setattr(machine.platform, "machine", lambda: "x86_64")
    machine.cpu_info.cache_clear()
    yield path
    machine.cpu_info.cache_clear()


def test_the_cpu_is_read_from_its_first_processor(fake_cpu):
    assert machine.cpu_model() == "Intel(R) Xeon(R) Fake 9000 @ 2.00GHz"
    assert machine.cpu_flags() == {"fpu", "sse2", "avx2", "avx512f", "avx512bw", "avx512vl"}
    assert machine.cpu_has("avx512f", "avx512bw") and not machine.cpu_has("avx512_vnni")
    assert not machine.cpu_has("avx512")  # a whole flag, not the start of one
    assert not machine.cpu_has()


def test_no_cpuinfo_means_no_features_and_the_platforms_name(tmp_path, monkeypatch, fake_cpu):
    monkeypatch.setattr(machine, "CPUINFO", tmp_path / "absent")
    machine.cpu_info.cache_clear()
    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    assert machine.cpu_info() == {} and machine.cpu_model() == "x86_64" and machine.cpu_flags() == frozenset()


def test_other_architectures_report_no_x86_features(fake_cpu, monkeypatch):
    monkeypatch.setattr(machine.platform, "machine", lambda: "aarch64")
    assert machine.cpu_flags() == frozenset() and not machine.cpu_has("avx512f")


def test_the_cache_folder_is_gptlab_cache_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert machine.cache_root() == tmp_path / "mine"
    monkeypatch.setenv("GPTLAB_CACHE", "")  # empty is unset, never the current folder
    assert machine.cache_root() == tmp_path / "xdg" / "gptlab"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert machine.cache_root() == tmp_path / "home" / ".cache" / "gptlab"
    assert machine.cache_root() == Path.home() / ".cache" / "gptlab"


def test_without_a_compiler_missing_names_the_one_it_looked_for(monkeypatch, tmp_path):
    """Outside the fused tests, which skip (through `missing`) where it says something is missing."""
    monkeypatch.delenv("CXX", raising=False)
    assert (native.missing() is None) == (shutil.which("g++") is not None)
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on it
    assert native.missing() == "no g++ on PATH"
    monkeypatch.setenv("CXX", "clang++")
    assert native.missing() == "no clang++ on PATH"


def test_without_a_compiler_building_the_kernel_says_which_compiler_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on it
    monkeypatch.setenv("CXX", "clang++")
    with pytest.raises(native.KernelBuildError, match=r"^no clang\+\+ on PATH$"):
        native.build_library(native.SOURCE, tmp_path / "kernels", "plain")
    assert not (tmp_path / "kernels").exists()


def test_usable_cores_are_the_affinity_s_where_the_os_has_one_else_every_core(monkeypatch):
    from gptlab.machine import usable_cores

    if hasattr(os, "sched_getaffinity"):
        assert usable_cores() == len(os.sched_getaffinity(0))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # one core allowed of several
        assert usable_cores() == 1
        monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 7)  # macOS, Windows: no affinity call
    assert usable_cores() == 7
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # the count unknown
    assert usable_cores() == 1
