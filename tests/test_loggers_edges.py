"""The loggers' edges that the shared four-logger run of tests/test_loggers.py does not reach, each held by a direct
call of one logger (no training): a package that imports but is broken, a kept id or CSV missing on a resume, a
TensorBoard folder that an earlier run wrote, the exact text and pictures TensorBoard is given, the W&B run of a user
who has not logged in and the login that puts W&B online, MLflow's store, run name, settings, experiment and resumed
status, the media only where kept and drawn, the settings read only for a new run, a failed start marking the loggers
started before it, and check_loggers' refusals. Each is read back with the logger's own reader (TensorBoard's event
accumulator, the csv module, wandb's reader of its run files, MLflow's client) against hand-worked values."""

import csv
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

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


# ---- MLflow started directly, read back with MLflow's own client over the file store it wrote -------------------

@pytest.fixture
def mlflow_env(monkeypatch):
    """MLflow kept local: its file store allowed, telemetry off, no tracking server from the environment."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name in ("MLFLOW_ALLOW_FILE_STORE", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK"):
        monkeypatch.setenv(name, "true")


def mlflow_client(run):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(run / "logs" / "mlruns").resolve().as_uri())


def test_mlflow_makes_its_store_under_a_run_folder_not_there_yet_and_names_the_run_after_it(tmp_path, mlflow_env):
    run = tmp_path / "new" / "tiny-run"
    logger = loggers.Mlflow()
    logger.start(run, {}, 0)
    logger.finish(None)
    [found] = mlflow_client(run).search_runs([mlflow_client(run).get_experiment_by_name("gptlab").experiment_id])
    assert (found.info.run_id, found.info.run_name) == ((run / "logs" / "mlflow.id").read_text(), "tiny-run")


def test_mlflow_gets_every_one_of_250_settings_in_calls_of_at_most_100(tmp_path, mlflow_env):
    config = {"s": {f"k{i:03d}": i for i in range(250)}}  # 250 settings: three calls, the last of 50
    logger = loggers.Mlflow()
    logger.start(tmp_path, config, 0)
    logger.finish(None)
    params = mlflow_client(tmp_path).get_run(logger.ident).data.params
    assert params == {f"s.k{i:03d}": str(i) for i in range(250)}


def test_mlflow_puts_a_second_new_run_in_the_same_folder_into_the_same_gptlab_experiment(tmp_path, mlflow_env):
    idents = []
    for _ in range(2):  # a new run (resume_step 0) where an earlier one kept its store
        logger = loggers.Mlflow()
        logger.start(tmp_path, {}, 0)
        logger.finish(None)
        idents.append(logger.ident)
    client = mlflow_client(tmp_path)
    [experiment] = client.search_experiments()
    assert experiment.name == "gptlab"
    assert sorted(r.info.run_id for r in client.search_runs([experiment.experiment_id])) == sorted(idents)


def test_a_resumed_mlflow_run_is_running_again_until_it_ends(tmp_path, mlflow_env):
    first = loggers.Mlflow()
    first.start(tmp_path, {}, 0)
    first.finish(None)  # FINISHED, as a run that stopped at a checkpoint and is then resumed
    resumed = loggers.Mlflow()
    resumed.start(tmp_path, {}, 5)
    client = mlflow_client(tmp_path)
    assert (resumed.ident, client.get_run(first.ident).info.status) == (first.ident, "RUNNING")
    resumed.finish(None)
    assert client.get_run(first.ident).info.status == "FINISHED"


def test_media_makes_no_sample_without_a_logger_that_keeps_it_and_sends_no_missing_picture(tmp_path, mlflow_env):
    """The sample (64 tokens of generation) is made only for a logger that keeps media, once; a loss curve that
    was not drawn is not sent, while the sample still is."""
    made = []

    def sample():
        made.append(1)
        return "to be"

    loggers.Loggers([loggers.Csv()]).media(tmp_path / "loss.png", sample, 3)  # csv keeps no media
    assert made == []
    logger = loggers.Mlflow()
    logger.start(tmp_path, {}, 0)
    loggers.Loggers([logger]).media(tmp_path / "loss.png", sample, 3)  # no loss.png was drawn
    logger.finish(None)
    client = mlflow_client(tmp_path)
    assert [a.path for a in client.list_artifacts(logger.ident)] == ["sample.txt"] and made == [1]
    (tmp_path / "got").mkdir()
    assert Path(client.download_artifacts(logger.ident, "sample.txt", str(tmp_path / "got"))).read_text() == "to be"


# ---- open_loggers and check_loggers ----------------------------------------------------------------------------

def write_config(run):
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text('{"model": {"n_layer": 2}, "train": {"lr": 0.5}}')
    (run / "tokenizer.json").write_text("{}")


def test_open_loggers_reads_the_settings_only_for_a_new_run_with_loggers(tmp_path):
    """No config.json: no --log needs none, and a resume does not log the settings again, so neither reads it."""
    assert loggers.open_loggers([], tmp_path, 0).loggers == []
    with loggers.open_loggers(["csv"], tmp_path, 5) as started:
        assert [type(lg) for lg in started.loggers] == [loggers.Csv]
    with pytest.raises(GptlabError, match="is not a gptlab run"):
        loggers.open_loggers(["csv"], tmp_path, 0)


def test_a_logger_that_fails_to_start_marks_the_ones_started_before_it_failed(tmp_path, mlflow_env):
    write_config(tmp_path)
    (tmp_path / "logs" / "metrics.csv").mkdir(parents=True)  # the csv logger cannot write its file
    with pytest.raises(GptlabError, match="metrics.csv: Is a directory"):
        loggers.open_loggers(["mlflow", "csv"], tmp_path, 0)
    client = mlflow_client(tmp_path)
    run = client.get_run((tmp_path / "logs" / "mlflow.id").read_text())
    assert (run.info.status, run.data.params) == ("FAILED", {"model.n_layer": "2", "train.lr": "0.5"})


def test_a_csv_place_that_is_a_folder_is_refused_as_a_folder(tmp_path):
    (tmp_path / "logs" / "metrics.csv").mkdir(parents=True)
    with pytest.raises(GptlabError) as err:
        loggers.check_loggers(["csv"], tmp_path)
    assert str(err.value) == f"--log csv cannot write {tmp_path / 'logs' / 'metrics.csv'}: it is a folder"


def test_a_folder_the_user_may_write_but_not_search_is_refused(tmp_path):
    """A logger's folder with write but no search (x) permission cannot take files. Root passes every permission
    check but search on a folder with no x bit at all, so the check runs in a child process as the user nobody
    (uid 65534) when the tests run as root, on a folder under a fresh /tmp folder nobody can reach."""
    loggers.TensorBoard.load()  # imported before the child starts: it only checks
    with tempfile.TemporaryDirectory() as top:
        run = Path(top) / "run"
        folder = run / "logs" / "tensorboard"
        folder.mkdir(parents=True)
        os.chmod(top, 0o755)
        if os.geteuid() == 0:
            os.chown(folder, 65534, 65534)
        os.chmod(folder, 0o600)  # its owner may write, not search
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the pipe
            os.close(read)
            try:
                if os.geteuid() == 0:
                    os.setgid(65534)
                    os.setuid(65534)
                loggers.check_loggers(["tensorboard"], run)
                message = "no refusal"
            except BaseException as exc:  # noqa: BLE001 - reported whatever it is
                message = str(exc)
            os.write(write, message.encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            message = f.read().decode()
        os.waitpid(child, 0)
        os.chmod(folder, 0o700)
    assert message == f"--log tensorboard cannot write {folder}: {folder} is not writable"
