"""train --log: TensorBoard, CSV, Weights & Biases (offline) and MLflow (a local file store), each read back with its
own library's reader and held to metrics.jsonl, the record; after a resume past rows a crash left, each step once.
One run with all four loggers (wandb starts slowly) is shared by the module. A run that crashes is marked failed,
one stopped by a signal killed, never finished. No connection leaves the machine."""

import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict

import pytest
from PIL import Image

from helpers import CORPUS, TINY, inject_nan_at, run_bad, tree
from gptlab import checkpoint as ck
from gptlab.cli import main
from gptlab.config import TrainConfig
from gptlab.errors import GptlabError
from gptlab.model import GPT
from gptlab.training import loggers

# what a row's numbers are called in every logger: KIND/NAME, for these names (the list, and tokens)
NAMES = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "tokens", "train_loss", "val_loss")
ALWAYS = {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "eval/train_loss", "eval/val_loss"}
FLAGS = [*TINY, "--log-interval", "2", "--log", "tensorboard,csv", "--log", "wandb", "--log", "mlflow"]


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """Every logger kept on this machine: wandb offline with its folders in a temporary one, MLflow's telemetry
    off, no credentials or servers from the environment; a connection to anywhere but loopback fails the test."""
    home = tmp_path_factory.mktemp("wandb-home")
    connect = socket.socket.connect

    def loopback_only(self, address):
        host = address[0] if isinstance(address, tuple) else "unix"
        assert host in ("unix", "localhost", "::1") or host.startswith("127."), f"connection to {address}"
        return connect(self, address)

    with pytest.MonkeyPatch.context() as mp:
        for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
            mp.delenv(name, raising=False)
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            mp.setenv(name, str(home / name.lower()))
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("NETRC", str(home / "netrc"))
        for name in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "MLFLOW_ALLOW_FILE_STORE"):
            mp.setenv(name, "true")
        mp.setattr(socket.socket, "connect", loopback_only)
        yield home


@pytest.fixture(scope="module")
def logged(tmp_path_factory, offline):
    """A run of 10 steps (checkpoints at 5 and 10) with all four loggers, whose step-10 checkpoint is then lost, as
    if it had crashed after logging steps 6 to 10, resumed from step 5 to 10. Returns the run folder."""
    root = tmp_path_factory.mktemp("logged")
    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    assert main(["prepare", str(root / "corpus.txt"), "--out", str(root / "data"), "--quiet"]) == 0
    run = root / "run"
    train = ["train", "--data", str(root / "data"), "--run", str(run), "--max-steps", "10", *FLAGS]
    assert main(train) == 0
    first = {"csv": (run / "logs" / "metrics.csv").read_text(), "wandb": (run / "logs" / "wandb.id").read_text(),
             "metrics": (run / "metrics.jsonl").read_text()}
    shutil.rmtree(run / "checkpoints" / "step-00000010")
    assert main(["train", "--run", str(run), "--resume", "--quiet"]) == 0
    return run, first


