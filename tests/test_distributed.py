"""Data parallelism: N processes (torchrun, gloo on CPU) train exactly like one process with the same global batch,
and their checkpoints resume anywhere."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from gptlab import checkpoint as ck
from gptlab.cli import main
from gptlab.config import ModelConfig, TrainConfig
from gptlab.distributed import Parallel
from gptlab.errors import GptlabError
from gptlab.train import train

# fp32 and no dropout: the runs must differ by nothing but the order of floating-point sums. No biases: the key
# bias's true gradient is exactly 0, and Adam would blow its rounding noise up into lr-sized random updates.
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.0, bias=False)
SETTINGS = dict(batch_size=8, grad_accum=2, lr=3e-3, min_lr=3e-4, warmup_steps=2, lr_decay_steps=8, eval_interval=5,
                eval_batches=2, log_interval=1, precision="fp32", device="cpu")  # all that the CLI's preset sets


def flags(**settings) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in {**SHAPE, **SETTINGS, **settings}.items()]


def gptlab(*argv: str, launcher: tuple[str, ...] = ()) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *launcher, "-m", "gptlab", *argv], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def one_process(char_data, run, max_steps, resume=False):
    return train(char_data, run, ModelConfig(**SHAPE), TrainConfig(**{**SETTINGS, "max_steps": max_steps}),
                 resume=resume, quiet=True)


def steps(rows):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"]


def assert_same_steps(got, want):
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    for (_, loss, norm), (_, loss_1, norm_1) in zip(got, want):
        assert loss == pytest.approx(loss_1, rel=1e-5) and norm == pytest.approx(norm_1, rel=1e-5)


def assert_same_weights(run, run_1, step):
    """Every weight tensor within 1e-5 relative: |a - b| / |b| <= 1e-5 (norms over the tensor; summing in another
    order moves single near-zero elements further, relatively, and Adam passes that on)."""
    a = ck.load_tensors(ck.find_checkpoint(run, "step").path / "model.safetensors")
    b = ck.load_tensors(ck.find_checkpoint(run_1, "step").path / "model.safetensors")
    assert ck.find_checkpoint(run, "step").step == step and a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).norm() <= 1e-5 * b[name].norm(), name


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One process, 8 steps, checkpoints at 5 and 8: what every other run is compared with."""
    from conftest import CORPUS
    from gptlab.data import prepare

    root = tmp_path_factory.mktemp("dist")
    (root / "corpus.txt").write_text(CORPUS)
    prepare([str(root / "corpus.txt")], root / "data", "char", quiet=True)
    at5 = one_process(root / "data", root / "one-5", 5)
    at8 = one_process(root / "data", root / "one-8", 8)
    return root, at5, at8


def test_two_processes_train_like_one_and_their_checkpoint_resumes_in_one(straight):
    root, at5, at8 = straight
    gptlab("train", "--nproc", "2", "--data", str(root / "data"), "--run", str(root / "ddp"), "--max-steps=5",
           "--quiet", *flags())
    rows = [json.loads(line) for line in (root / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert_same_steps(steps(rows), steps(at5.history))
    assert_same_weights(root / "ddp", root / "one-5", 5)
    assert json.loads((root / "ddp" / "config.json").read_text())["processes"] == 2

    resumed = one_process(root / "data", root / "ddp", 8, resume=True)
    assert_same_steps(steps(resumed.history), steps(at8.history)[5:])
    assert_same_weights(root / "ddp", root / "one-8", 8)


def test_fsdp_under_torchrun_trains_like_one_process_and_its_checkpoints_resume_sharded_or_not(straight):
    root, at5, at8 = straight
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    gptlab("--", "train", "--data", str(root / "data"), "--run", str(root / "fsdp"), "--max-steps=5", "--quiet",
           "--fsdp", *flags(), launcher=torchrun)
    rows = [json.loads(line) for line in (root / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert_same_steps(steps(rows), steps(at5.history))
    assert_same_weights(root / "fsdp", root / "one-5", 5)  # unsharded: loads in one process, no FSDP
    optimizer = ck.load_tensors(ck.find_checkpoint(root / "fsdp", "step").path / "optimizer.safetensors")
    assert optimizer["0.exp_avg"].shape == ck.load_run(root / "fsdp").model.transformer.wte.weight.shape
    shutil.copytree(root / "fsdp", root / "fsdp-again")

    resumed = one_process(root / "data", root / "fsdp", 8, resume=True)
    assert_same_steps(steps(resumed.history), steps(at8.history)[5:])
    gptlab("--", "train", "--data", str(root / "data"), "--run", str(root / "fsdp-again"), "--max-steps=8",
           "--resume", "--quiet", "--fsdp", *flags(), launcher=torchrun)  # Adam's state cut into shards again
    assert_same_weights(root / "fsdp-again", root / "one-8", 8)


def test_rows_of_a_global_batch_are_shared_out_in_order():
    x = torch.arange(24).view(8, 3)
    shares = [Parallel(torch.device("cpu"), rank, 4).local_rows(x)[0] for rank in range(4)]
    assert all(s.shape == (2, 3) for s in shares) and torch.equal(torch.cat(shares), x)
    assert Parallel(torch.device("cpu")).local_rows(x)[0] is x
    with pytest.raises(GptlabError, match="batch_size 8 does not split across 3 processes"):
        Parallel(torch.device("cpu"), 0, 3).check_batch(8)


def test_restartable_torchrun_needs_a_fixed_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert main(["train", "--max-steps", "1"]) == 2
    assert "pass --run" in capsys.readouterr().err


def test_an_elastic_restart_resumes_from_the_last_checkpoint(tmp_path, monkeypatch, capsys, char_data):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--data", str(char_data), "--run", "run", "--quiet", *flags()]
    assert main([*argv, "--max-steps=5"]) == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # what torchrun sets when it restarts the workers
    assert main([*argv, "--max-steps=8"]) == 0
    out = capsys.readouterr().out
    assert "run run: 8 steps" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 9))  # continued, not restarted
