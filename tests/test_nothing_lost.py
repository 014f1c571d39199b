"""No command loses or silently corrupts work: refused resumes change nothing, a run remembers its data, one
writer per run folder, a full disk leaves everything as it was, pruning never keeps a damaged checkpoint in place
of a valid one, and data is scored only with the tokenizer it was made with. (Bad input in general: test_sweep.)"""

import dataclasses
import datetime
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from helpers import CORPUS, TINY, tree
from safetensors import SafetensorError

import gptlab
import gptlab.checkpoint as ck
import gptlab.data.tokenfiles
import gptlab.hf.gpt2_folders
from gptlab import rundir
from gptlab.cli import main
from gptlab.config import ModelConfig, TrainConfig, from_dict, to_dict
from gptlab.data.batches import load_dataset
from gptlab.data.prepare import prepare
from gptlab.errors import GptlabError
from gptlab.training.preflight import check_data, check_engine, check_memory, check_new_run, check_resume

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
    prepare([str(tmp_path / "corpus.txt")], other, "bpe", vocab_size=300, quiet=True)
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
    for flags in (["--max-steps", "12"], ["--max-steps", "14", "--dropout", "0.1"]):
        assert main(["train", "--run", str(trained), "--resume", *flags]) == 0
    config = json.loads((trained / "config.json").read_text())
    assert [r["step"] for r in config["resumes"]] == [10, 12]
    assert config["resumes"][0]["changes"] == {"max_steps": [10, 12]}
    assert config["resumes"][1]["changes"] == {"dropout": [0.0, 0.1], "max_steps": [12, 14]}
    assert (config["model"]["dropout"], config["train"]["max_steps"]) == (0.1, 14)  # the settings now in force


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
    monkeypatch.setattr(gptlab.hf.gpt2_folders, "save_file", full)
    assert main(["export", str(trained), "--out", str(tmp_path / "hf")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_full_disk_during_prepare_changes_nothing(char_data, corpus_file, tmp_path, monkeypatch, capsys):
    def no_space(self, ids):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gptlab.data.tokenfiles.TokenWriter, "write", no_space)
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


# ---- what training checks before it writes anything (gptlab.training.preflight, called directly) ---------------------

def run_settings(run):
    config = json.loads((run / rundir.CONFIG).read_text())
    return from_dict(ModelConfig, config["model"]), from_dict(TrainConfig, config["train"])


def test_each_split_needs_a_block_and_one_token_more_and_the_vocabulary_the_tokenizer_has(char_data):
    data = load_dataset(char_data)
    chars = len(set(CORPUS))  # the char tokenizer's vocabulary: one id per distinct character
    model_cfg = ModelConfig(vocab_size=chars, block_size=16, n_layer=1, n_head=2, n_embd=16)
    check_data(dataclasses.replace(data, train=data.train[:17], val=data.val[:17]), model_cfg)  # 16 + 1: enough
    with pytest.raises(GptlabError, match=f"the training split of {char_data} has 16 tokens, fewer than block_size "
                                          r"\+ 1 = 17;"):
        check_data(dataclasses.replace(data, train=data.train[:16]), model_cfg)
    with pytest.raises(GptlabError, match=f"the validation split of {char_data} has 16 tokens, fewer than"):
        check_data(dataclasses.replace(data, val=data.val[:16]), model_cfg)
    with pytest.raises(GptlabError, match=f"vocab_size {chars - 1} is smaller than the tokenizer's {chars}; drop"):
        check_data(data, dataclasses.replace(model_cfg, vocab_size=chars - 1))


def fake_memory(monkeypatch, total, page=4096):
    """This machine with `total` bytes of memory (a multiple of `page`), as os.sysconf and CUDA report it."""
    real = os.sysconf
    sizes = {"SC_PAGE_SIZE": page, "SC_PHYS_PAGES": total // page}
    monkeypatch.setattr(os, "sysconf", lambda name: sizes[name] if name in sizes else real(name))

    def properties(device):
        assert isinstance(device, torch.device) and device.type == "cuda", device
        return types.SimpleNamespace(total_memory=total)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)


BIGRAM = ModelConfig(arch="bigram", vocab_size=15_000)  # a V x V table: 225,000,000 parameters


def test_a_model_whose_weights_and_adamw_state_exceed_memory_is_refused(monkeypatch):
    cfg = TrainConfig(batch_size=1)
    fake_memory(monkeypatch, 3 * 2**30)
    # 225e6 x 16 bytes = 3.6e9 bytes = 3.35 GiB, more than 3 GiB
    for device in (torch.device("cpu"), torch.device("cuda")):
        with pytest.raises(GptlabError, match=f"this model has 225,000,000 parameters: training it needs about 3 GiB "
                                              f"for its weights, gradients and AdamW state, more than the 3 GiB of "
                                              f"this {device.type}; choose"):
            check_memory(BIGRAM, cfg, device, 1)
    check_memory(BIGRAM, cfg, torch.device("mps"), 1)  # a device whose memory is not known is not refused
    fake_memory(monkeypatch, 225_000_000 * 16, page=16)  # exactly enough
    check_memory(BIGRAM, cfg, torch.device("cpu"), 1)


def test_a_micro_batch_whose_logits_exceed_memory_is_refused(monkeypatch):
    model_cfg = ModelConfig(vocab_size=65_536, block_size=1024, n_layer=1, n_head=2, n_embd=16)  # 1,068,272 params
    fake_memory(monkeypatch, 3 * 2**30)
    # 8 rows x 1024 positions x 65536 entries x 8 bytes = 2**32 bytes = 4 GiB
    with pytest.raises(GptlabError, match="a micro-batch of 8 x 1024 positions needs 4 GiB for its logits alone, "
                                          "more than the 3 GiB of this cpu; use a smaller --batch-size"):
        check_memory(model_cfg, TrainConfig(batch_size=16), torch.device("cpu"), 2)
    fake_memory(monkeypatch, 2**29)  # 6 rows over 4 processes: 1 row each, 1 x 1024 x 65536 x 8 = 2**29 bytes
    check_memory(model_cfg, TrainConfig(batch_size=6), torch.device("cpu"), 4)
    with pytest.raises(GptlabError, match=r"2 GiB for its logits alone.*, or --loss-chunk"):
        check_memory(model_cfg, TrainConfig(batch_size=16, loss_chunk=4096), torch.device("cpu"), 4)
    check_memory(model_cfg, TrainConfig(batch_size=16, loss_chunk=1024), torch.device("cpu"), 4)  # one chunk's


def test_a_new_run_never_starts_over_data_another_programs_model_or_step_checkpoints(trained, char_data, tmp_path):
    check_new_run(tmp_path / "fresh")
    with pytest.raises(GptlabError, match="is a prepared data folder; training into it would overwrite"):
        check_new_run(char_data)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(GptlabError, match="holds a config.json that is not a gptlab run's"):
        check_new_run(hf)
    for c in ck.list_checkpoints(trained, "best"):
        shutil.rmtree(c.path)  # step checkpoints alone are work to keep too
    with pytest.raises(GptlabError, match=f"run {trained} already has checkpoints"):
        check_new_run(trained)


def test_a_resume_names_every_shape_setting_that_differs(trained, capsys):
    assert main(["train", "--run", str(trained), "--resume", "--n-layer", "2", "--n-embd", "32"]) == 2
    assert "it was trained with n_layer=1 (now 2), n_embd=16 (now 32); drop" in capsys.readouterr().err


def test_a_resume_with_nothing_left_to_train_is_refused(trained, capsys):
    before = tree(trained)
    assert main(["train", "--run", str(trained), "--resume", "--max-steps", "10"]) == 2
    assert (f"run {trained} has already trained 10 steps and max_steps is 10: nothing to do"
            in capsys.readouterr().err)
    assert tree(trained) == before


def test_a_run_without_a_step_checkpoint_cannot_be_resumed(trained, char_data):
    model_cfg, cfg = run_settings(trained)
    for c in ck.list_checkpoints(trained, "step"):
        shutil.rmtree(c.path)
    with pytest.raises(GptlabError, match=f"run {trained} has no checkpoint to resume from; drop --resume"):
        check_resume(trained, load_dataset(char_data), model_cfg, cfg)


def test_a_resume_keeps_the_optimizer_the_run_was_trained_with(trained, char_data, tmp_path, monkeypatch):
    model_cfg, cfg = run_settings(trained)
    data = load_dataset(char_data)
    with pytest.raises(GptlabError, match=f"cannot resume {trained} with optimizer muon: it was trained with adamw, "
                                          "whose state muon cannot take over"):
        check_resume(trained, data, model_cfg, dataclasses.replace(cfg, optimizer="muon", max_steps=20))
    muon = tmp_path / "muon"
    assert main(["train", "--data", str(char_data), "--run", str(muon), "--max-steps", "2", "--optimizer", "muon",
                 *TINY]) == 0
    muon_model, muon_cfg = run_settings(muon)
    ckpt, state = check_resume(muon, data, muon_model, dataclasses.replace(muon_cfg, max_steps=4))
    assert ckpt.step == 2 and state.train["optimizer"] == "muon"
    read = ck.read_state

    def from_before_the_optimizer_setting(ckpt):  # a checkpoint written before there was a choice: AdamW's
        state = read(ckpt)
        del state.train["optimizer"]
        return state

    monkeypatch.setattr(ck, "read_state", from_before_the_optimizer_setting)
    assert check_resume(trained, data, model_cfg, dataclasses.replace(cfg, max_steps=20))[0].step == 10



def test_a_resume_keeps_the_engine_the_run_was_trained_with(trained, char_data, monkeypatch):
    """A torch run refuses --engine reference on resume; a run whose state names the reference engine refuses
    torch; a state written before there was a choice (no "engine") is torch's. Checked before any C++ is built."""
    model_cfg, cfg = run_settings(trained)
    data = load_dataset(char_data)
    more = dataclasses.replace(cfg, max_steps=20)
    with pytest.raises(GptlabError, match=f"cannot resume {trained} with engine reference: it was trained with "
                                          f"engine torch .*--init-from {trained} --data "):
        check_resume(trained, data, model_cfg, dataclasses.replace(more, engine="reference"))
    read = ck.read_state

    def with_engine(engine):
        def state_of(ckpt):
            state = read(ckpt)
            if engine is None:
                del state.train["engine"]
            else:
                state.train["engine"] = engine
            return state
        return state_of

    monkeypatch.setattr(ck, "read_state", with_engine("reference"))
    with pytest.raises(GptlabError, match="with engine torch: it was trained with engine reference"):
        check_resume(trained, data, model_cfg, more)
    assert check_resume(trained, data, model_cfg, dataclasses.replace(more, engine="reference"))[0].step == 10
    monkeypatch.setattr(ck, "read_state", with_engine(None))
    assert check_resume(trained, data, model_cfg, more)[0].step == 10
    with pytest.raises(GptlabError, match="it was trained with engine torch"):
        check_resume(trained, data, model_cfg, dataclasses.replace(more, engine="reference"))


def test_what_the_reference_engine_cannot_train_is_refused_before_anything_is_written(trained):
    model_cfg, cfg = run_settings(trained)
    naive = dataclasses.replace(cfg, engine="reference")
    check_engine(naive, model_cfg, 1)  # a GPT in one process: what it trains
    check_engine(cfg, dataclasses.replace(model_cfg, arch="bigram"), 4)  # the torch engine: anything
    with pytest.raises(GptlabError, match="the reference engine implements the GPT, not arch bigram; use --engine "
                                          "torch"):
        check_engine(naive, dataclasses.replace(model_cfg, arch="bigram"), 1)
    with pytest.raises(GptlabError, match="trains in one process, not 2; drop --nproc or use --engine torch"):
        check_engine(naive, model_cfg, 2)

# ---- a run folder's small files and its lock (gptlab.rundir, called directly) --------------------------------

def test_new_files_get_the_mode_the_umask_gives_without_setting_it_where_proc_tells(monkeypatch):
    def forbidden(mask):
        raise AssertionError("umask_mode set the umask: that races other threads creating files")

    def unreadable(path):
        return types.SimpleNamespace(read_text=lambda: (_ for _ in ()).throw(PermissionError(13, "denied")))

    before = os.umask(0o022)
    try:
        for umask, mode in ((0o027, 0o640), (0o002, 0o664)):
            os.umask(umask)
            with monkeypatch.context() as m:
                m.setattr(os, "umask", forbidden)
                assert rundir.umask_mode() == mode  # /proc/self/status's Umask line
            with monkeypatch.context() as m:
                m.setattr(rundir, "Path", unreadable)  # no /proc: set, read back and restored
                assert rundir.umask_mode() == mode
            assert os.umask(umask) == umask
    finally:
        os.umask(before)


def test_a_failed_small_write_keeps_the_old_file_and_leaves_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full)
        with pytest.raises(GptlabError, match=f"cannot write {path}: No space left on device; check free space"):
            rundir.write_atomic(path, b"new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["config.json"]
    with pytest.raises(GptlabError, match="/missing/x.json: No such file or directory; check"):
        rundir.write_atomic(tmp_path / "missing" / "x.json", b"new")


def test_a_new_run_folder_holds_its_settings_and_tokenizer_as_readable_text(tmp_path):
    from gptlab.tokenizer import CharTokenizer

    run = tmp_path / "runs" / "r"  # runs/ is not there yet either
    model_cfg, cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16), TrainConfig(max_steps=7)
    for _ in range(2):  # again over a run folder without checkpoints: a new run may start there
        assert rundir.init_run(run, model_cfg, cfg, CharTokenizer("café\n"), {"data": "d"}) == run
    assert (run / rundir.TOKENIZER).read_bytes() == '{"type": "char", "chars": ["\\n", "a", "c", "f", "é"]}'.encode()
    text = (run / rundir.CONFIG).read_text()
    assert text.startswith('{\n  "model": {\n    "arch": "gpt",\n') and text.endswith("\n}\n")  # indented by 2
    config = json.loads(text)
    assert config.pop("git_commit") in (rundir.git_commit(), "unknown")
    assert config == {"model": to_dict(model_cfg), "train": to_dict(cfg), "data": "d",
                      "gptlab_version": gptlab.__version__}
    assert rundir.is_run(run) and rundir.read_run_config(run)["train"]["max_steps"] == 7
    (run / rundir.TOKENIZER).unlink()
    assert not rundir.is_run(run)  # config.json alone is not a run
    (tmp_path / "file").write_text("x")
    with pytest.raises(GptlabError, match="cannot create run folder .*/file/r: Not a directory"):
        rundir.init_run(tmp_path / "file" / "r", model_cfg, cfg, CharTokenizer("ab"), {})