def expected(run, metrics: str | None = None) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's numbers (or those of the `metrics` text) as {KIND/NAME: [(step, value), ...]} in the order
    written."""
    out = defaultdict(list)
    for line in (metrics or (run / "metrics.jsonl").read_text()).splitlines():
        row = json.loads(line)
        for name in NAMES:
            if name in row:
                out[f"{row['kind']}/{name}"].append((row["step"], row[name]))
    assert ALWAYS <= set(out)
    return dict(out)


def settings(run) -> dict:
    return json.loads((run / "config.json").read_text())


def pixels(png) -> bytes:
    return Image.open(png).convert("RGB").tobytes()


def test_the_resumed_run_is_the_one_the_loggers_hold(logged):
    """The scenario itself: the resume started at step 5, and metrics.jsonl holds each step once."""
    run, _ = logged
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((run / "config.json").read_text())["resumes"][0]["step"] == 5
    assert [(r["kind"], r["step"]) for r in rows] == [("train", 2), ("train", 4), ("eval", 5), ("train", 6),
                                                      ("train", 8), ("train", 10), ("eval", 10)]


def test_tensorboard_holds_each_step_once_with_metrics_jsonls_values(logged):
    """Read as TensorBoard reads it (the plugin event accumulator, which purges what a restart left behind)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util.tensor_util import make_ndarray

    run, _ = logged
    events = EventAccumulator(str(run / "logs" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    want = expected(run)
    assert set(events.PluginTagToContent("scalars")) == set(want)
    for tag, points in want.items():
        got = [(e.step, make_ndarray(e.tensor_proto).item()) for e in events.Tensors(tag)]
        assert got == [(step, pytest.approx(value, rel=1e-6)) for step, value in points], tag
    [picture] = events.Tensors("loss_curve")
    width, height, png = make_ndarray(picture.tensor_proto)
    assert picture.step == 10 and (int(width), int(height)) == Image.open(run / "loss.png").size
    assert pixels(io.BytesIO(png)) == pixels(run / "loss.png")
    [sample] = events.Tensors("sample/text_summary")
    [text] = events.Tensors("config/text_summary")
    logged = json.loads(make_ndarray(text.tensor_proto).item().decode().strip("`\n"))
    assert text.step == 0 and logged == {k: v for k, v in settings(run).items() if k != "resumes"}  # its start's
    assert sample.step == 10 and make_ndarray(sample.tensor_proto).item().decode().strip("`\n")
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    lr, width = hparams["train.lr"].number_value, hparams["model.n_embd"].number_value
    assert (lr, width) == (settings(run)["train"]["lr"], 16)
    assert hparams["train.log"].string_value == '["tensorboard", "csv", "wandb", "mlflow"]'


def test_the_csv_is_cut_back_to_the_checkpoint_and_holds_metrics_jsonls_rows(logged):
    run, first = logged
    with open(run / "logs" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    got = defaultdict(list)
    for row in rows:
        for name in NAMES:
            if row[name] != "":
                got[f"{row['kind']}/{name}"].append((int(row["step"]), float(row[name])))
    assert dict(got) == expected(run)  # exact: the CSV holds each number as Python writes it
    assert first["csv"].count("\n") == len(rows) + 1  # the first run's rows, as many (and its header)


def wandb_records(path) -> list[dict]:
    """The records of a .wandb file, read by wandb's own reader (`wandb leet inspect --json`)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_wandb_ran_offline_and_the_resume_continued_its_run(logged):
    run, first = logged
    ident = (run / "logs" / "wandb.id").read_text()
    assert ident == first["wandb"]
    folders = sorted((run / "logs" / "wandb" / "wandb").glob("*-run-*"))
    assert len(folders) == 2 and all(f.name.startswith("offline-run-") and f.name.endswith(ident) for f in folders)
    records = [wandb_records(f / f"run-{ident}.wandb") for f in folders]
    for file, metrics, since in ((records[0], first["metrics"], 0), (records[1], None, 5)):
        items = [r["history"]["item"] for r in file if r["type"] == "history"]
        got = {(tag, item["step"], value) for item in items for tag, value in item.items() if "/" in tag}
        want = {(tag, step, value) for tag, points in expected(run, metrics).items() for step, value in points}
        assert got == {point for point in want if point[1] > since}  # offline, a crash's rows stay in its file
    [media] = [r["history"]["item"] for r in records[1] if r["type"] == "history" and "loss_curve.path" in
               r["history"]["item"]]
    [config] = [r["run"]["config"]["update"] for r in records[0] if r["type"] == "run"]
    [meta] = [r["run"] for r in records[0] if r["type"] == "run"]
    assert (meta["project"], meta["display_name"]) == ("gptlab", run.name)  # WANDB_PROJECT unset: gptlab's own
    assert config["train"]["lr"] == settings(run)["train"]["lr"] and config["model"]["n_embd"] == 16
    assert media["step"] == 10 and pixels(folders[1] / "files" / media["loss_curve.path"]) == pixels(run / "loss.png")
    summary = {k: v for r in records[1] if r["type"] == "summary" for k, v in r["summary"]["update"].items()}
    assert summary["sample"] == next((run / "logs" / "mlruns").glob("*/*/artifacts/sample.txt")).read_text()


def test_mlflow_keeps_one_run_in_its_local_store_with_metrics_jsonls_values(logged):
    from mlflow.tracking import MlflowClient

    run, first = logged
    client = MlflowClient(tracking_uri=(run / "logs" / "mlruns").as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "gptlab"]
    [found] = client.search_runs([experiment.experiment_id])
    assert found.info.run_id == (run / "logs" / "mlflow.id").read_text() and found.info.status == "FINISHED"
    crashed = expected(run, first["metrics"])
    for tag, points in expected(run).items():  # a crash's rows stay in MLflow: the resumed run's come after them
        history = sorted(client.get_metric_history(found.info.run_id, tag), key=lambda m: m.timestamp)
        assert {(m.step, m.value) for m in history} == set(points) | set(crashed[tag]), tag
        assert all(abs(m.timestamp / 1000 - time.time()) < 3600 for m in history), tag  # MLflow's are milliseconds
        assert sorted({m.step: m.value for m in history}.items()) == points, tag
    params = found.data.params
    assert (params["train.lr"], params["model.n_embd"]) == (str(settings(run)["train"]["lr"]), "16")
    config = settings(run)  # every setting of the run's start, nested ones by their dotted names (resumes came later)
    names = {f"{k}.{inner}" if isinstance(v, dict) else k for k, v in config.items() if k != "resumes"
             for inner in (v if isinstance(v, dict) else [None])}
    assert set(params) == names
    assert {a.path for a in client.list_artifacts(found.info.run_id)} == {"loss.png", "sample.txt"}


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_a_missing_package_is_named_in_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch,
                                                                           offline, name):
    (tmp_path / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    assert main(["prepare", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "data"), "--quiet"]) == 0
    monkeypatch.setitem(sys.modules, name, None)  # what `import NAME` does where the package is not installed
    before = tree(tmp_path)
    line = run_bad(capsys, "train", "--data", str(tmp_path / "data"), "--run", str(tmp_path / "run"), *TINY,
                   "--log", f"csv,{name}")
    assert line == f"gptlab: error: --log {name} needs the {name} package: pip install 'gptlab[{name}]'"
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name, blocker, message", [
    ("csv", "logs", "{run}/logs/metrics.csv: {run}/logs is a file, not a folder"),
    ("tensorboard", "logs/tensorboard", "{run}/logs/tensorboard: it is a file"),
])
def test_a_logger_whose_place_cannot_be_written_is_refused_in_one_line(tmp_path, capsys, name, blocker, message):
    (tmp_path / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    assert main(["prepare", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "data"), "--quiet"]) == 0
    run = tmp_path / "run"
    (run / blocker).parent.mkdir(parents=True, exist_ok=True)
    (run / blocker).write_text("not a logger's")
    before = tree(tmp_path)
    line = run_bad(capsys, "train", "--data", str(tmp_path / "data"), "--run", str(run), *TINY, "--log", name)
    assert line == f"gptlab: error: --log {name} cannot write " + message.format(run=run)
    assert tree(tmp_path) == before


def test_log_names_are_checked_and_may_be_repeated_or_joined():
    assert TrainConfig(log=["tensorboard,csv", "csv", "wandb"]).log == ["tensorboard", "csv", "wandb"]
    with pytest.raises(GptlabError, match="^log must be one of tensorboard, csv, wandb, mlflow, not 'comet'$"):
        TrainConfig(log=["csv,comet"])


def test_wandb_goes_online_only_for_a_user_who_logged_in(tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert loggers.wandb_mode() == "offline"  # no netrc at all
    (tmp_path / "netrc").write_text("machine example.com login user password secret\n")
    assert loggers.wandb_mode() == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password secret\n")  # what `wandb login` writes
    assert loggers.wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert loggers.wandb_mode() == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert loggers.wandb_mode() == "online"


def test_mlflow_gets_its_file_store_allowed_and_telemetry_off_unless_the_user_set_them(monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "false")  # the user's own choice is kept
    loggers.Mlflow.load()
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true" and os.environ["MLFLOW_DISABLE_TELEMETRY"] == "false"


# ---- how a run that stops short is marked ---------------------------------------------------------------------

def stop_at(monkeypatch, step: int, how: str) -> None:
    """Make training stop during the forward pass of `step` (1-based): "nan" a NaN loss (training's guard raises, a
    crash), "sigint" SIGINT sent to this process (the graceful stop: the step ends, a checkpoint, then the stop),
    "ctrl-c" a KeyboardInterrupt raised there (Ctrl-C where no graceful stop holds it)."""
    if how == "nan":
        inject_nan_at(monkeypatch, step)
        return
    forward, calls = GPT.forward, [0]

    def stopping(self, idx, targets=None, **kwargs):
        if self.training and targets is not None:
            calls[0] += 1
            if calls[0] == step and how == "sigint":
                signal.raise_signal(signal.SIGINT)
            elif calls[0] == step:
                raise KeyboardInterrupt
        return forward(self, idx, targets, **kwargs)

    monkeypatch.setattr(GPT, "forward", stopping)


def recorded_end(run) -> tuple[str, int]:
    """How the run's end was recorded, each read by its own library: the MLflow run's status, and the exit code of
    the exit record in W&B's offline run file."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "logs" / "mlruns").as_uri())
    [found] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    ident = (run / "logs" / "wandb.id").read_text()
    [folder] = (run / "logs" / "wandb" / "wandb").glob(f"offline-run-*-{ident}")
    [exit_record] = [r["exit"] for r in wandb_records(folder / f"run-{ident}.wandb") if r["type"] == "exit"]
    return found.info.status, exit_record["exit_code"]


@pytest.mark.parametrize("how, code, status, exit_code", [
    ("nan", 2, "FAILED", 1),  # a crash: gptlab's one error line, status 2
    ("sigint", 130, "KILLED", 130),  # stopped by SIGINT: 128 + 2, as the process exits
    ("ctrl-c", 130, "KILLED", 130),
])
def test_a_run_that_crashes_or_is_interrupted_is_marked_failed_or_killed_not_finished(
        tmp_path, char_data, monkeypatch, capsys, offline, how, code, status, exit_code):
    run = tmp_path / "run"
    stop_at(monkeypatch, 3, how)
    assert main(["train", "--data", str(char_data), "--run", str(run), "--max-steps", "6", *TINY,
                 "--log", "wandb,mlflow"]) == code
    assert recorded_end(run) == (status, exit_code)
    assert (ck.find_checkpoint(run) is not None) == (how == "sigint")  # the graceful stop wrote its step's
