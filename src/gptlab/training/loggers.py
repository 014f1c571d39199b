"""Where training's rows go besides metrics.jsonl, which stays the record: TensorBoard, a CSV file, Weights & Biases
and MLflow, each asked for with `--log NAME`, its package imported only then, its files under RUN/logs. Each logs the
scalars of every row at its step, the run's settings when a run starts, and at the end the loss curve and a short
sample where it keeps pictures and text. A resume continues the same logger run from the checkpoint's step."""

from __future__ import annotations

import csv
import importlib
import io
import json
import netrc
import os
import secrets
import signal
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Callable
from urllib.parse import urlsplit

import torch

from gptlab import rundir
from gptlab.errors import GptlabError
from gptlab.training.faults import Interrupted

LOGS = "logs"  # RUN/logs: every logger's files
# the numbers of a metrics.jsonl row each logger keeps, named KIND/NAME (train/loss, eval/val_loss)
LOGGED = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "tokens", "train_loss", "val_loss")
SAMPLE_TOKENS = 64  # the sample logged at the end: this many tokens after the validation split's first


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers among LOGGED as {"KIND/NAME": value}."""
    return {f"{row['kind']}/{name}": float(row[name]) for name in LOGGED if name in row}


def ending(exc: BaseException | None) -> tuple[str, int]:
    """How training ended, from the exception that ended it (None: none), as (MLflow's run status, the exit code
    W&B records): ("FINISHED", 0); stopped by a signal (Interrupted, or Ctrl-C's KeyboardInterrupt) ("KILLED",
    128 + its number, the status gptlab then exits with); anything else, a crash, ("FAILED", 1). W&B marks a run
    failed for any exit code but 0."""
    if exc is None:
        return "FINISHED", 0
    if isinstance(exc, Interrupted):
        return "KILLED", exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return "KILLED", 128 + signal.SIGINT
    return "FAILED", 1


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as one level ({"model": {"n_layer": 2}} -> {"model.n_layer": 2}); a value that is not a
    number, text or true-or-false becomes its JSON."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            plain = isinstance(value, (int, float, str, bool))
            out[prefix + key] = value if plain else json.dumps(value)
    return out


class Logger:
    """One backend: `start` opens (or, when resume_step > 0, continues) its run, `log` takes each metrics.jsonl row,
    `media` the loss curve's PNG and a sample, `finish` closes it (`exc`: the exception that stopped training, None
    when it ran to its end; see `ending`)."""

    name = ""
    modules: tuple[str, ...] = ()  # imported before training starts: a missing one refuses the run
    extra = ""  # the gptlab extra that installs them
    folder = True  # what `where` names: a folder, or a file
    keeps_media = True
    env: dict[str, str] = {}  # set before importing, where not set already

    @classmethod
    def where(cls, run: Path) -> Path:
        return run / LOGS / cls.name

    @classmethod
    def load(cls) -> None:
        """Import the backend's modules; GptlabError naming the extra when one is missing."""
        for key, value in cls.env.items():
            os.environ.setdefault(key, value)
        for module in cls.modules:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                if exc.name and module.startswith(exc.name.split(".")[0]):
                    raise GptlabError(f"--log {cls.name} needs the {cls.extra} package: pip install "
                                      f"'gptlab[{cls.extra}]'") from None
                raise GptlabError(f"--log {cls.name}: importing {module} failed: {exc}") from None

    def start(self, run: Path, config: dict[str, Any], resume_step: int) -> None:
        raise NotImplementedError

    def log(self, row: dict[str, Any]) -> None:
        raise NotImplementedError

    def media(self, png: Path | None, sample: str | None, step: int) -> None:
        pass

    def finish(self, exc: BaseException | None) -> None:
        pass


def kept_id(run: Path, name: str, resume_step: int) -> str | None:
    """On a resume, the id of the backend's run kept in RUN/logs/NAME.id (None when there is none)."""
    path = run / LOGS / f"{name}.id"
    return (path.read_text().strip() or None) if resume_step and path.is_file() else None


def keep_id(run: Path, name: str, ident: str) -> str:
    """Keep `ident` as the backend's run id in RUN/logs/NAME.id; returns it."""
    rundir.write_atomic(run / LOGS / f"{name}.id", ident.encode())
    return ident


