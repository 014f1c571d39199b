"""Run policy as a library: a preset, a config file, overrides, the data, `resume` and `init_from` become one typed,
validated `TrainSpec`; run folders are chosen, listed and described here. `gptlab train` and Python callers use the
same functions:

    spec = resolve(preset="char-small", model={"n_layer": 4}, train={"max_steps": 500}, run="runs/mine")
    result = start(spec)

Settings are applied in this order, later ones winning: the preset (or, on a resume, the run's own config.json),
a config file (TOML or JSON: flat `name = value` fields, or [model] / [train] tables; a run's config.json is one),
then the overrides.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlab import checkpoint as ck
from gptlab import lora, rundir
from gptlab.config import (DEFAULT_PRESET, FINETUNE_PRESET, NATIVE_ENGINES, ModelConfig, TrainConfig, build, from_dict,
                           get_preset, to_dict)
from gptlab.configfile import read_config_file
from gptlab.data.prepare import prepare
from gptlab.errors import GptlabError
from gptlab.rundata import check_data_tokenizer, check_data_unchanged

if TYPE_CHECKING:
    from gptlab.training.train import TrainResult

log = logging.getLogger("gptlab")
RUNS = Path("runs")
DATA = Path("data")


@dataclass
class TrainSpec:
    """Everything `start` needs: where, on what, with which settings, and whether it continues a run."""

    run: Path
    data: Path
    model: ModelConfig
    train: TrainConfig
    resume: bool = False
    preset: str = DEFAULT_PRESET
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in config.json


def default_data_dir(tokenizer: str) -> Path:
    return DATA / f"tinyshakespeare-{tokenizer}"


def pick_run_dir(preset: str, run: str | Path | None = None, resume: bool = False) -> Path:
    """`run` if given; otherwise runs/PRESET, or runs/PRESET-2, -3, ... so that no earlier run is overwritten and
    none being trained now is taken (with resume: runs/PRESET)."""
    if run:
        return Path(run)
    candidate, n = RUNS / preset, 1
    while not resume and (rundir.RunLock.held(candidate) or any((candidate / rundir.CKPTS).glob("[sb]*-*"))):
        n += 1
        candidate = RUNS / f"{preset}-{n}"
    return candidate


def resolve(preset: str | None = None, model: dict[str, Any] | None = None, train: dict[str, Any] | None = None,
            run: str | Path | None = None, data: str | Path | None = None, resume: bool | str = False,
            config_file: str | Path | None = None, quiet: bool = False) -> TrainSpec:
    """The one validated spec for a training run. `resume` may be "auto" (continue when the run has a valid
    checkpoint). With `init_from` (in `train`) the model's shape comes from that run or Hugging Face folder. The
    bundled corpus is prepared when no data is given and it is missing. Raises GptlabError on bad settings."""
    file_model, file_train, rest = read_config_file(config_file) if config_file else ({}, {}, {})
    model, train = {**file_model, **(model or {})}, {**file_train, **(train or {})}
    run, data = run or rest.get("run"), data or rest.get("data")
    init_from = train.get("init_from")
    preset_name = preset or rest.get("preset") or (FINETUNE_PRESET if init_from else DEFAULT_PRESET)
    base = get_preset(preset_name)
    model_base, train_base = dict(base.model), dict(base.train)
    run_dir = pick_run_dir(preset_name, run, bool(resume))
    if resume == "auto":
        resume = rundir.is_run(run_dir) and ck.find_checkpoint(run_dir, "step") is not None
    extra: dict[str, Any] = {"preset": preset_name}
    if resume:
        saved = rundir.read_run_config(run_dir)
        model_base, train_base = saved["model"], saved["train"]
        extra = {"preset": saved.get("preset", preset_name)}
    elif init_from or preset_name == FINETUNE_PRESET:
        model_base = init_from_model_base(init_from, model_base)
    model_cfg = build(ModelConfig, model_base, model)
    train_cfg = build(TrainConfig, train_base, train)
    data_dir = data_dir_for(data, extra["preset"], quiet, run_dir if resume else None)
    if init_from and not resume:
        check_data_tokenizer(data_dir, init_from)  # before a vocabulary grown for another tokenizer is blamed
        train_cfg.init_from = str(Path(init_from).resolve())  # recorded whole: a resume finds it from anywhere
        if model_cfg.vocab_size:  # 0 is "the data's", taken when training starts
            model_cfg.vocab_size = max(model_cfg.vocab_size, _data_vocab(data_dir))  # + the chat markers, if any
    return TrainSpec(run_dir, data_dir, model_cfg, train_cfg, bool(resume), extra["preset"], extra)


def _data_vocab(data_dir: Path) -> int:
    """The size of the prepared conversations' vocabulary (0 for other data, or none prepared yet): fine-tuning on
    conversations grows the source's vocabulary by the chat markers (hf.init_tensors checks that this is all that
    differs; any other tokenizer is refused there, not grown for)."""
    from gptlab.tokenizer import ChatTokenizer, load as load_tokenizer

    file = Path(data_dir) / "tokenizer.json"
    tokenizer = load_tokenizer(file) if file.is_file() else None
    return tokenizer.vocab_size if isinstance(tokenizer, ChatTokenizer) else 0


def init_from_model_base(source: str | None, model_base: dict[str, Any]) -> dict[str, Any]:
    """With --init-from the model's shape comes from the source; the preset and flags still set dropout, the
    attention path and a shorter block_size."""
    from gptlab.hf.gpt2_folders import source_model_config

    if not source:
        raise GptlabError(f"the {FINETUNE_PRESET} preset continues training a model; name it with --init-from "
                          "RUN_OR_HF_FOLDER")
    shape = {k: v for k, v in to_dict(source_model_config(source)).items() if k not in ("dropout", "attention")}
    return {**model_base, **shape}


def run_data_dir(run: str | Path) -> Path | None:
    """The data folder a run was trained on, from its config.json (None for an imported run); GptlabError when it
    is no longer there, or was prepared again since (rundata.check_data_unchanged)."""
    saved = rundir.read_run_config(run).get("data")
    if not saved:
        return None
    if not (Path(saved) / "meta.json").is_file():
        raise GptlabError(f"run {run} was trained on {saved}, which is no longer a prepared data folder; pass --data "
                          "with its new place")
    check_data_unchanged(run, saved)
    return Path(saved)


def data_dir_for(data: str | Path | None, preset: str, quiet: bool = False, run: str | Path | None = None) -> Path:
    """`data`; else, for a run being resumed (`run`), the data it was trained on; else the bundled corpus
    prepared for the preset's tokenizer (prepared now if it is missing)."""
    if data:
        if run is not None:
            check_data_unchanged(run, data)  # the run's own folder, prepared again: not "other data"
        return Path(data)
    if run is not None and (saved := run_data_dir(run)) is not None:
        return saved
    tokenizer = get_preset(preset).tokenizer
    path = default_data_dir(tokenizer)
    if not (path / "meta.json").exists():
        print(f"preparing the bundled Tiny Shakespeare into {path} ...", file=sys.stderr)
        prepare([], path, tokenizer, quiet=quiet)
    return path


