"""Run policy as a library (gptlab.runs): the spec `gptlab train` builds, config files, and the runs / info verbs."""

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from helpers import QUICK, SMALL, TINY

from gptlab import checkpoint as ck
from gptlab import rundir
from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.runs import RunSummary, latest_run, list_runs, pick_run_dir, resolve, run_info, start


def test_a_python_caller_resolves_and_trains_as_the_cli_does(tmp_path, char_data, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec = resolve(model=SMALL, train=QUICK, data=char_data)
    assert spec.run.as_posix() == "runs/char-quick" and spec.preset == "char-quick" and not spec.resume
    assert spec.model.n_layer == 1 and spec.train.lr == 6e-3  # the override, and the preset's value
    result = start(spec, quiet=True)
    assert result.step == 5
    assert pick_run_dir("char-quick").as_posix() == "runs/char-quick-2"  # that one has checkpoints now
    assert main(["train", "--data", str(char_data), "--max-steps", "5", *TINY]) == 0
    assert "runs/char-quick-2" in capsys.readouterr().out
    again = resolve(run="runs/char-quick", resume="auto", train={"max_steps": 8})
    assert again.resume and again.data == char_data.resolve() and again.model.n_layer == 1


def test_a_config_file_sets_what_flags_set_and_flags_win(tmp_path, char_data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small.toml").write_text('preset = "char-small"\nlr = 0.002\n[model]\nn_layer = 2\nn_head = 2\n'
                                         'n_embd = 32\nblock_size = 32\n[train]\nmax_steps = 7\n')
    spec = resolve(model={"n_layer": 3}, data=char_data, config_file=tmp_path / "small.toml")
    assert spec.preset == "char-small" and spec.model.n_layer == 3 and spec.model.n_embd == 32
    assert spec.train.lr == 0.002 and spec.train.max_steps == 7 and spec.train.batch_size == 64  # the preset's
    (tmp_path / "bad.toml").write_text("n_layers = 2\n")
    with pytest.raises(GptlabError, match="unknown setting 'n_layers'"):
        resolve(data=char_data, config_file=tmp_path / "bad.toml")


def test_a_config_files_data_and_run_given_to_resolve_are_read_relative_to_its_folder(tmp_path, char_data,
                                                                                      monkeypatch):
    exp = tmp_path / "exp"
    shutil.copytree(char_data, exp / "mydata")
    (exp / "c.toml").write_text('data = "mydata"\nrun = "myrun"\n[train]\nmax_steps = 3\n')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    spec = resolve(config_file=exp / "c.toml", quiet=True)
    assert (Path(spec.data).resolve(), Path(spec.run).resolve(), spec.train.max_steps) == (
        (exp / "mydata").resolve(), (exp / "myrun").resolve(), 3)


def test_a_runs_config_json_is_a_config_file(tmp_path, char_data, capsys):
    first = tmp_path / "first"
    assert main(["train", "--data", str(char_data), "--run", str(first), *TINY, "--max-steps", "5",
                 "--lr", "0.004"]) == 0
    assert main(["train", "--config", str(first / "config.json"), "--run", str(tmp_path / "second"), "--quiet"]) == 0
    a, b = (json.loads((tmp_path / r / "config.json").read_text()) for r in ("first", "second"))
    assert a["model"] == b["model"] and a["train"] == b["train"] and a["data"] == b["data"]


def test_runs_lists_and_info_shows_a_run(tmp_path, char_data, capsys):
    run = tmp_path / "runs" / "r"
    assert main(["train", "--data", str(char_data), "--run", str(run), *TINY, "--max-steps", "10"]) == 0
    assert main(["train", "--run", str(run), "--resume", "--max-steps", "15", "--quiet"]) == 0
    (summary,) = list_runs(tmp_path / "runs")
    assert (summary.step, summary.max_steps, summary.state, summary.preset) == (15, 15, "finished", "char-quick")
    assert summary.tokens == 15 * 4 * 16 and summary.train_seconds > 0 and summary.best_val_loss < 5
    capsys.readouterr()
    assert main(["runs", str(tmp_path / "runs")]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert "char-quick" in row and "15/15" in row and row.endswith("finished")
    assert main(["info", str(run)]) == 0
    out = capsys.readouterr().out
    assert "finished, step 15 of 15" in out and "n_layer=1" in out and f"data: {char_data.resolve()}" in out
    assert "checkpoint step-00000015: valid, val loss" in out and "resumed at step 10" in out


def test_compare_plots_several_runs_against_steps_and_seconds(tmp_path, char_data, capsys):
    from gptlab.plots import validation_curve

    rows = [{"kind": "eval", "step": 5, "val_loss": 3.0, "elapsed_s": 2.0},
            {"kind": "train", "step": 6, "loss": 2.9, "elapsed_s": 2.5},  # then the run was stopped and resumed
            {"kind": "train", "step": 7, "loss": 2.8, "elapsed_s": 0.5},
            {"kind": "eval", "step": 10, "val_loss": 2.7, "elapsed_s": 1.5}]
    assert validation_curve(rows) == ([5, 10], [3.0, 2.7], [2.0, 4.0])  # the second session's clock continues
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", "--data", str(char_data), "--run", str(a), *TINY, "--max-steps", "10"]) == 0
    assert main(["train", "--data", str(char_data), "--run", str(b), *TINY, "--max-steps", "10", "--lr", "0.01"]) == 0
    capsys.readouterr()
    out_png = tmp_path / "both.png"
    assert main(["compare", str(a), str(b), "--out", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert str(a) in out and str(b) in out and f"validation curves: {out_png}" in out
    import matplotlib.image

    pixels = matplotlib.image.imread(out_png)
    assert pixels.shape[1] > pixels.shape[0] and len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])}) > 10


