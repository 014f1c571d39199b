"""Training that survives faults: exact resume across processes, crashes, signals, NaNs, corrupt files."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import inject_nan_at

from gptlab import checkpoint as ck
from gptlab.cli import main
from gptlab.model import GPT

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-interval", "4", "--eval-batches", "2", "--log-interval", "1", "--precision", "fp32",
        "--dropout", "0.1", "--lr-decay-steps", "12", "--quiet"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
SLOW_WRITER = """
import sys, time
import gptlab.checkpoint as ck
save = ck.save_file
def slow(tensors, path, *args, **kwargs):
    save(tensors, path, *args, **kwargs)
    if "{marker}" in str(path):
        time.sleep(60)
ck.save_file = slow
from gptlab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def gptlab(*argv, script=None):
    code = ["-c", script] if script else ["-m", "gptlab"]
    return subprocess.run([sys.executable, *code, *argv], capture_output=True, text=True, env=ENV, timeout=300)


def weights(run):
    return ck.load_run(run, which="last").model.state_dict()


def same_weights(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def train_losses(run):
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


@pytest.fixture
def straight(tmp_path, char_data):
    """A 12-step run in one go: the reference every interrupted run must reproduce exactly."""
    assert main(["train", "--data", str(char_data), "--run", str(tmp_path / "straight"), "--max-steps", "12",
                 *TINY]) == 0
    return tmp_path / "straight"


def test_resume_in_a_new_process_is_bit_exact(tmp_path, char_data, straight):
    run = tmp_path / "resumed"
    assert gptlab("train", "--data", str(char_data), "--run", str(run), "--max-steps", "6", *TINY).returncode == 0
    state6 = ck.read_state(ck.find_checkpoint(run))
    proc = gptlab("train", "--data", str(char_data), "--run", str(run), "--max-steps", "12", "--resume", *TINY)
    assert proc.returncode == 0, proc.stderr
    assert same_weights(weights(straight), weights(run))
    assert train_losses(straight) == train_losses(run)
    assert state6.sampler == {"seed": 1337, "next_step": 6}  # the next batch is drawn from (seed, step 6)
    assert json.loads((run / "config.json").read_text())["resumes"][0]["step"] == 6


def test_sigkill_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path, char_data, straight):
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER.format(marker="step-00000008"), "train", "--data",
                             str(char_data), "--run", str(run), "--max-steps", "12", *TINY], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list((run / "checkpoints").glob(".tmp-step-00000008-*/model.safetensors")):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert ck.find_checkpoint(run).step == 4
    assert ck.load_run(run, which="last").checkpoint.step == 4
    resumed = gptlab("train", "--data", str(char_data), "--run", str(run), "--max-steps", "12", "--resume", *TINY)
    assert resumed.returncode == 0, resumed.stderr
    assert same_weights(weights(straight), weights(run))
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_sigterm_writes_a_checkpoint_exits_143_and_resumes_exactly(tmp_path, char_data):
    run = tmp_path / "term"
    flags = [*TINY, "--lr-decay-steps", "400", "--eval-interval", "1000"]
    proc = subprocess.Popen([sys.executable, "-m", "gptlab", "train", "--data", str(char_data), "--run", str(run),
                             "--max-steps", "400", *flags], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").exists() or len(train_losses(run)) < 3:
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143
    assert err.strip().splitlines()[-1].startswith("gptlab: stopped by SIGTERM at step")  # a stop, not an error
    assert f"resume with: gptlab train --run {run} --resume" in err  # no --data: the run remembers its data
    stopped = ck.find_checkpoint(run).step
    assert 3 <= stopped < 400
    target = str(stopped + 3)
    assert main(["train", "--run", str(run), "--resume", "--max-steps", target, "--quiet"]) == 0  # as printed
    assert main(["train", "--data", str(char_data), "--run", str(tmp_path / "ref"), "--max-steps", target,
                 *flags]) == 0
    assert same_weights(weights(tmp_path / "ref"), weights(run))


def test_a_nan_loss_stops_before_the_weights_change(tmp_path, char_data, monkeypatch, capsys):
    assert main(["train", "--data", str(char_data), "--run", str(tmp_path / "ref"), "--max-steps", "5",
                 *TINY]) == 0
    run = tmp_path / "nan"
    seen = inject_nan_at(monkeypatch, step=6)
    capsys.readouterr()
    assert main(["train", "--data", str(char_data), "--run", str(run), "--max-steps", "12", *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 6: the loss (nan)" in err[0] and "not applied" in err[0]
    assert "the last good checkpoint is" in err[0] and err[0].split("checkpoint is ")[1].startswith(
        str(run / "checkpoints" / "step-00000004"))
    after_5 = ck.load_run(tmp_path / "ref", which="last").model.state_dict()
    assert same_weights(after_5, seen["model"].state_dict())  # step 6 changed nothing
    assert ck.find_checkpoint(run).step == 4 and ck.verify(ck.find_checkpoint(run).path) is None


def test_a_nan_loss_through_the_cli_is_one_line(tmp_path, char_data, monkeypatch, capsys):
    inject_nan_at(monkeypatch, step=2)
    code = main(["train", "--data", str(char_data), "--run", str(tmp_path / "r"), "--max-steps", "12", *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "lower --lr" in err[0] and "no checkpoint was written yet" in err[0]


def test_loss_spike_guard_stops_after_k_spikes(tmp_path, char_data, monkeypatch, capsys):
    forward, calls = GPT.forward, [0]

    def spiky(self, idx, targets=None, **kwargs):
        logits, loss = forward(self, idx, targets, **kwargs)
        if self.training and targets is not None:
            calls[0] += 1
            if calls[0] > 15:
                loss = loss * 10
        return logits, loss

    monkeypatch.setattr(GPT, "forward", spiky)
    code = main(["train", "--data", str(char_data), "--run", str(tmp_path / "r"), "--max-steps", "40",
                 "--spike-factor", "3", "--spike-patience", "2", *TINY])
    err = capsys.readouterr().err
    assert code == 2 and "step 17:" in err and "for 2 steps" in err


def damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "bitflip"])
def test_damaged_weights_fall_back_to_the_previous_checkpoint(straight, how, caplog):
    newest = ck.find_checkpoint(straight)
    damage(newest.path / "model.safetensors", how)
    assert ck.find_checkpoint(straight).step == 8
    assert "unusable" in caplog.text and ("truncated" in caplog.text or "checksum" in caplog.text)
    for ckpt in ck.list_checkpoints(straight, "step") + ck.list_checkpoints(straight, "best"):
        if ckpt.path != newest.path:
            damage(ckpt.path / "model.safetensors", how)
    with pytest.raises(ck.GptlabError, match="no usable checkpoint.*damaged"):
        ck.load_run(straight)


def test_missing_manifest_means_unfinished(straight):
    (ck.find_checkpoint(straight).path / "manifest.json").unlink()
    assert ck.find_checkpoint(straight).step == 8


def test_a_tokenizer_that_does_not_match_the_weights_is_refused(straight, capsys):
    tok = json.loads((straight / "tokenizer.json").read_text())
    tok["chars"] = tok["chars"][:-1]
    (straight / "tokenizer.json").write_text(json.dumps(tok))
    assert main(["sample", "--run", str(straight), "--max-new-tokens", "3"]) == 2
    assert "is not the tokenizer the weights" in capsys.readouterr().err


def test_a_run_with_checkpoints_is_never_overwritten_without_resume(straight, char_data, capsys):
    before = {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()}
    assert main(["train", "--data", str(char_data), "--run", str(straight), "--max-steps", "3", *TINY]) == 2
    assert "already has checkpoints" in capsys.readouterr().err
    assert before == {p: p.read_bytes() for p in straight.rglob("*") if p.is_file()}


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(straight, char_data, monkeypatch, capsys):
    before = ck.find_checkpoint(straight)
    files = {p: p.read_bytes() for p in before.path.iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "save_file", full)
    code = main(["train", "--data", str(char_data), "--run", str(straight), "--max-steps", "16", "--resume", *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0]
    assert ck.find_checkpoint(straight).step == 12
    assert files == {p: p.read_bytes() for p in before.path.iterdir()}
    assert not list((straight / "checkpoints").glob(".tmp-*"))


def test_a_second_ctrl_c_stops_at_once_without_corrupting_anything(tmp_path, char_data):
    run = tmp_path / "twice"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER.format(marker="step-00000004"), "train", "--data",
                             str(char_data), "--run", str(run), "--max-steps", "12", *TINY, "--eval-interval", "2"],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list((run / "checkpoints").glob(".tmp-step-00000004-*/model.safetensors")):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # the first one waits for the (slow) step to finish ...
    time.sleep(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)  # ... the second one does not
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "stopped at once by a second SIGINT" in err
    assert ck.find_checkpoint(run).step == 2 and ck.load_run(run, which="last").checkpoint.step == 2


def test_out_of_memory_suggests_a_smaller_micro_batch(tmp_path, char_data, monkeypatch, capsys):
    import gptlab.training.train

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(gptlab.training.train, "train_step", oom)
    code = main(["train", "--data", str(char_data), "--run", str(tmp_path / "r"), "--max-steps", "12", *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "out of memory" in err[0] and "--batch-size 2 --grad-accum 2" in err[0]
