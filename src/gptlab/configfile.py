"""Settings files (`gptlab train --config FILE`, TOML or JSON): a file's model and training settings and its preset,
data and run, the paths read from the file's folder; a run's config.json is one."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from gptlab.config import ModelConfig, TrainConfig
from gptlab.errors import GptlabError

CONFIG_TABLES = ("model", "train")
CONFIG_PATHS = ("data", "run")  # read relative to the config file's folder
CONFIG_NAMES = ("preset", *CONFIG_PATHS)
# what a run's config.json records besides its settings: a config file may carry them, they set nothing
RECORDED = {"gptlab_version", "git_commit", "precision", "device", "processes", "resumes", "imported_from"}


def _read_config_raw(path: Path) -> dict[str, Any]:
    """The named settings in a TOML or JSON file; GptlabError when it is missing, unreadable or not a table."""
    import tomllib

    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except FileNotFoundError:
        raise GptlabError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise GptlabError(f"config file {path} cannot be read: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise GptlabError(f"config file {path} cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise GptlabError(f"config file {path} must hold named settings")
    return raw


def read_config_file(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A config file's (model settings, training settings, the rest: preset, data, run). TOML or JSON; fields
    flat or in [model] / [train] tables; data and run relative to the file's folder. Raises GptlabError naming
    the problem: a file it cannot read, a table that is not one ([[model]]), a path that is not text, an unknown
    field."""
    path = Path(path)
    raw = _read_config_raw(path)
    for table in CONFIG_TABLES:
        if not isinstance(raw.get(table, {}), dict):
            kind = "a list (TOML's [[...]] makes a list of tables)" if isinstance(raw[table], list) else \
                repr(raw[table])
            raise GptlabError(f"config file {path}: [{table}] must be a table of settings (name = value), not "
                              f"{kind}")
    flat = {**{k: v for k, v in raw.items() if k not in CONFIG_TABLES}, **raw.get("model", {}),
            **raw.get("train", {})}
    model_names, train_names = ({f.name for f in fields(c)} for c in (ModelConfig, TrainConfig))
    unknown = sorted(set(flat) - model_names - train_names - set(CONFIG_NAMES) - RECORDED)
    if unknown:
        raise GptlabError(f"config file {path}: unknown setting {unknown[0]!r} (see `gptlab train --help`)")
    rest = {k: v for k, v in flat.items() if k in CONFIG_NAMES}
    for name, value in rest.items():
        what = "text (a path)" if name in CONFIG_PATHS else "text"
        if not isinstance(value, str):
            raise GptlabError(f"config file {path}: {name} must be {what}, not {value!r}")
    rest.update({k: str(path.parent / v) for k, v in rest.items() if k in CONFIG_PATHS})
    return ({k: v for k, v in flat.items() if k in model_names},
            {k: v for k, v in flat.items() if k in train_names}, rest)
