"""Run folders: what a run directory holds besides its checkpoints' tensors (config.json with the resolved settings,
tokenizer.json, metrics.jsonl, and each checkpoint's state.json, whose schema is TrainingState), how its small files
are written (atomically: temp file, fsync, rename), and the lock that gives a run folder one writer at a time."""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from gptlab import __version__
from gptlab.config import ModelConfig, TrainConfig, from_dict, to_dict
from gptlab.errors import GptlabError
from gptlab.tokenizer import Tokenizer

CONFIG, TOKENIZER, METRICS, CKPTS, LOCK = "config.json", "tokenizer.json", "metrics.jsonl", "checkpoints", ".lock"
STATE = "state.json"  # in each checkpoint folder: a TrainingState


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask_mode() -> int:
    """The mode open() gives a new file here (0o666 less the umask), for files a library writes with its own mode
    (safetensors: 0600). Read from /proc where it can be, as setting the umask to learn it races other threads."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` in one step: temp file in the same folder, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise GptlabError(f"cannot write {path}: {exc.strerror}; check free space and permissions") from None
    fsync_dir(path.parent)


def write_json(path: str | Path, obj: Any) -> None:
    write_atomic(path, (json.dumps(obj, indent=2) + "\n").encode())


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """The commit of the gptlab source tree when it is a git checkout, else "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---- run directories -------------------------------------------------------------------------------------------

