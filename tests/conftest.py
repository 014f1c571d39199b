import os

import pytest
import torch

from gptlab.config import ModelConfig
from gptlab.data import prepare

CORPUS = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\n"
    "All:\nResolved. resolved.\n\n"
) * 40


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _kernel_build_dir(tmp_path_factory):
    """The fused decode kernel (gptlab.fastdecode) is compiled once per test session, here, for every test and
    every CLI subprocess, never into the user's cache."""
    os.environ["GPTLAB_KERNELS"] = str(tmp_path_factory.mktemp("kernels"))


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


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    return ModelConfig(**{**base, **overrides})