@pytest.mark.parametrize("text, message", [
    ("{", "is damaged (not valid JSON)"),
    ('{"data": "d"}', "is not a gptlab run config (no model and train settings)"),
    ("[1]", "is not a gptlab run config (no model and train settings)"),
    ('{"model": 5, "train": {}}', "is damaged: its model and train settings must be JSON objects; fix it by hand"),
    ('{"model": {}, "train": []}', "is damaged: its model and train settings must be JSON objects; fix it by hand"),
    ('{"model": {}, "train": {}, "data": 5}', "is damaged: data must be the path of a prepared data folder, not 5;"),
])
def test_a_run_config_that_cannot_be_used_says_what_is_wrong(tmp_path, text, message):
    run = tmp_path / "r"
    with pytest.raises(GptlabError, match=f"run folder {run} does not exist; train one with"):
        rundir.read_run_config(run)
    run.mkdir()
    with pytest.raises(GptlabError, match=f"{run} is not a gptlab run \\(no config.json and tokenizer.json\\)"):
        rundir.read_run_config(run)
    (run / rundir.TOKENIZER).write_text('{"type": "char", "chars": ["a"]}')
    (run / rundir.CONFIG).write_text('{"model": {}, "train": {}}')  # nothing but the settings: the defaults
    assert rundir.read_run_config(run) == {"model": {}, "train": {}}
    (run / rundir.CONFIG).write_text(text)
    with pytest.raises(GptlabError) as refused:
        rundir.read_run_config(run)
    assert str(refused.value).startswith(f"{run / rundir.CONFIG} {message}")