def is_run(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file() and (Path(path) / TOKENIZER).is_file()


def folder_kind(path: str | Path) -> str | None:
    """What a folder holds, for refusing to write one kind of thing over another: "run" (a gptlab run: its
    config.json has model and train settings), "data" (a prepared data folder), "hf" (another config.json, e.g.
    a Hugging Face model), or None."""
    path = Path(path)
    if (path / "meta.json").is_file() and ((path / "train.bin").is_file() or any(path.glob("train-*.bin"))):
        return "data"
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return "hf"
        return "run" if isinstance(config, dict) and {"model", "train"} <= set(config) else "hf"
    return None


def init_run(run_dir: str | Path, model_cfg: ModelConfig, train_cfg: TrainConfig, tokenizer: Tokenizer,
             extra: dict[str, Any]) -> Path:
    """Fill a new run directory with its resolved settings and tokenizer (a run being resumed keeps both; see
    update_run_config)."""
    run = Path(run_dir)
    try:
        (run / CKPTS).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GptlabError(f"cannot create run folder {run}: {exc.strerror}") from None
    write_atomic(run / TOKENIZER, json.dumps(tokenizer.to_dict(), ensure_ascii=False).encode())
    write_json(run / CONFIG, {"model": to_dict(model_cfg), "train": to_dict(train_cfg), **extra,
                              "gptlab_version": __version__, "git_commit": git_commit()})
    return run


def update_run_config(run_dir: str | Path, model_cfg: ModelConfig, train_cfg: TrainConfig, extra: dict[str, Any],
                      resume: dict[str, Any]) -> None:
    """On a resume that passed every check: the settings now in force, and one more entry in the `resumes`
    history (every resume is kept)."""
    path = Path(run_dir) / CONFIG
    config = read_run_config(run_dir)
    config.update({"model": to_dict(model_cfg), "train": to_dict(train_cfg), **extra})
    config["resumes"] = [*config.get("resumes", []), resume]
    write_json(path, config)


# ---- a checkpoint's state.json -----------------------------------------------------------------------------------

@dataclass
class TrainingState:
    """A checkpoint's state.json: where training stood when the checkpoint was written and what it was trained
    with. The one schema that writes and reads the file. A field a checkpoint has no value for is None and left out
    of the file: imported weights have no training settings or progress, and files written by earlier versions lack
    `sampler`, `optimizer` and the `optimizer` training setting (AdamW's, then the only one); keys a later version
    adds are ignored on reading."""

    model: dict[str, Any]  # the model's settings (a ModelConfig as JSON): what the weights' shapes follow
    step: int = 0  # optimizer steps taken (save_checkpoint stamps it)
    train: dict[str, Any] | None = None  # the training settings (a TrainConfig as JSON)
    tokens_seen: int | None = None
    best_val_loss: float | None = None  # lowest validation loss so far (Infinity before the first evaluation)
    val_loss: float | None = None  # of the last evaluation (NaN before the first)
    data_fingerprint: str | None = None  # batches.Dataset.fingerprint of the data trained on
    sampler: dict[str, int] | None = None  # {"seed", "next_step"}: the next batch is drawn from (seed, next_step)
    optimizer: dict[str, Any] | None = None  # the optimizer state's JSON part (step checkpoints; see checkpoint.py)
    imported_from: str | None = None  # the folder imported weights came from (gptlab import)
    base: dict[str, str] | None = None  # a LoRA run's base: {"run": its folder, "sha256": lora.tensors_sha256}
    gptlab_version: str | None = None
    git_commit: str | None = None
    time: float | None = None  # when it was written, seconds since the epoch (save_checkpoint stamps it)

    def to_json(self) -> dict[str, Any]:
        """The file's JSON object: every field that has a value."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: Any, source: str | Path) -> TrainingState:
        """The state in `data` (state.json's JSON); GptlabError naming `source` when it has no step and model."""
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict) or \
                not isinstance(data.get("step"), int) or isinstance(data.get("step"), bool):
            raise GptlabError(f"{source} holds no checkpoint state (a step and the model's settings); the checkpoint "
                              "is damaged")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def write(self, folder: str | Path) -> None:
        """Write state.json into `folder` (a checkpoint's temporary folder, made atomic by its rename)."""
        (Path(folder) / STATE).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def read(cls, folder: str | Path) -> TrainingState:
        """The state.json in `folder`; GptlabError when it is not JSON or not a checkpoint's state."""
        path = Path(folder) / STATE
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise GptlabError(f"{path} is not valid JSON; the checkpoint is damaged") from None
        return cls.from_json(data, path)


# ---- one writer per run folder ---------------------------------------------------------------------------------

class RunLock:
    """An exclusive lock on a run folder for the one process that writes it (`gptlab train`). It is a
    `flock` on RUN/.lock, which the OS releases when the process ends in any way (kill -9 leaves no stale
    lock); while held, the file names its holder, so that a second writer is refused with a useful message.
    Creates the folder when it is missing; `undo` takes back what the lock added, after a refusal. Readers
    never lock: checkpoints are committed atomically, so they always read a complete one."""

    def __init__(self, run_dir: str | Path):
        self.run = Path(run_dir)
        self.created = not self.run.exists()
        self.created_file = not (self.run / LOCK).exists()
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        try:
            self.run.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.run / LOCK, os.O_RDWR | os.O_CREAT, 0o666)  # less the umask, as every file
        except OSError as exc:
            raise GptlabError(f"cannot create run folder {self.run}: {exc.strerror}") from None
        try:
            import fcntl
        except ImportError:  # Windows: no flock; one writer is then the user's to ensure
            return self
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            self.fd = None
            raise GptlabError(f"run {self.run} is being written by {holder}; wait for it to finish (or stop it), or "
                              "train into another --run") from None
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        holder = f"`gptlab {' '.join(sys.argv[1:])}` (pid {os.getpid()} on {socket.gethostname()}, since {since})"
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, holder.encode(), 0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # the lock file goes back to empty: a refused command leaves it as it was
            os.close(self.fd)
            self.fd = None

    @staticmethod
    def held(run_dir: str | Path) -> bool:
        """Whether some process is writing the run now (asked without creating anything)."""
        try:
            import fcntl

            fd = os.open(Path(run_dir) / LOCK, os.O_RDONLY)
        except (ImportError, OSError):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)

    def undo(self) -> None:
        """After a refusal, or a new run's failure before its first step: remove the folder if this lock created
        it and no checkpoint was committed in it, else the lock file if this lock created that."""
        if self.created and not any((self.run / CKPTS).glob("[sb]*-*")):
            shutil.rmtree(self.run, ignore_errors=True)
        elif self.created_file:
            (self.run / LOCK).unlink(missing_ok=True)


def read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's config.json; raises GptlabError when `run_dir` is missing or not a gptlab run."""
    run = Path(run_dir)
    if not run.exists():
        raise GptlabError(f"run folder {run} does not exist; train one with `gptlab train --run {run}`")
    if not is_run(run):
        raise GptlabError(f"{run} is not a gptlab run (no {CONFIG} and {TOKENIZER}); point --run at a folder "
                          "made by `gptlab train` or `gptlab import`")
    try:
        config = json.loads((run / CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GptlabError(f"{run / CONFIG} is damaged (not valid JSON)") from None
    if not isinstance(config, dict) or not {"model", "train"} <= set(config):
        raise GptlabError(f"{run / CONFIG} is not a gptlab run config (no model and train settings)")
    try:
        if not isinstance(config["model"], dict) or not isinstance(config["train"], dict):
            raise GptlabError("its model and train settings must be JSON objects")
        from_dict(ModelConfig, config["model"])
        from_dict(TrainConfig, config["train"])
        if not isinstance(config.get("data"), (str, type(None))):
            raise GptlabError(f"data must be the path of a prepared data folder, not {config['data']!r}")
    except GptlabError as exc:
        raise GptlabError(f"{run / CONFIG} is damaged: {exc}; fix it by hand or restore it") from None
    return config