def start(spec: TrainSpec, quiet: bool = False) -> TrainResult:
    """Train per `spec` (in this process; under torchrun, in each); returns the run's numbers."""
    from gptlab.training.train import train

    init = None
    if spec.train.lora_rank and not rundir.is_run(Path(spec.train.init_from)):
        raise GptlabError(f"LoRA needs a gptlab run as its base, and {spec.train.init_from} is not one; import a "
                          f"Hugging Face folder first (gptlab import hf {spec.train.init_from} --run RUN) and give "
                          "--init-from RUN")
    # the weights to start from (a LoRA run's base, resumed too), checked against model and data
    if spec.train.init_from and (not spec.resume or spec.train.lora_rank):
        from gptlab.data.batches import not_prepared
        from gptlab.hf.gpt2_folders import init_tensors
        from gptlab.tokenizer import load as load_tokenizer

        if rundir.folder_kind(spec.data) != "data":
            raise not_prepared(Path(spec.data))
        model_cfg = spec.model
        tokenizer = load_tokenizer(Path(spec.data) / "tokenizer.json")  # alone: train() loads the token files
        if model_cfg.vocab_size == 0:
            model_cfg.vocab_size = tokenizer.vocab_size
        init = init_tensors(spec.train.init_from, model_cfg, tokenizer)
    return train(spec.data, spec.run, spec.model, spec.train, resume=spec.resume, quiet=quiet, extra=spec.extra,
                 init=init)