def test_the_lock_names_its_holder_while_held_and_is_emptied_after(tmp_path, monkeypatch):
    run = tmp_path / "r"
    monkeypatch.setattr(sys, "argv", ["gptlab", "train", "--run", "café"])
    before = os.umask(0o022)
    try:
        with rundir.RunLock(run):
            holder = (run / rundir.LOCK).read_text()
            mode = (run / rundir.LOCK).stat().st_mode & 0o777
    finally:
        os.umask(before)
    since = re.fullmatch(rf"`gptlab train --run café` \(pid {os.getpid()} on {re.escape(socket.gethostname())}, "
                         r"since (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\)", holder)
    assert since and datetime.datetime.strptime(since[1], "%Y-%m-%d %H:%M:%S")
    assert mode == 0o644 and (run / rundir.LOCK).read_bytes() == b""  # as it was: a refusal leaves no trace


def test_a_run_folder_that_cannot_be_made_is_one_line_naming_it(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(GptlabError, match=f"^cannot create run folder {tmp_path / 'file' / 'r'}: Not a directory$"):
        rundir.RunLock(tmp_path / "file" / "r").__enter__()


def test_a_second_writer_learns_who_holds_the_lock_whatever_the_lock_file_says(tmp_path, monkeypatch):
    import fcntl

    run = tmp_path / "r"
    run.mkdir()
    fd = os.open(run / rundir.LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a holder that wrote nothing in it
        with pytest.raises(GptlabError, match=f"run {run} is being written by another process; wait"):
            rundir.RunLock(run).__enter__()
        os.pwrite(fd, b"gptlab \xff train\n", 0)  # not UTF-8
        with pytest.raises(GptlabError, match="being written by gptlab \ufffd train; wait"):
            rundir.RunLock(run).__enter__()
    finally:
        os.close(fd)
    monkeypatch.setattr(sys, "argv", ["gptlab", "train", "--run", "x" * 5000])
    with rundir.RunLock(run):
        written = (run / rundir.LOCK).read_bytes()
        with pytest.raises(GptlabError) as refused:
            rundir.RunLock(run).__enter__()
    assert f"being written by {written[:4096].decode()}; wait" in str(refused.value)  # the first 4 KiB of it


def test_undo_takes_back_only_what_the_lock_added(tmp_path):
    def locked_and_undone(run, inside=lambda: None):
        lock = rundir.RunLock(run)
        with lock:
            inside()
        lock.undo()

    locked_and_undone(tmp_path / "runs" / "new")
    assert [p.name for p in tmp_path.iterdir()] == ["runs"] and not list((tmp_path / "runs").iterdir())
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    locked_and_undone(mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    started = tmp_path / "started"  # a new run that committed a checkpoint before it failed keeps it
    locked_and_undone(started, lambda: (started / rundir.CKPTS / "step-00000005").mkdir(parents=True))
    assert [p.relative_to(started).as_posix() for p in sorted(started.rglob("*"))] == [
        "checkpoints", "checkpoints/step-00000005"]
    locked_and_undone(tmp_path / "gone", lambda: shutil.rmtree(tmp_path / "gone"))  # gone already: nothing to undo
    locked_and_undone(mine, lambda: (mine / rundir.LOCK).unlink())
