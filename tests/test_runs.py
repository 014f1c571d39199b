"""Run policy as a library (gptlab.runs): the spec `gptlab train` builds, config files, and the runs / info verbs."""

import json

import pytest

from gptlab.cli import main
from gptlab.errors import GptlabError
from gptlab.runs import list_runs, pick_run_dir, resolve, start
from test_sweep import TINY

SMALL = dict(n_layer=1, n_head=2, n_embd=16, block_size=16)
QUICK = dict(batch_size=4, eval_interval=5, eval_batches=2, log_interval=5, precision="fp32", max_steps=5)


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
