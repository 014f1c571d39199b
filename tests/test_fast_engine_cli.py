"""The fast engine from the command line: `train --engine fast` makes an ordinary run whose losses are the naive
engine's on the same settings and whose checkpoint the torch path loads and computes alike; it resumes exactly and
only on its engine; `sample --engine fast` gives the torch path's tokens; what it does not implement is refused in
one line that names it, with nothing written."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import CORPUS, run_bad, run_ok, tree
from gptlab.checkpoint import load_run
from gptlab.config import ModelConfig, TrainConfig
from gptlab.errors import GptlabError
from gptlab.model import GPT
from gptlab.reference import library
from gptlab.reference.fast import FastGPT, draw_masks, fast_library, fast_model
from gptlab.reference.naive_gpt import NaiveGPT
from gptlab.training.preflight import check_engine

TEXT = CORPUS + "Ça va? Œuvre — naïve café, 日本語 ✓\n" * 20  # non-ASCII: several bytes a character
FLAGS = ["--n-layer", "2", "--n-head", "3", "--n-embd", "24", "--block-size", "16", "--batch-size", "3",
         "--grad-accum", "2", "--eval-interval", "4", "--eval-batches", "2", "--log-interval", "1", "--quiet",
         "--lr", "1e-2", "--warmup-steps", "2", "--lr-decay-steps", "8", "--dropout", "0.1", "--grad-clip", "0.5"]
AGREE = 1e-4  # the fast engine beside the naive one (or the torch path), in fp32: another order of the same sums
RESUMED = 1e-5  # the fast engine beside itself, a resume beside a run in one go


@pytest.fixture(scope="module", autouse=True)
def fast_engine():
    """The fast engine's top rung, built; skips only where there is no C++ compiler."""
    reason = library.missing()
    if reason is not None:
        pytest.skip(reason)
    return fast_library()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from gptlab.cli import main

    root = tmp_path_factory.mktemp("fast-data")
    (root / "corpus.txt").write_text(TEXT, encoding="utf-8")
    assert main(["prepare", str(root / "corpus.txt"), "--out", str(root / "data"), "--quiet"]) == 0
    return root / "data"


def train_run(data, root, engine, steps=8):
    from gptlab.cli import main

    run = root / f"{engine}-{steps}"
    assert main(["train", "--data", str(data), "--run", str(run), "--engine", engine, "--max-steps", str(steps),
                 *FLAGS]) == 0
    return run


@pytest.fixture(scope="module")
def fast_run(data, tmp_path_factory):
    """8 steps by the fast engine, with dropout, accumulation, clipping and a warm-up."""
    return train_run(data, tmp_path_factory.mktemp("fast-run"), "fast")


def fast_masks(self, B, T):
    """The naive engine's dropout masks drawn as the fast engine draws them (one seed from torch's generator, the
    engine's counter-based draws), so both engines train under the same masks."""
    if not (self.training and self.config.dropout > 0):
        return None
    return draw_masks(self, B, T, self.config.dropout, fast_library())


