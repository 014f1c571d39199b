"""The measured peak's one file: named by the device in the cache folder, written in one step, read back as the
schema says (a file of an earlier version too), refused as None when damaged; and MFU held against it."""

import json
import os

import pytest
import torch

from gptlab import peak as peaks
from gptlab import runtime
from gptlab.peak import Peak, Speed, cached_speed, peak_file, read_peak, write_peak

CPU = torch.device("cpu")


@pytest.fixture
def named_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(runtime, "cpu_model", lambda: "Fake CPU 9000")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "peak-cpu-Fake_CPU_9000__2_threads_.json"


def test_the_peak_file_is_named_by_the_device_in_the_cache_folder(named_cpu):
    assert peak_file(CPU) == named_cpu


def test_a_peak_written_by_an_earlier_version_reads_back(named_cpu):
    named_cpu.parent.mkdir(parents=True)
    named_cpu.write_text(json.dumps({"device": "Fake CPU 9000 (2 threads)", "fp32": 2.5e11, "bf16": 5e11,
                                     "read_bytes_per_s": 1.2e10, "torch": "2.13.0", "measured_at": "2026-12-01 10:00:00",
                                     "load": "machine load: quiet", "from a later version": 1}))
    assert read_peak(CPU) == Peak(2.5e11, "Fake CPU 9000 (2 threads)", None, 5e11, 1.2e10, "2.13.0",
                                  "2026-12-01 10:00:00", "machine load: quiet")
    assert read_peak(CPU).flops("bf16") == 5e11 and read_peak(CPU).flops("fp32") == 2.5e11


def test_a_peak_is_written_in_one_step_in_the_earlier_versions_keys(named_cpu):
    assert write_peak(CPU, Peak(1e9, "d", torch_version="2.13.0"))
    assert json.loads(named_cpu.read_text()) == {"fp32": 1e9, "device": "d", "torch": "2.13.0", "measured_at": "",
                                                 "load": ""}
    assert write_peak(CPU, Peak(2e9)) and read_peak(CPU).fp32 == 2e9
    assert os.listdir(named_cpu.parent) == [named_cpu.name]  # replaced, no temporary file left


@pytest.mark.parametrize("text", ["{", "[1, 2]", '{"bf16": 1e9}', '{"fp32": "fast"}', '{"fp32": 0}',
                                  '{"fp32": 1e9, "bf16": -1}', '{"fp32": true}'])
def test_a_damaged_or_foreign_peak_file_reads_as_never_measured(named_cpu, text):
    named_cpu.parent.mkdir(parents=True)
    named_cpu.write_text(text)
    assert read_peak(CPU) is None and cached_speed(CPU, "fp32", 10, 1.0).peak_flops is None


def test_a_cache_folder_that_cannot_be_written_is_no_error(named_cpu):
    named_cpu.parent.parent.mkdir(parents=True, exist_ok=True)
    named_cpu.parent.write_text("a file where the folder would be")
    assert not write_peak(CPU, Peak(1e9)) and read_peak(CPU) is None


def test_mfu_is_the_models_flops_per_second_over_every_processs_peak(named_cpu):
    write_peak(CPU, Peak(1e9, bf16=4e9))
    speed = cached_speed(CPU, "bf16", tokens_per_step=100, flops_per_token=2e6, world_size=2)
    assert speed.peak_flops == 8e9  # two processes, each a bf16 peak of 4e9
    assert speed.report(steps=10, seconds=2.0) == {"tokens_per_s": 500.0, "mfu": 0.125}  # 500 x 2e6 / 8e9
    assert Speed(100, 2e6).report(10, 2.0) == {"tokens_per_s": 500.0}
    assert peaks.peak_key("auto") == "fp32" and peaks.peak_key("bf16") == "bf16"