def test_the_default_run_folder_is_never_one_being_trained_nor_one_with_checkpoints(tmp_path, char_data, monkeypatch,
                                                                                   capsys):
    monkeypatch.chdir(tmp_path)
    busy = Path("runs/char-quick")
    with rundir.RunLock(busy):  # a `gptlab train` has just started there: no config.json, no checkpoint yet
        assert main(["train", "--data", str(char_data), "--max-steps", "2", *TINY]) == 0
        assert "run runs/char-quick-2:" in capsys.readouterr().out
    assert [p.name for p in busy.iterdir()] == [rundir.LOCK]  # the holder's folder untouched
    assert pick_run_dir("char-quick") == busy  # free again, and nothing in it to lose
    best = ck.find_checkpoint("runs/char-quick-2", "best").path
    shutil.copytree(best, busy / rundir.CKPTS / best.name)  # only a best checkpoint: still work to keep
    assert pick_run_dir("char-quick") == Path("runs/char-quick-3")


def test_sample_and_eval_default_to_the_most_recently_trained_run(tmp_path, char_data, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name in ("char-quick-9", "char-quick-10"):  # trained in this order: by name, -9 would come last
        assert main(["train", "--data", str(char_data), "--run", f"runs/{name}", "--max-steps", "2", *TINY]) == 0
    assert latest_run() == Path("runs/char-quick-10")
    assert main(["train", "--run", "runs/char-quick-9", "--resume", "--max-steps", "4", "--quiet"]) == 0
    assert latest_run() == Path("runs/char-quick-9")  # trained last now
    with rundir.RunLock("runs/char-quick-9"):  # and being trained again: readers are never refused
        capsys.readouterr()
        assert main(["sample", "--max-new-tokens", "3"]) == 0
        assert "using runs/char-quick-9/checkpoints/best-00000004" in capsys.readouterr().err
    fresh = Path("runs/char-quick-11")
    with rundir.RunLock(fresh):  # just started: its config is written, its first checkpoint not yet
        shutil.copy(Path("runs/char-quick-9") / rundir.CONFIG, fresh / rundir.CONFIG)
        shutil.copy(Path("runs/char-quick-9") / rundir.TOKENIZER, fresh / rundir.TOKENIZER)
        assert latest_run() == fresh
        assert main(["eval"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"gptlab: error: run {fresh} is being trained and has no checkpoint yet; wait for its first "
                       "evaluation (one every --eval-interval steps) or pass --run"]


def test_runs_lists_every_run_and_says_which_are_damaged(tmp_path, char_data, capsys):
    root = tmp_path / "runs"
    assert main(["train", "--data", str(char_data), "--run", str(root / "good"), "--max-steps", "5", *TINY]) == 0
    shutil.copytree(root / "good", root / "badjson")
    (root / "badjson" / rundir.CONFIG).write_text('{"model": {"n_layer": 1,')  # cut short by a crash, say
    shutil.copytree(root / "good", root / "badckpts")
    for c in ck.list_checkpoints(root / "badckpts", "step") + ck.list_checkpoints(root / "badckpts", "best"):
        weights = bytearray((c.path / "model.safetensors").read_bytes())
        weights[-1] ^= 1  # one bit of the last weight: every checkpoint fails its checksum
        (c.path / "model.safetensors").write_bytes(weights)
    states = {s.path.name: s.state for s in list_runs(root)}
    assert states == {"good": "finished", "badjson": "damaged", "badckpts": "damaged"}
    capsys.readouterr()
    assert main(["runs", str(root)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[str(root / "good")[-28:]].endswith("finished")
    assert rows[str(root / "badjson")[-28:]].endswith("damaged") and rows[str(root / "badckpts")[-28:]].endswith(
        "damaged")
    assert rows[str(root / "badjson")[-28:]].split()[2] == "-"  # no steps to show, not 0/0
    edit_config(root / "good", imported_from="/models/gpt2", data=None)  # an import has no training steps either
    assert main(["runs", str(root)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[str(root / "good")[-28:]].endswith("imported") and rows[str(root / "good")[-28:]].split()[2] == "-"
    assert rows["damaged:"] == "damaged: `gptlab info RUN` says what is wrong with it"


def damage_every(run, kind):
    for c in ck.list_checkpoints(run, kind):
        weights = bytearray((c.path / "model.safetensors").read_bytes())
        weights[-1] ^= 1
        (c.path / "model.safetensors").write_bytes(weights)


def edit_config(run, **changes):
    config = json.loads((run / rundir.CONFIG).read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (run / rundir.CONFIG).write_text(json.dumps(config))


def test_every_state_of_a_run_is_summarized_with_its_numbers(tmp_path, char_data):
    root = tmp_path / "runs"
    done = root / "done"
    assert main(["train", "--data", str(char_data), "--run", str(done), "--max-steps", "10", *TINY]) == 0
    state = json.loads((done / rundir.CKPTS / "step-00000010" / "state.json").read_text())
    (done / rundir.METRICS).write_text("".join(json.dumps(r) + "\n" for r in [  # resumed once: 2.5 s + 0.5 s
        {"kind": "train", "step": 5, "elapsed_s": 1.0}, {"kind": "eval", "step": 5, "val_loss": 3.0},
        {"kind": "train", "step": 8, "elapsed_s": 2.5}, {"kind": "train", "step": 10, "elapsed_s": 0.5}]))
    for name in ("more", "fresh", "imported", "bestonly", "broken", "bestbroken", "olderbest"):
        shutil.copytree(done, root / name)
    edit_config(root / "more", train={**state["train"], "max_steps": 20})
    shutil.rmtree(root / "fresh" / rundir.CKPTS)
    (root / "fresh" / rundir.METRICS).unlink()
    edit_config(root / "imported", imported_from="/models/gpt2", data=None, preset=None)
    best = ck.list_checkpoints(root / "bestonly", "best")[0]
    for c in ck.list_checkpoints(root / "bestonly", "step") + ck.list_checkpoints(root / "broken", "best"):
        shutil.rmtree(c.path)
    damage_every(root / "broken", "step")  # its step checkpoints only, none left usable
    for c in ck.list_checkpoints(root / "bestbroken", "step"):
        shutil.rmtree(c.path)
    damage_every(root / "bestbroken", "best")  # best checkpoints only, none usable: damaged, not new
    for i, c in enumerate(ck.list_checkpoints(root / "olderbest", "best")):  # its newest step, not its best, counts
        c.path.rename(c.path.with_name(f"best-0000000{i + 1}")) if i == 0 else shutil.rmtree(c.path)
    tokens, loss = 10 * 4 * 16, state["best_val_loss"]
    assert isinstance(loss, float) and loss < 4
    expected = {"done": ("char-quick", 10, 10, loss, tokens, 3.0, "finished"),
                "more": ("char-quick", 10, 20, loss, tokens, 3.0, "interrupted"),
                "fresh": ("char-quick", 0, 10, None, 0, 0.0, "new"),
                "imported": ("?", 10, 10, loss, tokens, 3.0, "imported"),
                "bestonly": ("char-quick", best.step, 10, json.loads((best.path / "state.json").read_text())[
                    "best_val_loss"], best.step * 4 * 16, 3.0, "finished" if best.step == 10 else "interrupted"),
                "broken": ("char-quick", 0, 10, None, 0, 3.0, "damaged"),
                "bestbroken": ("char-quick", 0, 10, None, 0, 3.0, "damaged"),
                "olderbest": ("char-quick", 10, 10, loss, tokens, 3.0, "finished")}
    assert {s.path.name: s for s in list_runs(root)} == {
        name: RunSummary(root / name, *fields) for name, fields in expected.items()}
    with rundir.RunLock(done):
        assert list_runs(done) == [RunSummary(done, "char-quick", 10, 10, loss, tokens, 3.0, "running")]
    (root / "more" / rundir.CONFIG).write_text("{")
    order = ["more", "imported", "done", "fresh", "broken", "bestonly", "bestbroken", "olderbest"]  # by when written
    for seconds, name in enumerate(order):
        os.utime(root / name / rundir.CONFIG, (1e9 + seconds, 1e9 + seconds))
    summaries = list_runs(root)
    assert [s.path.name for s in summaries] == order
    assert summaries[0] == RunSummary(root / "more", "?", 0, 0, None, 0, 0.0, "damaged")


def test_info_lists_every_checkpoint_with_its_validity_and_loss(tmp_path, char_data):
    run = tmp_path / "r"
    assert main(["train", "--data", str(char_data), "--run", str(run), "--max-steps", "10", *TINY]) == 0
    damage_every(run, "best")
    config = json.loads((run / rundir.CONFIG).read_text())
    info = run_info(run)
    bad = info["checkpoints"][2]["valid"]
    assert "checksum" in bad or "damaged" in bad, bad
    assert info == {"run": asdict(list_runs(run)[0]), "data": str(char_data.resolve()), "imported_from": None,
                    "model": config["model"], "train": config["train"], "resumes": [], "lora": None, "checkpoints": [
                        {"name": f"step-{s:08d}", "step": s, "valid": "valid", "val_loss": json.loads(
                            (run / rundir.CKPTS / f"step-{s:08d}" / "state.json").read_text())["val_loss"]}
                        for s in (10, 5)] + [{"name": f"best-{s:08d}", "step": s, "valid": bad, "val_loss": None}
                                             for s in [c.step for c in ck.list_checkpoints(run, "best")]]}
    assert main(["train", "--run", str(run), "--resume", "--max-steps", "12"]) == 0
    assert [r["step"] for r in run_info(run)["resumes"]] == [10]
    edit_config(run, imported_from="/models/gpt2", data=None)
    assert (run_info(run)["data"], run_info(run)["imported_from"]) == (None, "/models/gpt2")


def test_without_data_the_bundled_corpus_is_prepared_once_for_the_presets_tokenizer(tmp_path, char_data, monkeypatch,
                                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    spec = resolve(run="r", resume="auto")  # nothing to continue there: a new run
    assert not spec.resume and spec.data == Path("data/tinyshakespeare-char") and spec.preset == "char-quick"
    assert json.loads(Path("data/tinyshakespeare-char/meta.json").read_text())["tokenizer"] == "char"
    assert capsys.readouterr().err == "preparing the bundled Tiny Shakespeare into data/tinyshakespeare-char ...\n"
    assert resolve(run="r2").data == spec.data and capsys.readouterr().err == ""  # there now
    assert main(["train", "--data", str(char_data), "--run", "mine", "--max-steps", "2", *TINY]) == 0
    edit_config(Path("mine"), preset=None)  # a run from before presets were recorded, say
    again = resolve(preset="char-small", run="mine", resume=True, train={"max_steps": 4})
    assert again.preset == "char-small" and again.data == char_data.resolve()
    edit_config(Path("mine"), preset="char-quick")
    assert resolve(preset="char-small", run="mine", resume="auto").preset == "char-quick"  # the run's own


def test_compare_leaves_out_a_run_whose_every_checkpoint_is_damaged_with_a_note(tmp_path, char_data, capsys,
                                                                                caplog):
    good, bad = tmp_path / "good", tmp_path / "bad"
    assert main(["train", "--data", str(char_data), "--run", str(good), "--max-steps", "5", *TINY]) == 0
    shutil.copytree(good, bad)
    damage_every(bad, "step")
    damage_every(bad, "best")
    (bad / rundir.METRICS).write_text("{cut short\n")
    capsys.readouterr()
    assert main(["compare", str(good), str(bad), "--out", str(tmp_path / "c.png")]) == 0
    rows = capsys.readouterr().out.splitlines()[:-1]
    assert len(rows) == 1 and rows[0].startswith(str(good)) and "step        5" in rows[0]  # bad: not at step 0
    assert f"left {bad} out: it has no usable checkpoint (every one is damaged); `gptlab info {bad}` says what is " \
           "wrong" in caplog.messages
    assert main(["compare", str(bad), "--out", str(tmp_path / "d.png")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"gptlab: error: {bad} has no usable checkpoint (every one is "
                                                    "damaged): nothing to compare")
    assert not (tmp_path / "d.png").exists()
