"""Run policy as a library (gptlab.runs), continued: init_from, resuming without --run, quiet, launching through
torchrun and comparing runs' curves."""

import io
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from helpers import QUICK, SMALL, TINY, evaluated_run
from safetensors.torch import load_file

import gptlab.distributed.processes
from gptlab import checkpoint as ck
from gptlab import rundir
from gptlab.cli import main
from gptlab.data.prepare import prepare
from gptlab.errors import GptlabError
from gptlab.runs import compare, latest_run, pick_run_dir, resolve, start
from gptlab.training.train import LOCKED_RUN_ENV


class Terminal(io.StringIO):
    def isatty(self):
        return True


def weights(run, kind):
    return load_file(ck.find_checkpoint(run, kind).path / "model.safetensors")


def test_init_from_a_run_takes_its_shape_and_weights_with_the_finetune_presets_settings(tmp_path, char_data, capsys):
    base, ft = tmp_path / "base", tmp_path / "ft"
    assert main(["train", "--data", str(char_data), "--run", str(base), "--max-steps", "5", *TINY,
                 "--attention", "naive", "--dropout", "0.0"]) == 0
    vocab = json.loads((base / rundir.CONFIG).read_text())["model"]["vocab_size"]
    assert vocab > 20
    spec = resolve(train={"init_from": str(base), **QUICK}, model={"vocab_size": 0}, data=char_data, run=ft)
    assert spec.preset == "finetune" and spec.extra == {"preset": "finetune"} and spec.train.lr == 3e-5
    m = spec.model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size) == (1, 2, 16, 16, 0)  # 0: the override
    assert (m.dropout, m.attention) == (0.1, "auto")  # the preset's and the default, not the source's
    capsys.readouterr()
    assert start(spec).step == 5  # vocab_size 0: taken from the data, which matches the source
    assert "step 5/5" in capsys.readouterr().err  # not quiet: progress lines
    config = json.loads((ft / rundir.CONFIG).read_text())
    assert config["preset"] == "finetune" and config["train"]["init_from"] == str(base)
    assert config["model"]["vocab_size"] == vocab
    before, after = weights(base, "best"), weights(ft, "step")
    assert before.keys() == after.keys()
    # 5 Adam steps at lr 3e-5 move each weight by ~1.5e-4; a fresh init (std 0.02) would be far off
    assert max((before[k] - after[k]).abs().max().item() for k in before) < 2e-3


def test_init_from_refuses_a_mismatched_vocabulary_data_that_is_not_prepared_and_a_finetune_without_it(
        tmp_path, char_data):
    base = tmp_path / "base"
    assert main(["train", "--data", str(char_data), "--run", str(base), "--max-steps", "2", *TINY]) == 0
    vocab = json.loads((base / rundir.CONFIG).read_text())["model"]["vocab_size"]
    other = resolve(preset="char-small", train={"init_from": str(base)}, data=char_data, run=tmp_path / "o")
    assert (other.preset, other.model.n_layer, other.model.n_embd, other.model.block_size) == ("char-small", 1, 16, 16)
    spec = resolve(train={"init_from": str(base), **QUICK}, model={"vocab_size": 100}, data=char_data,
                   run=tmp_path / "ft")
    with pytest.raises(GptlabError, match=re.escape(f"vocab_size=100 (source {vocab})")):
        start(spec, quiet=True)
    (tmp_path / "empty").mkdir()
    spec = resolve(train={"init_from": str(base), **QUICK}, data=tmp_path / "empty", run=tmp_path / "ft")
    with pytest.raises(GptlabError, match="empty is not a prepared data folder"):
        start(spec, quiet=True)
    assert not (tmp_path / "ft").exists()
    with pytest.raises(GptlabError, match="finetune preset continues training a model; name it with --init-from"):
        resolve(preset="finetune", data=char_data, run=tmp_path / "ft")


