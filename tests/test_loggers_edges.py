"""The loggers' edges that the shared four-logger run of tests/test_loggers.py does not reach, each held by a direct
call of one logger (no training): a package that imports but is broken, a kept id or CSV missing on a resume, a
TensorBoard folder that an earlier run wrote, the exact text and pictures TensorBoard is given. Each is read back
with the logger's own reader (TensorBoard's event accumulator, the csv module) against hand-worked values."""

import csv
import io

import pytest
from PIL import Image

from gptlab.errors import GptlabError
from gptlab.training import loggers


def events_of(folder):
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    return events


def texts(events, tag):
    from tensorboard.util.tensor_util import make_ndarray

    return [(e.step, make_ndarray(e.tensor_proto).item().decode()) for e in events.Tensors(tag)]


class Broken(loggers.Logger):
    name, extra = "broken", "brokenextra"


@pytest.mark.parametrize("body, message", [
    # the package's own submodule is missing (a partly installed package): the package is named, with its extra
    ("import h7pkg_a.gone\n", "--log broken needs the brokenextra package: pip install 'gptlab[brokenextra]'"),
    # another package it needs is missing: the import's own error, not a request to install the extra
    ("import h7_not_installed_dep\n",
     "--log broken: importing h7pkg_a failed: No module named 'h7_not_installed_dep'"),
    # an ImportError that names no module
    ("raise ImportError('a broken build')\n", "--log broken: importing h7pkg_a failed: a broken build"),
], ids=["its-own-submodule-missing", "another-package-missing", "no-module-named"])
def test_a_package_that_fails_to_import_is_told_apart_from_a_missing_one(tmp_path, monkeypatch, body, message):
    (tmp_path / "h7pkg_a").mkdir()
    (tmp_path / "h7pkg_a" / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(Broken, "modules", ("h7pkg_a",))
    with pytest.raises(GptlabError) as err:
        Broken.load()
    assert str(err.value) == message


def test_the_kept_id_is_read_only_on_a_resume_and_only_when_kept(tmp_path):
    (tmp_path / "logs").mkdir()
    assert loggers.kept_id(tmp_path, "wandb", 5) is None  # a resume, but no id kept: a new logger run
    (tmp_path / "logs" / "wandb.id").write_text("abc123\n")
    assert loggers.kept_id(tmp_path, "wandb", 0) is None  # a new run never continues an old id
    assert loggers.kept_id(tmp_path, "wandb", 5) == "abc123"


def test_a_run_that_ends_is_finished_with_exit_code_0():
    assert loggers.ending(None) == ("FINISHED", 0)  # W&B marks a run failed for any exit code but 0


def test_tensorboard_new_run_purges_an_earlier_runs_events_at_step_0(tmp_path):
    """A new run (resume_step 0) in a folder where an earlier one logged: TensorBoard shows only the new settings."""
    run = tmp_path / "run"
    old = loggers.TensorBoard()
    old.start(run, {"model": {"n_layer": 1}}, 0)
    old.log({"kind": "train", "step": 0, "loss": 9.0})
    old.finish(None)
    [first] = (run / "logs" / "tensorboard").iterdir()
    first.rename(first.with_name("events.out.tfevents.0000000001.old"))  # sorted first, as an older file is
    new = loggers.TensorBoard()
    new.start(run, {"model": {"n_layer": 2}}, 0)
    new.log({"kind": "train", "step": 1, "loss": 4.0})
    new.finish(None)
    events = events_of(run / "logs" / "tensorboard")
    assert texts(events, "config/text_summary") == [(0, '```\n{\n  "model": {\n    "n_layer": 2\n  }\n}\n```')]
    assert [e.step for e in events.Tensors("train/loss")] == [1]


def test_tensorboard_is_told_the_metric_of_the_hparams_view_is_eval_val_loss(tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    tb = loggers.TensorBoard()
    tb.start(tmp_path, {"train": {"lr": 0.5}}, 0)
    tb.finish(None)
    content = events_of(tmp_path / "logs" / "tensorboard").PluginTagToContent("hparams")["_hparams_/experiment"]
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content).experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["eval/val_loss"]


def test_tensorboard_gets_the_sample_in_a_code_block_and_a_grey_picture_as_rgb(tmp_path):
    from tensorboard.util.tensor_util import make_ndarray

    png = tmp_path / "grey.png"
    Image.new("L", (3, 2), 100).save(png)  # one channel: TensorBoard is given it as RGB
    tb = loggers.TensorBoard()
    tb.start(tmp_path, {}, 0)
    tb.media(png, "to be", 7)
    tb.finish(None)
    events = events_of(tmp_path / "logs" / "tensorboard")
    assert texts(events, "sample/text_summary") == [(7, "```\nto be\n```")]
    [picture] = events.Tensors("loss_curve")
    width, height, encoded = make_ndarray(picture.tensor_proto)
    image = Image.open(io.BytesIO(encoded))
    assert (picture.step, int(width), int(height), image.mode) == (7, 3, 2, "RGB")
    assert image.tobytes() == bytes([100] * 18)


def test_csv_makes_its_folders_where_the_run_folder_is_not_there_yet(tmp_path):
    run = tmp_path / "new" / "run"
    logger = loggers.Csv()
    logger.start(run, {}, 0)
    logger.log({"kind": "train", "step": 2, "loss": 1.5})
    logger.finish(None)
    with open(run / "logs" / "metrics.csv", newline="") as f:
        assert [(r["step"], r["kind"], r["loss"]) for r in csv.DictReader(f)] == [("2", "train", "1.5")]


def test_csv_resumed_without_a_csv_starts_one(tmp_path):
    """A resume of a run that had no --log csv before: a new file, its header and the rows from the resume on."""
    logger = loggers.Csv()
    logger.start(tmp_path, {}, 5)
    logger.log({"kind": "train", "step": 6, "loss": 2.0})
    logger.finish(None)
    with open(tmp_path / "logs" / "metrics.csv", newline="") as f:
        assert [(r["step"], r["loss"]) for r in csv.DictReader(f)] == [("6", "2.0")]


def test_csv_resume_keeps_a_quoted_field_with_a_line_break_as_it_was(tmp_path):
    """The kept rows are read as the csv module asks (newline=""): a quoted CRLF inside a field stays CRLF."""
    (tmp_path / "logs").mkdir()
    path = tmp_path / "logs" / "metrics.csv"
    path.write_bytes(b'step,kind,loss\r\n3,"a\r\nnote",1.0\r\n9,train,0.5\r\n')
    logger = loggers.Csv()
    logger.start(tmp_path, {}, 5)
    logger.finish(None)
    with open(path, newline="") as f:
        assert [(r["step"], r["kind"]) for r in csv.DictReader(f)] == [("3", "a\r\nnote")]
