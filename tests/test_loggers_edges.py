"""The loggers' edges that the shared four-logger run of tests/test_loggers.py does not reach, each held by a direct
call of one logger (no training): a package that imports but is broken, a kept id or CSV missing on a resume, a
TensorBoard folder that an earlier run wrote, the exact text and pictures TensorBoard is given, the W&B run of a user
who has not logged in and the login that puts W&B online. Each is read back with the logger's own reader
(TensorBoard's event accumulator, the csv module, wandb's reader of its run files) against hand-worked values."""

import csv
import io
import json
import socket
import subprocess
import sys

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


# ---- Weights & Biases: a logger started directly, read back with wandb's own reader -------------------------------

@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """wandb kept on this machine for one test: its folders in tmp_path, no credentials, no ~/.netrc, WANDB_MODE
    and WANDB_PROJECT unset (a test sets what it needs); a connection to anywhere but loopback fails the test."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    connect = socket.socket.connect

    def loopback_only(self, address):
        host = address[0] if isinstance(address, tuple) else "unix"
        assert host in ("unix", "localhost", "::1") or host.startswith("127."), f"connection to {address}"
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    return tmp_path


def wandb_records(path) -> list[dict]:
    """The records of a .wandb file, read by wandb's own reader (`wandb leet inspect --json`)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_a_wandb_run_of_a_user_not_logged_in_is_offline_resumable_and_charted_against_step(wandb_home, monkeypatch):
    """WANDB_MODE unset and no login: an offline run (wandb's own default, online, would stop for an API key), in
    the project WANDB_PROJECT names, with an id as long as wandb's own; its record marked to resume (`wandb sync`
    and a resume continue that id); every metric charted against `step`, the loss curve at the step it is given;
    training's own console lines left out of the run."""
    from wandb.sdk.lib import runid

    monkeypatch.setenv("WANDB_PROJECT", "tiny-models")
    run, png = wandb_home / "run", wandb_home / "curve.png"
    Image.new("RGB", (3, 2), (9, 8, 7)).save(png)
    logger = loggers.Wandb()
    logger.start(run, {"train": {"lr": 0.5}}, 0)
    print("a line of training's own")
    logger.log({"kind": "train", "step": 2, "loss": 1.5})
    logger.media(png, None, 7)  # the curve of a run whose last step logged no row
    logger.finish(None)
    ident = (run / "logs" / "wandb.id").read_text()
    assert len(ident) == len(runid.generate_id()) and set(ident) <= set("0123456789abcdefghijklmnopqrstuvwxyz")
    [folder] = (run / "logs" / "wandb" / "wandb").glob("*-run-*")
    assert folder.name.startswith("offline-run-") and folder.name.endswith(ident)
    records = wandb_records(folder / f"run-{ident}.wandb")
    [meta] = [r["run"] for r in records if r["type"] == "run"]
    assert (meta["project"], meta["run_id"], meta.get("resume")) == ("tiny-models", ident, True)
    metrics = [r["metric"] for r in records if r["type"] == "metric"]
    assert [(m.get("name"), m.get("glob_name"), m.get("step_metric")) for m in metrics] == [
        ("step", None, None), (None, "*", "step")]
    items = [r["history"]["item"] for r in records if r["type"] == "history"]
    shown = [(item["step"], sorted(k for k in item if not k.startswith(("_", "loss_curve.")))) for item in items]
    assert shown == [(2, ["step", "train/loss"]), (7, ["step"])]
    assert not [r for r in records if r["type"] in ("output", "output_raw")]
    assert not (folder / "files" / "output.log").exists()


def test_wandb_is_online_for_a_workload_identity_and_for_a_login_to_the_host_wandb_base_url_names(tmp_path,
                                                                                                  monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))  # W&B's identity federation
    assert loggers.wandb_mode() == "online"
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE")
    (tmp_path / "netrc").write_text("machine wandb.example.com login user password secret\n")  # a W&B server's
    assert loggers.wandb_mode() == "offline"  # the login is for another host than W&B's own
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com:8443")
    assert loggers.wandb_mode() == "online"
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password secret\n")
    assert loggers.wandb_mode() == "offline"  # a login to W&B's own host is not one to the server named