class TensorBoard(Logger):
    """Event files in RUN/logs/tensorboard, written by torch's SummaryWriter; a resume purges what a crashed run
    logged past the checkpoint (and a new run everything), so each step is on the axis once."""

    name, modules, extra = "tensorboard", ("tensorboard", "torch.utils.tensorboard"), "tensorboard"

    def start(self, run: Path, config: dict[str, Any], resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(self.where(run)), purge_step=resume_step + 1 if resume_step else 0)
        if not resume_step:
            for summary in hparams(flat(config), {"eval/val_loss": None}):  # the metric's values: its scalars
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, row: dict[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, row["step"])

    def media(self, png: Path | None, sample: str | None, step: int) -> None:
        import numpy as np
        from PIL import Image

        if png is not None:
            picture = np.asarray(Image.open(png).convert("RGB"))  # (H, W, 3)
            self.writer.add_image("loss_curve", picture, step, dataformats="HWC")
        if sample is not None:
            self.writer.add_text("sample", "```\n" + sample + "\n```", step)

    def finish(self, exc: BaseException | None) -> None:
        self.writer.close()


class Csv(Logger):
    """RUN/logs/metrics.csv: one line per metrics.jsonl row, its step, kind and LOGGED (empty where the row has
    none); a resume cuts it back to the checkpoint's step, as metrics.jsonl is."""

    name, folder, keeps_media = "csv", False, False
    columns = ("step", "kind", *LOGGED)

    @classmethod
    def where(cls, run: Path) -> Path:
        return run / LOGS / "metrics.csv"

    def start(self, run: Path, config: dict[str, Any], resume_step: int) -> None:
        path = self.where(run)
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step and path.is_file():
            with open(path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if r.get("step", "").isdigit() and int(r["step"]) <= resume_step]
        text = io.StringIO()
        writer = csv.DictWriter(text, self.columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(kept)
        rundir.write_atomic(path, text.getvalue().encode())
        self.file = open(path, "a", newline="")
        self.writer = csv.DictWriter(self.file, self.columns, extrasaction="ignore")

    def log(self, row: dict[str, Any]) -> None:
        self.writer.writerow({k: row[k] for k in self.columns if k in row})
        self.file.flush()

    def finish(self, exc: BaseException | None) -> None:
        self.file.close()


def wandb_mode() -> str:
    """WANDB_MODE when set, else online when the user has logged in (WANDB_API_KEY, or `wandb login`'s entry in
    ~/.netrc for the W&B host), else offline: nothing leaves the machine."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "online"
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        logged_in = netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"


class Wandb(Logger):
    """A Weights & Biases run in RUN/logs/wandb (offline there unless the user has logged in: see wandb_mode),
    project WANDB_PROJECT or gptlab; its id is kept in RUN/logs/wandb.id, so a resume continues it. The step is
    logged as the metric `step`, every other number against it."""

    name, modules, extra = "wandb", ("wandb",), "wandb"

    def start(self, run: Path, config: dict[str, Any], resume_step: int) -> None:
        import wandb

        folder = self.where(run)
        folder.mkdir(parents=True, exist_ok=True)
        ident = kept_id(run, self.name, resume_step) or keep_id(run, self.name, secrets.token_hex(4))
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "gptlab"), name=run.name, id=ident,
                              resume="allow", dir=str(folder), mode=wandb_mode(), config=config or None,
                              settings=wandb.Settings(console="off"))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: dict[str, Any]) -> None:
        self.run.log({"step": row["step"], **scalars(row)})

    def media(self, png: Path | None, sample: str | None, step: int) -> None:
        import wandb

        if png is not None:
            self.run.log({"step": step, "loss_curve": wandb.Image(str(png))})
        if sample is not None:
            self.run.summary["sample"] = sample

    def finish(self, exc: BaseException | None) -> None:
        self.run.finish(exit_code=ending(exc)[1])


class Mlflow(Logger):
    """An MLflow run in the file store RUN/logs/mlruns (a file: URI: no server is asked), experiment gptlab; its id
    is kept in RUN/logs/mlflow.id, so a resume continues it. MLflow's telemetry is off, and its file store allowed,
    unless the environment says otherwise."""

    name, modules, extra = "mlflow", ("mlflow",), "mlflow"
    env = {"MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}

    @classmethod
    def where(cls, run: Path) -> Path:
        return run / LOGS / "mlruns"

    def start(self, run: Path, config: dict[str, Any], resume_step: int) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        store = self.where(run)
        store.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=store.resolve().as_uri())
        self.ident = kept_id(run, self.name, resume_step)
        if self.ident is not None:
            try:
                self.client.update_run(self.ident, status="RUNNING")
                return
            except MlflowException:  # its store was removed: a new run, then
                pass
        self.ident = keep_id(run, self.name, self.client.create_run(self.experiment(), run_name=run.name).info.run_id)
        params = [Param(k, str(v)) for k, v in flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.ident, params=params[i:i + 100])

    def experiment(self) -> str:
        found = self.client.get_experiment_by_name("gptlab")
        return found.experiment_id if found else self.client.create_experiment("gptlab")

    def log(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, row["step"]) for tag, value in scalars(row).items()]
        self.client.log_batch(self.ident, metrics=metrics)

    def media(self, png: Path | None, sample: str | None, step: int) -> None:
        if png is not None:
            self.client.log_artifact(self.ident, str(png))
        if sample is not None:
            self.client.log_text(self.ident, sample, "sample.txt")

    def finish(self, exc: BaseException | None) -> None:
        self.client.set_terminated(self.ident, ending(exc)[0])


BACKENDS: dict[str, type[Logger]] = {b.name: b for b in (TensorBoard, Csv, Wandb, Mlflow)}


class Loggers:
    """The loggers a run asked for, as one: each call goes to every one; as a context, finishes them all."""

    def __init__(self, loggers: list[Logger] | None = None):
        self.loggers = loggers or []

    def log(self, row: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(row)

    def media(self, png: Path, sample: Callable[[], str | None], step: int) -> None:
        """The loss curve (when `png` was drawn) and a sample (made only when a logger keeps media) to the loggers
        that keep media."""
        keeping = [logger for logger in self.loggers if logger.keeps_media]
        text = sample() if keeping else None
        for logger in keeping:
            logger.media(png if png.is_file() else None, text, step)

    def __enter__(self) -> Loggers:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for logger in self.loggers:
            logger.finish(exc)


def open_loggers(names: list[str], run: Path, resume_step: int) -> Loggers:
    """Start the loggers called `names` for `run`, whose folder is written already: new ones with the run's
    settings, or, when resume_step > 0, continuing their runs from that step."""
    config = rundir.read_run_config(run) if names and not resume_step else {}
    started = Loggers()
    try:
        for name in names:
            logger = BACKENDS[name]()
            logger.start(run, config, resume_step)
            started.loggers.append(logger)
    except BaseException as exc:
        for logger in started.loggers:
            logger.finish(exc)
        raise
    return started


def check_loggers(names: list[str], run: Path) -> None:
    """Before anything is written: each logger's package imports, and its folder (or file) under `run` can be
    made or written. GptlabError in one line otherwise."""
    for name in names:
        backend = BACKENDS[name]
        backend.load()
        path = backend.where(run)
        found = next(p for p in (path, *path.parents) if p.exists())
        if found == path and path.is_dir() != backend.folder:
            raise GptlabError(f"--log {name} cannot write {path}: it is {'a file' if backend.folder else 'a folder'}")
        if found != path and not found.is_dir():
            raise GptlabError(f"--log {name} cannot write {path}: {found} is a file, not a folder")
        if not os.access(found, os.W_OK | (os.X_OK if found.is_dir() else 0)):
            raise GptlabError(f"--log {name} cannot write {path}: {found} is not writable")


@torch.no_grad()
def sample_ids(model: torch.nn.Module, first: int, block_size: int, device: torch.device) -> list[int]:
    """SAMPLE_TOKENS ids drawn from `model` after `first`, seeded (the same on every call), in eval mode."""
    was_training = model.training
    model.eval()
    idx = torch.tensor([[first]], device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    for _ in range(SAMPLE_TOKENS):
        logits, _ = model(idx[:, -block_size:])
        probs = torch.softmax(logits[:, -1].float(), dim=-1)  # (1, V)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    model.train(was_training)
    return idx[0].tolist()
