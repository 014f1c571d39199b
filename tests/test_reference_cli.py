"""The naive engine from the command line: `train --engine reference` makes an ordinary run (sample, eval, inspect,
export work on it) that resumes exactly and only on its engine; `sample --engine reference` gives the torch path's
tokens; `reference check` prints every tensor's differences; what the engine does not implement is refused in one
line."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import CORPUS, perturbed, run_bad, run_ok
from gptlab.checkpoint import load_run
from gptlab.config import ModelConfig, SampleConfig
from gptlab.model import GPT
from gptlab.reference.naive_training import naive_model
from gptlab.textstream import TextStream
from gptlab.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("reference_engine")
TEXT = CORPUS + "Ça va? Œuvre — naïve café, 日本語 ✓\n" * 20  # non-ASCII: several bytes a character
FLAGS = ["--n-layer", "2", "--n-head", "3", "--n-embd", "24", "--block-size", "16", "--batch-size", "3",
         "--grad-accum", "2", "--eval-interval", "4", "--eval-batches", "2", "--log-interval", "2", "--quiet",
         "--lr", "1e-2", "--warmup-steps", "2", "--lr-decay-steps", "8", "--dropout", "0.1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from gptlab.cli import main

    root = tmp_path_factory.mktemp("reference-data")
    (root / "corpus.txt").write_text(TEXT, encoding="utf-8")
    assert main(["prepare", str(root / "corpus.txt"), "--out", str(root / "data"), "--quiet"]) == 0
    return root / "data"


@pytest.fixture(scope="module")
def reference_run(data, tmp_path_factory):
    """A run of 8 steps by the naive engine, with dropout, accumulation and a warm-up."""
    from gptlab.cli import main

    run = tmp_path_factory.mktemp("reference-run") / "run"
    assert main(["train", "--data", str(data), "--run", str(run), "--engine", "reference", "--max-steps", "8",
                 *FLAGS]) == 0
    return run


def weights(run, step):
    return load_file(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors")


def test_a_reference_run_is_an_ordinary_run(reference_run, capsys, tmp_path):
    config = json.loads((reference_run / "config.json").read_text())
    assert config["train"]["engine"] == "reference" and config["precision"] == "fp32" and config["device"] == "cpu"
    assert run_ok(capsys, "sample", "--run", str(reference_run), "--max-new-tokens", "20", "--seed", "1").strip()
    assert "val" in run_ok(capsys, "eval", "--run", str(reference_run))
    assert "total               15,912" in run_ok(capsys, "inspect", "model", "--run", str(reference_run))
    run_ok(capsys, "export", str(reference_run), "--out", str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_reference_run_resumes_exactly(reference_run, data, tmp_path, capsys):
    """4 steps, then a resume to 8: the same weights as 8 in one go (dropout masks, batches and the schedule all
    continue where they were)."""
    run = tmp_path / "run"
    run_ok(capsys, "train", "--data", str(data), "--run", str(run), "--engine", "reference", "--max-steps", "4", *FLAGS)
    run_ok(capsys, "train", "--run", str(run), "--resume", "--max-steps", "8")
    resumed, straight = weights(run, 8), weights(reference_run, 8)
    assert resumed.keys() == straight.keys()
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name


def test_a_run_keeps_its_engine_on_resume(reference_run, data, tmp_path, capsys):
    line = run_bad(capsys, "train", "--run", str(reference_run), "--resume", "--max-steps", "9", "--engine", "torch")
    assert "trained with engine reference" in line and "drop --engine" in line
    run = tmp_path / "torch-run"
    run_ok(capsys, "train", "--data", str(data), "--run", str(run), "--max-steps", "2", *FLAGS)
    line = run_bad(capsys, "train", "--run", str(run), "--resume", "--max-steps", "3", "--engine", "reference")
    assert "trained with engine torch" in line


@pytest.mark.parametrize("flags,named", [(["--optimizer", "muon"], "optimizer muon"),
                                         (["--precision", "bf16"], "precision bf16"),
                                         (["--compile"], "compile"), (["--device", "cuda"], "device cuda"),
                                         (["--arch", "bigram"], "not arch bigram")])
def test_what_the_engine_does_not_implement_is_refused_in_one_line(flags, named, data, tmp_path, capsys):
    line = run_bad(capsys, "train", "--data", str(data), "--run", str(tmp_path / "r"), "--engine", "reference",
                   "--max-steps", "2", *FLAGS, *flags)
    assert named in line and "--engine torch" in line
    assert not (tmp_path / "r").exists()


def test_several_processes_are_refused_before_any_starts(data, tmp_path, capsys):
    line = run_bad(capsys, "train", "--data", str(data), "--run", str(tmp_path / "r"), "--engine", "reference",
                   "--max-steps", "2", *FLAGS, "--nproc", "3", "--batch-size", "6")
    assert "one process, not 3" in line and "--engine torch" in line
    assert not (tmp_path / "r").exists()


def test_sampling_with_the_reference_engine_gives_the_torch_paths_tokens(reference_run, capsys):
    """Greedy past the context (the window slides), from a non-ASCII prompt: the same text."""
    argv = ["sample", "--run", str(reference_run), "--prompt", "Œuvre — naïve", "--max-new-tokens", "40",
            "--temperature", "0"]
    naive = run_ok(capsys, *argv, "--engine", "reference")
    plain = run_ok(capsys, *argv, "--precision", "fp32")
    assert naive == plain and len(naive) > 40


def test_the_engine_decodes_batches_samples_and_windows_as_the_torch_path():
    """Two prompts of different lengths, two samples each, sampled with temperature, top-k and a penalty, past
    the context: token for token the torch model's (the engine's 'cache' holds ids, moved as keys and values
    are)."""
    torch.manual_seed(0)
    chars = sorted(set(TEXT))
    tokenizer = CharTokenizer(chars)
    plain = perturbed(GPT(ModelConfig(n_layer=2, n_embd=24, n_head=3, block_size=12,
                                      vocab_size=tokenizer.vocab_size))).eval()
    naive = naive_model(copy.deepcopy(plain)).eval()
    cfg = SampleConfig(max_new_tokens=30, temperature=0.9, top_k=20, repetition_penalty=1.3, seed=5)
    prompts = [tokenizer.encode("Ça"), tokenizer.encode("First Citizen: naïve")]
    texts = []
    for model in (plain, naive):
        stream = TextStream(model, tokenizer, prompts, cfg, 2)
        for _ in stream:
            pass
        texts.append([c.text for c in stream.completions])
    assert texts[0] == texts[1] and len(set(texts[0])) > 1


def test_reference_check_prints_every_tensor(reference_run, capsys):
    out = run_ok(capsys, "reference", "check", "--run", str(reference_run), "--precision", "fp64")
    rows = {line.split()[-3] if line.startswith("grad ") else line.split()[0]: line.split()[-2:]
            for line in out.splitlines()[2:-1]}
    model = load_run(reference_run).model
    assert set(rows) == {"logits", "loss"} | {name for name, _ in model.named_parameters()}
    assert all(float(rel) <= 1e-10 for _, rel in rows.values())
    assert out.splitlines()[-1].startswith("worst: ")


def test_reference_check_refuses_a_bigram(data, tmp_path, capsys):
    run_ok(capsys, "train", "--data", str(data), "--run", str(tmp_path / "b"), "--arch", "bigram", "--max-steps",
           "2", "--quiet", "--precision", "fp32", "--eval-interval", "2", "--eval-batches", "1")
    assert "implements the GPT alone" in run_bad(capsys, "reference", "check", "--run", str(tmp_path / "b"))
    assert "not the bigram" in run_bad(capsys, "sample", "--run", str(tmp_path / "b"), "--engine", "reference")


def test_reference_check_of_a_lora_run_checks_its_merged_model(reference_run, data, tmp_path, capsys):
    run_ok(capsys, "train", "--init-from", str(reference_run), "--data", str(data), "--run", str(tmp_path / "lo"),
           "--lora-rank", "2", "--max-steps", "2", "--batch-size", "2", "--eval-interval", "2", "--eval-batches",
           "1", "--precision", "fp32", "--lr", "1e-2", "--quiet")
    out = run_ok(capsys, "reference", "check", "--run", str(tmp_path / "lo"), "--precision", "fp64")
    assert "the LoRA adapters merged into the base" in out.splitlines()[0]
    rows = {line.split()[-3] if line.startswith("grad ") else line.split()[0]: line.split()[-2:]
            for line in out.splitlines()[2:-1]}
    model = load_run(tmp_path / "lo").model  # merged: every weight a plain one, every gradient compared
    assert set(rows) == {"logits", "loss"} | {name for name, _ in model.named_parameters()}
    assert all(float(rel) <= 1e-10 for _, rel in rows.values())