def test_resume_without_a_run_continues_the_presets_folder_and_auto_needs_a_checkpoint(tmp_path, char_data,
                                                                                       monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert start(resolve(model=SMALL, train=QUICK, data=char_data), quiet=True).step == 5
    assert capsys.readouterr().err == ""  # quiet: no progress lines, only the evaluations' results
    spec = resolve(resume=True, train={"max_steps": 8})
    assert spec.run == Path("runs/char-quick") and spec.resume and spec.data == char_data.resolve()
    assert pick_run_dir("char-quick", resume=True) == Path("runs/char-quick")  # though it has checkpoints
    shutil.rmtree(Path("runs/char-quick") / rundir.CKPTS)  # config.json and tokenizer.json, no checkpoint
    assert not resolve(run="runs/char-quick", resume="auto", data=char_data).resume
    with pytest.raises(GptlabError, match="no run found under elsewhere/"):
        latest_run(Path("elsewhere"))


def test_on_a_terminal_preparing_the_bundled_corpus_shows_progress_unless_quiet(tmp_path, monkeypatch):
    shown = {}
    for quiet in (False, True):
        (tmp_path / str(quiet)).mkdir()
        monkeypatch.chdir(tmp_path / str(quiet))
        monkeypatch.setattr(sys, "stderr", Terminal())
        spec = resolve(run="r", quiet=True) if quiet else resolve(run="r")
        assert spec.data == Path("data/tinyshakespeare-char") and (spec.data / "meta.json").is_file()
        shown[quiet] = sys.stderr.getvalue()
    assert "encode" in shown[False] and "\r" in shown[False]  # tqdm's bars
    assert shown[True] == "preparing the bundled Tiny Shakespeare into data/tinyshakespeare-char ...\n"


def test_launch_holds_the_runs_lock_around_torchrun_and_removes_a_new_run_that_failed(tmp_path, char_data,
                                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls, codes = [], []

    def torchrun(nproc, argv, max_restarts=0, extra_env=None):
        calls.append((nproc, argv, max_restarts, extra_env, rundir.RunLock.held(spec.run)))
        (spec.run / rundir.CONFIG).write_text("{}")  # as a training would, before its first checkpoint
        return codes.pop(0)
    monkeypatch.setattr(gptlab.distributed.processes, "launch", torchrun)
    from gptlab.runs import launch

    spec = resolve(model=SMALL, train={**QUICK, "batch_size": 8}, data=char_data, run="r")
    codes[:] = [0, 0, 1]
    assert launch(spec, 2, ["train", "--run", "r"]) == 0
    assert calls == [(2, ["train", "--run", "r"], 0, {LOCKED_RUN_ENV: str(tmp_path.resolve() / "r")}, True)]
    assert (tmp_path / "r" / rundir.CONFIG).is_file() and not rundir.RunLock.held("r")  # kept, and free again
    assert launch(spec, 1, ["train"], max_restarts=3) == 0 and calls[-1][:3] == (1, ["train"], 3)
    spec.run = Path("r2")
    assert launch(spec, 4, ["train"]) == 1 and not (tmp_path / "r2").exists()  # nothing of the failed new run
    assert len(calls) == 3
    with pytest.raises(GptlabError, match="--nproc must be at least 1, not 0"):
        launch(spec, 0, ["train"])
    for batch, hint in ((9, 8), (3, 4)):
        spec.train.batch_size = batch
        with pytest.raises(GptlabError, match=f"batch_size {batch} must be a multiple of the 4 processes; "
                                              f"try --batch-size {hint}$"):
            launch(spec, 4, ["train"])
    assert len(calls) == 3 and not (tmp_path / "r2").exists()


def test_compare_refuses_runs_never_evaluated_data_gone_and_an_unwritable_picture(tmp_path):
    for name, text in (("d1", "héllo wörld\n" * 50), ("d2", "abc, ДЕФ\n" * 50)):  # two character sets
        (tmp_path / f"{name}.txt").write_text(text, encoding="utf-8")
        prepare([str(tmp_path / f"{name}.txt")], tmp_path / name, "char", quiet=True)
    bare = evaluated_run(tmp_path, "bare", tmp_path / "d1", [])
    with pytest.raises(GptlabError, match="none of these runs has been evaluated yet"):
        compare([bare], tmp_path / "c.png")
    a = evaluated_run(tmp_path, "a", tmp_path / "d1", [(5, 2.0)])
    b = evaluated_run(tmp_path, "b", tmp_path / "d2", [(5, 2.5)])
    twin = evaluated_run(tmp_path, "twin", tmp_path / "d1", [(5, 1.5)])
    tokenizer = json.loads((twin / rundir.TOKENIZER).read_text())
    assert len(tokenizer) > 1
    (twin / rundir.TOKENIZER).write_text(json.dumps(dict(reversed(tokenizer.items()))))  # same, keys reordered
    assert compare([a, twin], tmp_path / "same.png")[1] == "nats / token"
    (tmp_path / "file").write_text("")
    with pytest.raises(GptlabError, match=re.escape(f"cannot write {tmp_path / 'file' / 'c.png'}: Not a directory")):
        compare([a, twin], tmp_path / "file" / "c.png")
    assert compare([a, b], tmp_path / "mixed.png")[1] == "bits / byte"
    shutil.rmtree(tmp_path / "d2")
    with pytest.raises(GptlabError, match=re.escape(f"which it cannot read for {b}: run {b} was trained on")):
        compare([a, b], tmp_path / "mixed.png")
    config = json.loads((b / rundir.CONFIG).read_text())
    del config["data"]  # as an imported run's: no data folder recorded (and one in the working folder is not it)
    (b / rundir.CONFIG).write_text(json.dumps(config))
    with pytest.raises(GptlabError, match=re.escape(f"cannot read for {b}: it records no data folder")):
        compare([a, b], tmp_path / "mixed.png")


def test_init_from_on_data_of_another_tokenizer_says_so_whichever_vocabulary_is_larger(tmp_path, char_data,
                                                                                        monkeypatch, capsys):
    from helpers import run_bad, tree

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--data", "data", "--run", "runs/base", "--max-steps", "2", *TINY]) == 0
    wide = "".join(chr(c) for c in range(0x100, 0x180))  # 128 characters: a larger vocabulary than the base's
    for name, text in (("wide", wide * 40 + "\n"), ("narrow", "abc de\n" * 200)):
        Path(f"{name}.txt").write_text(text, encoding="utf-8")
        assert main(["prepare", f"{name}.txt", "--out", f"data-{name}", "--quiet"]) == 0
    before = tree(tmp_path)
    for name in ("wide", "narrow"):
        line = run_bad(capsys, "train", "--init-from", "runs/base", "--data", f"data-{name}", "--run", "runs/ft",
                       "--max-steps", "2")
        assert line.startswith(f"gptlab: error: data-{name} was tokenized with another tokenizer than runs/base (a "
                               f"char tokenizer of {len(set(Path(f'{name}.txt').read_text()))} ids, not its char "
                               "tokenizer of "), line
        assert line.endswith("); prepare it with --tokenizer-from runs/base"), line
    assert tree(tmp_path) == before


def test_data_prepared_again_after_a_run_trained_on_it_is_named_so_by_resume_and_eval(tmp_path, monkeypatch,
                                                                                       capsys):
    from helpers import CORPUS, run_bad, tree

    monkeypatch.chdir(tmp_path)
    Path("corpus.txt").write_text(CORPUS, encoding="utf-8")
    assert main(["prepare", "corpus.txt", "--out", "data/dd", "--quiet"]) == 0
    assert main(["train", "--data", "data/dd", "--run", "runs/dd", "--max-steps", "2", *TINY]) == 0
    expected = "gptlab: error: data/dd was prepared again after runs/dd trained on it"
    for text in (CORPUS[::-1], "other words entirely, 0123456789\n" * 100):  # the same tokenizer, then another
        Path("corpus.txt").write_text(text, encoding="utf-8")
        assert main(["prepare", "corpus.txt", "--out", "data/dd", "--overwrite", "--quiet"]) == 0
        before = tree(tmp_path)
        for argv in (["train", "--run", "runs/dd", "--resume", "--max-steps", "4"],
                     ["train", "--run", "runs/dd", "--resume", "--data", "data/dd", "--max-steps", "4"],
                     ["eval", "--run", "runs/dd"]):
            assert run_bad(capsys, *argv).startswith(expected), argv
        assert tree(tmp_path) == before