@pytest.fixture(scope="module")
def reference_run(data, tmp_path_factory):
    """The same 8 steps by the naive engine, under the fast engine's masks: what the fast one is held against."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NaiveGPT, "draw_masks", fast_masks)
        return train_run(data, tmp_path_factory.mktemp("reference-run"), "reference")


def metrics(run, kind):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if row["kind"] == kind}


def weights(run, step):
    return load_file(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors")


def test_a_fast_run_trains_as_the_naive_engine_does(fast_run, reference_run):
    """Every step's loss and gradient norm, every evaluation's losses and the final weights: the naive engine's
    on the same settings and under the same dropout masks."""
    config = json.loads((fast_run / "config.json").read_text())
    assert config["train"]["engine"] == "fast" and config["precision"] == "fp32" and config["device"] == "cpu"
    fast, naive = metrics(fast_run, "train"), metrics(reference_run, "train")
    assert sorted(fast) == sorted(naive) == list(range(1, 9))
    for step, row in naive.items():
        assert abs(fast[step]["loss"] - row["loss"]) <= AGREE, step
        assert abs(fast[step]["grad_norm"] - row["grad_norm"]) <= AGREE * row["grad_norm"], step
    fast, naive = metrics(fast_run, "eval"), metrics(reference_run, "eval")
    assert sorted(fast) == sorted(naive) == [4, 8]
    for step, row in naive.items():
        assert abs(fast[step]["val_loss"] - row["val_loss"]) <= AGREE, step
    mine, theirs = weights(fast_run, 8), weights(reference_run, 8)
    assert mine.keys() == theirs.keys()
    for name, expected in theirs.items():
        assert torch.allclose(mine[name], expected, rtol=0, atol=AGREE), name


def test_a_fast_runs_checkpoint_is_the_torch_paths(fast_run, capsys):
    """The run loads as a plain GPT whose logits on a batch of the run's text are the fast engine's; eval and
    the torch sampler read it."""
    loaded = load_run(fast_run, "step")  # the newest step checkpoint: step 8's
    assert type(loaded.model) is GPT
    state = loaded.model.state_dict()
    for name, saved in weights(fast_run, 8).items():
        assert torch.equal(state[name], saved), name
    idx = torch.tensor([loaded.tokenizer.encode(TEXT[:16]), loaded.tokenizer.encode(TEXT[-16:])])
    with torch.no_grad():
        expected, _ = loaded.model(idx)
        fast = fast_model(copy.deepcopy(loaded.model)).eval()
        assert isinstance(fast, FastGPT)
        logits, _ = fast(idx)
    assert torch.allclose(logits, expected, rtol=0, atol=AGREE)
    assert "val" in run_ok(capsys, "eval", "--run", str(fast_run))


def test_sampling_with_the_fast_engine_gives_the_torch_paths_tokens(fast_run, capsys):
    """Greedy past the context (the window slides), from a non-ASCII prompt: the torch path's text in fp32 and the
    naive engine's; sampling with temperature works on both engines' paths."""
    argv = ["sample", "--run", str(fast_run), "--prompt", "Œuvre — naïve", "--max-new-tokens", "40",
            "--temperature", "0"]
    fast = run_ok(capsys, *argv, "--engine", "fast")
    assert fast == run_ok(capsys, *argv, "--engine", "torch", "--precision", "fp32")
    assert fast == run_ok(capsys, *argv, "--engine", "reference")
    assert len(fast) > 40
    for engine in ("fast", "torch"):
        assert run_ok(capsys, "sample", "--run", str(fast_run), "--max-new-tokens", "20", "--seed", "1",
                      "--engine", engine).strip()


def test_a_fast_run_resumes_exactly(fast_run, data, tmp_path, capsys):
    """4 steps, then a resume to 8: the losses of 8 in one go (dropout masks, batches and the schedule all continue
    where they were)."""
    run = tmp_path / "run"
    run_ok(capsys, "train", "--data", str(data), "--run", str(run), "--engine", "fast", "--max-steps", "4", *FLAGS)
    run_ok(capsys, "train", "--run", str(run), "--resume", "--max-steps", "8")
    assert json.loads((run / "config.json").read_text())["train"]["engine"] == "fast"
    resumed, straight = metrics(run, "train"), metrics(fast_run, "train")
    assert sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):
        assert abs(resumed[step]["loss"] - straight[step]["loss"]) <= RESUMED, step
    assert abs(metrics(run, "eval")[8]["val_loss"] - metrics(fast_run, "eval")[8]["val_loss"]) <= RESUMED


def test_a_run_keeps_its_engine_on_resume(fast_run, data, tmp_path, capsys):
    """A resume continues on the engine the run started with: fast to torch or reference, and torch to fast, are
    refused in one line, the run left as it was."""
    before = tree(fast_run)
    for other in ("torch", "reference"):
        line = run_bad(capsys, "train", "--run", str(fast_run), "--resume", "--max-steps", "9", "--engine", other)
        assert f"with engine {other}: it was trained with engine fast" in line and "drop --engine" in line
    assert tree(fast_run) == before
    run = tmp_path / "torch-run"
    run_ok(capsys, "train", "--data", str(data), "--run", str(run), "--max-steps", "2", *FLAGS)
    before = tree(run)
    line = run_bad(capsys, "train", "--run", str(run), "--resume", "--max-steps", "3", "--engine", "fast")
    assert "with engine fast: it was trained with engine torch" in line
    assert tree(run) == before


@pytest.mark.parametrize("flags,named", [(["--optimizer", "muon"], "does not implement optimizer muon"),
                                         (["--precision", "bf16"], "does not implement precision bf16"),
                                         (["--compile"], "does not implement compile"),
                                         (["--device", "cuda"], "does not implement device cuda"),
                                         (["--fsdp"], "does not implement fsdp"),
                                         (["--activation-checkpointing"], "does not implement activation"),
                                         (["--arch", "bigram"], "implements the GPT, not arch bigram"),
                                         (["--nproc", "3", "--batch-size", "6"], "trains in one process, not 3")])
def test_what_the_fast_engine_does_not_implement_is_refused_in_one_line(flags, named, data, tmp_path, capsys):
    line = run_bad(capsys, "train", "--data", str(data), "--run", str(tmp_path / "r"), "--engine", "fast",
                   "--max-steps", "2", *FLAGS, *flags)
    assert f"the fast engine {named}" in line and "--engine torch" in line and "reference" not in line
    assert not (tmp_path / "r").exists()


def test_lora_is_refused_by_the_fast_engine(fast_run, data, tmp_path, capsys):
    line = run_bad(capsys, "train", "--init-from", str(fast_run), "--data", str(data), "--run", str(tmp_path / "lo"),
                   "--engine", "fast", "--lora-rank", "2", "--max-steps", "2", "--quiet")
    assert "the fast engine trains every weight" in line and "--engine torch" in line
    assert not (tmp_path / "lo").exists()


def test_several_processes_are_refused_by_the_preflight():
    """check_engine itself, as each process of a torchrun job would call it."""
    model_cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=30)
    check_engine(TrainConfig(engine="fast"), model_cfg, 1)
    with pytest.raises(GptlabError, match=r"^the fast engine trains in one process, not 2; .*--engine torch$"):
        check_engine(TrainConfig(engine="fast"), model_cfg, 2)
    with pytest.raises(GptlabError, match=r"^the fast engine implements the GPT, not arch bigram"):
        check_engine(TrainConfig(engine="fast"), ModelConfig(arch="bigram", vocab_size=30), 1)


@pytest.mark.parametrize("flags", [["--precision", "bf16"], ["--precision", "int8"], ["--device", "cuda"]])
def test_sampling_with_the_fast_engine_refuses_another_precision_or_device(fast_run, flags, capsys):
    line = run_bad(capsys, "sample", "--run", str(fast_run), "--engine", "fast", "--max-new-tokens", "5", *flags)
    assert "the fast engine decodes in fp32 on the CPU" in line and "--engine torch" in line


def test_sampling_a_bigram_with_the_fast_engine_is_refused(data, tmp_path, capsys):
    run_ok(capsys, "train", "--data", str(data), "--run", str(tmp_path / "b"), "--arch", "bigram", "--max-steps",
           "2", "--quiet", "--precision", "fp32", "--eval-interval", "2", "--eval-batches", "1")
    line = run_bad(capsys, "sample", "--run", str(tmp_path / "b"), "--engine", "fast")
    assert "the fast engine implements the GPT, not the bigram" in line
