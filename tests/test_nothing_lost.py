"""No command loses or silently corrupts work: refused resumes change nothing, a run remembers its data, one
writer per run folder, a full disk leaves everything as it was, pruning never keeps a damaged checkpoint in place
of a valid one, and data is scored only with the tokenizer it was made with. (Bad input in general: test_sweep.)"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import SafetensorError

import gptlab.checkpoint as ck
import gptlab.rundir as rundir
import gptlab.data
import gptlab.tokenfiles
import gptlab.hf
from gptlab.cli import main
from test_sweep import TINY, tree

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}


@pytest.fixture
def trained(tmp_path, char_data):
    """A 10-step run trained with --data (checkpoints at steps 5 and 10), in a folder of its own."""
    run = tmp_path / "runs" / "r"
    assert main(["train", "--data", str(char_data), "--run", str(run), "--max-steps", "10", *TINY]) == 0
    return run


def steps(run):
    return sorted(c.step for c in ck.list_checkpoints(run, "step"))


def test_a_refused_resume_leaves_the_run_resumable(trained, char_data, tmp_path, capsys):
    other = tmp_path / "other"
    gptlab.data.prepare([str(tmp_path / "corpus.txt")], other, "bpe", vocab_size=300, quiet=True)
    before = tree(trained)
    assert main(["train", "--run", str(trained), "--resume", "--n-layer", "3"]) == 2
    assert main(["train", "--run", str(trained), "--resume", "--data", str(other)]) == 2  # a larger vocabulary
    assert tree(trained) == before  # config.json and tokenizer.json included
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "n_layer=1 (now 3)" in err[0]
    assert f"it was trained on different data than {other}" in err[1] and "--vocab-size" not in err[1]  # not given
    assert main(["train", "--run", str(trained), "--resume", "--max-steps", "15"]) == 0
    assert steps(trained)[-1] == 15
    for verb in (["sample", "--run", str(trained), "--max-new-tokens", "5"], ["eval", "--run", str(trained)],
                 ["export", str(trained), "--out", str(tmp_path / "hf")]):
        assert main(verb) == 0


def test_a_run_resumes_and_evaluates_on_its_own_data_from_any_folder(trained, char_data, tmp_path, monkeypatch,
                                                                    capsys):
    config = json.loads((trained / "config.json").read_text())
    assert config["data"] == str(char_data.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no data/ here: the bundled corpus must not be prepared, nor used
    assert main(["train", "--run", str(trained), "--resume", "--max-steps", "12"]) == 0
    assert main(["eval", "--run", str(trained)]) == 0
    assert "data/tinyshakespeare" not in capsys.readouterr().out and not (elsewhere / "data").exists()
    assert steps(trained)[-1] == 12


def test_every_resume_is_kept_in_the_history(trained):
    for max_steps in ("12", "14"):
        assert main(["train", "--run", str(trained), "--resume", "--max-steps", max_steps]) == 0
    resumes = json.loads((trained / "config.json").read_text())["resumes"]
    assert [r["step"] for r in resumes] == [10, 12]
    assert resumes[0]["changes"] == {"max_steps": [10, 12]}


def test_pruning_keeps_valid_checkpoints_not_damaged_ones(trained, caplog):
    newest = trained / "checkpoints" / "step-00000010" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated: the resume falls back to step 5
    assert main(["train", "--run", str(trained), "--resume", "--max-steps", "7", "--eval-interval", "3"]) == 0
    assert "falling back to an older one" in caplog.text
    valid = [c.step for c in ck.list_checkpoints(trained, "step") if ck.verify(c.path) is None]
    assert valid == [7, 6]  # --keep-last 2 valid ones; the damaged step 10 never counted


def test_no_older_checkpoint_left_is_said_so(trained, caplog):
    for ckpt in ck.list_checkpoints(trained, "step"):
        (ckpt.path / "manifest.json").unlink()
    assert ck.find_checkpoint(trained, "step") is None
    assert "falling back to an older one" in caplog.text  # step 10 -> step 5
    assert caplog.records[-1].getMessage().endswith("no older step checkpoint is left")


def test_a_new_run_never_starts_over_best_checkpoints_alone(trained, char_data, capsys):
    for c in ck.list_checkpoints(trained, "step"):
        shutil.rmtree(c.path)  # pruned by hand, say: the best weights are all that is left of the work
    before = tree(trained)
    assert main(["train", "--data", str(char_data), "--run", str(trained), "--max-steps", "3", *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"run {trained} already has checkpoints; pass --resume" in err[0]
    assert tree(trained) == before


def test_export_and_prepare_never_write_over_a_run_or_data(trained, char_data, capsys):
    before = tree(trained.parent.parent)
    assert main(["export", str(trained), "--out", str(trained)]) == 2
    assert main(["export", str(trained), "--out", str(char_data)]) == 2
    assert main(["prepare", "--out", str(trained), "--quiet"]) == 2
    assert tree(trained.parent.parent) == before


def test_eval_refuses_data_made_with_another_tokenizer(trained, tmp_path, capsys):
    (tmp_path / "more.txt").write_text("Speak, speak. All resolved.\n" * 50)
    other = tmp_path / "other"
    assert main(["prepare", str(tmp_path / "more.txt"), "--out", str(other), "--quiet"]) == 0  # its own vocabulary
    assert main(["eval", "--run", str(trained), "--data", str(other)]) == 2
    assert "another tokenizer" in capsys.readouterr().err
    same = tmp_path / "same"  # the run's own tokenizer: scored
    assert main(["prepare", str(tmp_path / "more.txt"), "--out", str(same), "--tokenizer-from", str(trained),
                 "--quiet"]) == 0
    assert main(["eval", "--run", str(trained), "--data", str(same)]) == 0


# ---- a full disk ---------------------------------------------------------------------------------------------

def full(*args, **kwargs):
    raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space "
                          "left on device\" })")


def test_a_full_disk_during_training_keeps_the_previous_checkpoint(trained, monkeypatch, capsys):
    monkeypatch.setattr(ck, "save_file", full)
    assert main(["train", "--run", str(trained), "--resume", "--max-steps", "15", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write a checkpoint" in err[0] and "previous checkpoint is intact" in err[0]
    assert not list((trained / "checkpoints").glob(".tmp-*"))
    assert ck.find_checkpoint(trained, "step").step == 10


def test_a_full_disk_during_export_is_one_line_and_leaves_no_temporary_file(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gptlab.hf, "save_file", full)
    assert main(["export", str(trained), "--out", str(tmp_path / "hf")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_full_disk_during_prepare_changes_nothing(char_data, corpus_file, tmp_path, monkeypatch, capsys):
    def no_space(self, ids):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gptlab.tokenfiles.TokenWriter, "write", no_space)
    before = tree(char_data)
    assert main(["prepare", str(corpus_file), "--out", str(char_data), "--quiet"]) == 2  # over a prepared folder
    assert main(["prepare", str(corpus_file), "--out", str(tmp_path / "new"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("No space left on device" in line for line in err)
    assert tree(char_data) == before and not (tmp_path / "new").exists()


# ---- one writer per run folder -----------------------------------------------------------------------------

def start_training(data, run, steps="100000", eval_interval="100000"):
    return subprocess.Popen([sys.executable, "-m", "gptlab", "train", "--data", str(data), "--run", str(run),
                             "--max-steps", steps, *TINY, "--eval-interval", eval_interval],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(run, proc, n=3):
    deadline = time.time() + 120
    while not (run / rundir.METRICS).exists() or len((run / rundir.METRICS).read_text().splitlines()) < n:
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.05)


def test_a_second_writer_is_refused_and_the_first_finishes(char_data, tmp_path, capsys):
    run = tmp_path / "busy"
    first = start_training(char_data, run, steps="400", eval_interval="20")
    wait_for_steps(run, first, n=6)  # a checkpoint at step 20 is there
    before = (run / "config.json").read_bytes()
    assert main(["train", "--data", str(char_data), "--run", str(run), "--resume", *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"run {run} is being written by `gptlab train" in err[0], err
    assert f"pid {first.pid}" in err[0]
    assert main(["sample", "--run", str(run), "--max-new-tokens", "3"]) == 0  # readers are never refused
    assert first.wait(timeout=300) == 0, first.stderr.read()
    assert (run / "config.json").read_bytes() == before and steps(run)[-1] == 400


def test_kill_9_of_the_writer_frees_the_run_at_once(char_data, tmp_path, capsys):
    run = tmp_path / "killed"
    first = start_training(char_data, run)
    wait_for_steps(run, first)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    # no stale lock: the next writer takes the folder at once (it starts over: no checkpoint was written)
    assert main(["train", "--data", str(char_data), "--run", str(run), "--max-steps", "5", *TINY]) == 0