def launch(spec: TrainSpec, nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """`gptlab ARGV` (a train command whose settings resolved to `spec`) in `nproc` processes through torchrun, all
    writing spec.run, whose lock this process holds for the whole job (elastic restarts included); returns the
    exit code. Settings are checked here, before any process starts."""
    from gptlab.distributed.processes import launch as torchrun
    from gptlab.training.train import LOCKED_RUN_ENV

    if nproc < 1:
        raise GptlabError(f"--nproc must be at least 1, not {nproc}")
    if spec.train.engine in NATIVE_ENGINES and nproc > 1:
        raise GptlabError(f"the {spec.train.engine} engine trains in one process, not {nproc}; drop --nproc or use "
                          "--engine torch")
    if spec.train.batch_size % nproc:
        raise GptlabError(f"batch_size {spec.train.batch_size} must be a multiple of the {nproc} processes; "
                          f"try --batch-size {spec.train.batch_size // nproc * nproc or nproc}")
    with rundir.RunLock(spec.run) as lock:
        code = torchrun(nproc, argv, max_restarts, {LOCKED_RUN_ENV: str(spec.run.resolve())})
        if code and not spec.resume:
            lock.undo()
    return code


def runs_trained_on(data: Path, root: Path = RUNS) -> list[Path]:
    """The runs in `root` whose config.json names `data` as their data folder."""
    found = []
    for run in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            saved = rundir.read_run_config(run).get("data") if rundir.is_run(run) else None
        except (GptlabError, OSError):
            continue
        if isinstance(saved, str) and Path(saved).resolve() == data.resolve():
            found.append(run)
    return found


def latest_run(root: Path = RUNS) -> Path:
    """The most recently trained run under `root`, for `gptlab sample` and `eval` without --run."""
    runs = [p for p in root.glob("*") if rundir.is_run(p)] if root.is_dir() else []
    if not runs:
        raise GptlabError(f"no run found under {root}/; train one with `gptlab train` or pass --run")
    return max(runs, key=lambda p: (p / rundir.CONFIG).stat().st_mtime)


# ---- looking at runs ---------------------------------------------------------------------------------------------

@dataclass
class RunSummary:
    """One run at a glance, as `gptlab runs` lists it."""

    path: Path
    preset: str
    step: int
    max_steps: int
    best_val_loss: float | None
    tokens: int
    train_seconds: float
    state: str  # running, finished, interrupted, new, imported, or damaged (its config, or every checkpoint)


def training_seconds(run: str | Path) -> float:
    """Wall-clock seconds of training in metrics.jsonl, every session of the run added up."""
    from gptlab.plots import continued_clock, read_metrics

    clock = continued_clock(read_metrics(Path(run) / rundir.METRICS))
    return clock[-1][1] if clock else 0.0


def summarize(run: str | Path) -> RunSummary:
    """Where a run stands; GptlabError when `run` is not a run or its config.json is damaged."""
    config = rundir.read_run_config(run)
    ckpt = ck.find_checkpoint(run, "step") or ck.find_checkpoint(run, "best")
    state = ck.read_state(ckpt) if ckpt else None
    step, max_steps = (ckpt.step if ckpt else 0), config["train"]["max_steps"]
    if rundir.RunLock.held(run):
        where = "running"
    elif ckpt is None and (ck.list_checkpoints(Path(run), "step") or ck.list_checkpoints(Path(run), "best")):
        where = "damaged"  # checkpoints, none of them usable: not a run that never started
    elif config.get("imported_from"):
        where = "imported"
    else:
        where = "new" if ckpt is None else "finished" if step >= max_steps else "interrupted"
    best = state.best_val_loss if state else None
    name = config.get("preset")  # an imported adapter's is its base's, where that has one
    preset = (f"{name}+lora" if name else "lora") if config["train"].get("lora_rank") else name or "?"
    return RunSummary(Path(run), preset, step, max_steps,
                      best if isinstance(best, float) and best != float("inf") else None,
                      (state.tokens_seen if state else None) or 0, training_seconds(run), where)


def list_runs(root: str | Path = RUNS) -> list[RunSummary]:
    """Every run directly under `root` (or `root` itself when it is a run), oldest first."""
    root = Path(root)
    if rundir.is_run(root):
        return [summarize(root)]
    if not root.is_dir():
        raise GptlabError(f"{root} is not a folder; give the folder that holds your runs (default runs/)")
    runs = sorted((p for p in root.iterdir() if rundir.is_run(p)), key=lambda p: (p / rundir.CONFIG).stat().st_mtime)
    return [_summary_or_damaged(p) for p in runs]


def _summary_or_damaged(run: Path) -> RunSummary:
    """summarize(run), or a row saying it is damaged when its config.json cannot be read (`gptlab info RUN` says
    why): one damaged run must not hide the others."""
    try:
        return summarize(run)
    except GptlabError:
        return RunSummary(run, "?", 0, 0, None, 0, 0.0, "damaged")


def run_info(run: str | Path) -> dict[str, Any]:
    """A run's resolved settings and checkpoints, for `gptlab info`: {"run": summary fields, "data" (None for an
    import), "imported_from" (None for a trained run), "model", "train", "checkpoints": [{name, step, valid,
    val_loss}], "resumes", "lora": None or {"adapters": what they are, "parameters": how many (the markers' rows
    too), "base": {"run", "sha256"}}}."""
    config = rundir.read_run_config(run)
    checkpoints = []
    for kind in ("step", "best"):
        for c in ck.list_checkpoints(Path(run), kind):
            problem = ck.verify_cached(c.path)  # summarize() has just hashed the newest
            val = ck.read_state(c).val_loss if problem is None else None
            checkpoints.append({"name": c.path.name, "step": c.step, "valid": problem or "valid", "val_loss": val})
    return {"run": asdict(summarize(run)), "data": config.get("data"), "imported_from": config.get("imported_from"),
            "model": config["model"], "train": config["train"], "checkpoints": checkpoints,
            "resumes": config.get("resumes", []), "lora": _lora_info(run, config)}


def _lora_info(run: str | Path, config: dict[str, Any]) -> dict[str, Any] | None:
    adapters = lora.settings(config["train"])
    if adapters is None:
        return None
    _, added = lora.count_parameters(from_dict(ModelConfig, config["model"]), adapters, _rows_trained(run))
    return {"adapters": str(adapters), "parameters": added, "base": config.get("base") or {}}


def _rows_trained(run: str | Path) -> int:
    """How many tokens' rows (the chat markers) a LoRA run trains whole, by its newest readable checkpoint."""
    for c in ck.list_checkpoints(Path(run), "step") + ck.list_checkpoints(Path(run), "best"):
        try:
            ids = ck.read_tensors(c.path, "model").get(lora.TOKEN_IDS)
        except (GptlabError, OSError):
            continue
        return 0 if ids is None else len(ids)
    return 0



def val_bits_per_byte(run: str | Path, curve: tuple[list[int], list[float], list[float]]):
    """`run`'s validation curve with each loss (nats per token) in bits per byte of its validation text, by
    evaluate.Score's rule, the bytes as `gptlab eval` counts them (the documents' own: special tokens count none); GptlabError when the run's data is gone."""
    from gptlab.data.batches import load_dataset
    from gptlab.evaluate import Score

    why = (f"the runs' tokenizers differ, so compare puts them on bits per byte of each run's validation text, "
           f"which it cannot read for {run}")
    try:
        data_dir = run_data_dir(run)
        if data_dir is None:
            raise GptlabError("it records no data folder (an imported run); compare it with runs of its tokenizer")
        data = load_dataset(data_dir)
    except GptlabError as exc:
        raise GptlabError(f"{why}: {exc}") from None
    tokens, text_bytes = len(data.val), len(data.tokenizer.text_of(data.val.tolist())[0].encode())
    steps, losses, seconds = curve
    return steps, [Score(run, tokens, 0, text_bytes, loss * tokens).bits_per_byte for loss in losses], seconds


def compare(runs: list[str | Path], out: str | Path) -> tuple[list[RunSummary], str]:
    """(the runs' summaries, the unit): their validation loss against steps and seconds drawn into `out`, in nats
    per token when the evaluated runs share a tokenizer, else in bits per byte (a token of one tokenizer is not a
    token of another). GptlabError when a folder is not a run, none has been evaluated or `out` is no picture."""
    from gptlab import plots

    plots.check_picture_path(out)
    summaries = _usable([summarize(run) for run in runs])
    curves = {str(s.path): plots.validation_curve(plots.read_metrics(s.path / rundir.METRICS)) for s in summaries}
    evaluated = [name for name, (steps, _, _) in curves.items() if steps]
    if not evaluated:
        raise GptlabError("none of these runs has been evaluated yet: nothing to compare")
    tokenizers = {json.dumps(json.loads((Path(name) / rundir.TOKENIZER).read_text()), sort_keys=True)
                  for name in evaluated}
    unit = plots.NATS_PER_TOKEN if len(tokenizers) == 1 else plots.BITS_PER_BYTE
    if unit == plots.BITS_PER_BYTE:
        curves = {name: val_bits_per_byte(name, curves[name]) for name in evaluated}
    try:
        plots.plot_runs(curves, out, unit)
    except OSError as exc:
        raise GptlabError(f"cannot write {out}: {exc.strerror}") from None
    return summaries, unit


def _usable(summaries: list[RunSummary]) -> list[RunSummary]:
    """The runs compare draws: one with no usable checkpoint is left out with a warning (its summary would show it
    at step 0); GptlabError when that leaves none."""
    damaged = [str(s.path) for s in summaries if s.state == "damaged"]
    usable = [s for s in summaries if s.state != "damaged"]
    if not usable:
        raise GptlabError(f"{', '.join(damaged)} {'has' if len(damaged) == 1 else 'have'} no usable checkpoint "
                          "(every one is damaged): nothing to compare")
    for run in damaged:
        log.warning("left %s out: it has no usable checkpoint (every one is damaged); `gptlab info %s` says what is "
                    "wrong", run, run)
    return usable
