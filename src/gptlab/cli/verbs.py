"""The verbs of the pipeline: prepare, train, sample, eval, runs, compare, info, import and export."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gptlab.cli.common import (
    add_config_flags,
    add_constraint_flags,
    add_device,
    announce,
    command,
    constraint,
    overrides,
    unescape,
)
from gptlab.cli.task_verbs import add_task_flags, eval_harness, eval_tasks
from gptlab.config import (
    DEFAULT_PRESET,
    ENGINES,
    INFERENCE_PRECISIONS,
    PRESETS,
    ModelConfig,
    PrepareConfig,
    SampleConfig,
    TrainConfig,
    build,
)
from gptlab.configfile import read_config_file
from gptlab.errors import GptlabError
from gptlab.tokenizer import EOT

# ---- prepare -----------------------------------------------------------------------------------------------------

@command("prepare", "tokenize text files (default: the bundled Tiny Shakespeare) into train/val token files")
def cmd_prepare(args: argparse.Namespace) -> int:
    from gptlab.data.prepare import OtherData, prepare
    from gptlab.runs import default_data_dir, runs_trained_on

    cfg = build(PrepareConfig, {}, overrides(args, PrepareConfig))
    out = Path(args.out) if args.out else default_data_dir(cfg.tokenizer)
    try:
        meta = prepare(args.paths, out, cfg, quiet=args.quiet, overwrite=args.overwrite)
    except OtherData:
        raise OtherData(out, runs_trained_on(out)) from None
    if cfg.chat:
        chat = meta["chat"]
        print(f"prepared {out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens from "
              f"{chat['conversations']['train']:,} + {chat['conversations']['val']:,} conversations "
              f"({chat['pieces']['train']:,} + {chat['pieces']['val']:,} rows of at most {chat['context']:,} tokens, "
              f"the longest {chat['longest']:,}), {meta['tokenizer']} tokenizer with the chat markers, "
              f"{meta['vocab_size']:,} ids")
        return 0
    held = "split by characters" if meta["split"] == "characters" else f"{meta['val_documents']:,} held out"
    print(f"prepared {out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens from "
          f"{meta['documents']:,} document{'s' * (meta['documents'] != 1)} ({held}), {meta['tokenizer']} tokenizer "
          f"with {meta['vocab_size']:,} ids ({meta['dtype']})")
    shards = {split: len(meta["shards"][split]) for split in ("train", "val")}
    if max(shards.values()) > 1:
        print(f"in {shards['train']:,} train and {shards['val']:,} val shards of at most {cfg.shard_tokens:,} tokens, "
              f"listed with their sha256 in {out / 'meta.json'}")
    folders, files = meta["skipped_folders"], meta["skipped_files"]
    if folders:
        print(f"skipped {folders:,} hidden or __pycache__ folder{'s' * (folders != 1)}")
    if files:
        shown = ", ".join(s["path"] for s in meta["skipped"][:3]) + (f" and {files - 3:,} more" if files > 3 else "")
        print(f"skipped {files:,} unreadable file{'s' * (files != 1)} ({shown}): binary, not {cfg.encoding}, or "
              f"not the kind their names say; the reasons are in {out / 'meta.json'}, and --strict refuses them")
    records = meta["skipped_records"]
    if records:
        shown = ", ".join(f"{r['path']}:{r['line']}" for r in meta["bad_records"][:3]) + \
            (f" and {records - 3:,} more" if records > 3 else "")
        print(f"skipped {records:,} bad record{'s' * (records != 1)} ({shown}): not JSON, or no string in the "
              f"text field; the reasons are in {out / 'meta.json'}, and --strict refuses them")
    return 0


def add_prepare(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", help="files or folders (read recursively, hidden ones and __pycache__ "
                   "skipped), or - for standard input (default: bundled Tiny Shakespeare). Text files are one "
                   "document each; .jsonl / .json (one JSON object per line) and .parquet give a document per "
                   "record; .gz, .zst and .bz2 files are decompressed")
    p.add_argument("--out", help="output folder (default: data/tinyshakespeare-TOKENIZER)")
    p.add_argument("--overwrite", action="store_true", help="replace the data in --out even when it was prepared "
                   "from other inputs or settings (runs trained on it can then no longer resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_config_flags(p, PrepareConfig, "preparing settings", defaults=True)


# ---- train -------------------------------------------------------------------------------------------------------

RESUME_VALUES = {None: False, "true": True, "auto": "auto"}  # --resume's spellings -> resolve()'s resume


def train_spec(args: argparse.Namespace, resume: bool | str):
    """The run's spec: the preset, then the --config file (its paths relative to its folder), then the flags."""
    from gptlab.runs import resolve

    model, train, rest = read_config_file(args.config) if args.config else ({}, {}, {})
    return resolve(args.preset or rest.get("preset"), {**model, **overrides(args, ModelConfig)},
                   {**train, **overrides(args, TrainConfig)}, args.run or rest.get("run"),
                   args.data or rest.get("data"), resume, None, args.quiet)


@command("train", "train a model (no arguments: the default preset on the bundled corpus, into runs/)")
def cmd_train(args: argparse.Namespace) -> int:
    from gptlab.distributed import processes
    from gptlab.runs import launch, start

    if args.resume not in RESUME_VALUES:
        raise GptlabError(f"--resume takes no value or 'auto', not {args.resume!r}")
    if args.nproc is not None and not processes.launched():  # under torchrun, --nproc has done its job
        spec = train_spec(args, RESUME_VALUES[args.resume])
        return launch(spec, args.nproc, args.argv + ([] if args.run else ["--run", str(spec.run)]),
                      args.max_restarts)
    resume = processes.elastic_resume(args.resume, args.run)
    result = start(train_spec(args, RESUME_VALUES[resume]), quiet=args.quiet)
    if result.rank:
        return 0  # rank 0 speaks for all
    span = f" ({result.start_step} to {result.step})" if result.start_step else ""  # resumed: this session's steps
    print(f"run {result.run_dir}: {result.step - result.start_step} steps{span} in {result.seconds:.1f} s "
          f"({result.tokens_per_second:,.0f} tokens/s over {result.train_seconds:.1f} s of training steps), "
          f"val loss {result.val_loss:.4f} (best {result.best_val_loss:.4f}); loss curve in "
          f"{result.run_dir / 'loss.png'}")
    print(f"sample it: gptlab sample --run {result.run_dir}")
    return 0


def add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="prepared data folder (default: with --resume the run's own data, else the "
                   "bundled corpus, prepared if needed)")
    p.add_argument("--preset", choices=tuple(PRESETS), metavar="PRESET",
                   help=f"starting settings: {', '.join(PRESETS)} (default {DEFAULT_PRESET}; finetune with "
                        "--init-from)")
    p.add_argument("--config", metavar="FILE", help="settings from a TOML or JSON file (the fields below, flat or "
                   "in [model] / [train] tables, and preset, data, run: paths relative to the file's folder; a "
                   "run's config.json is one); flags override it")
    p.add_argument("--run", help="run folder (default: runs/PRESET, a new one if that has checkpoints or is being trained)")
    p.add_argument("--resume", nargs="?", const="true", default=None, metavar="auto",
                   help="continue the run from its newest valid checkpoint ('auto': only if it has one)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="train data-parallel in N processes on this machine (launches torchrun; see README)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="with --nproc: restart all processes up to K times after a failure, resuming each time")
    add_config_flags(p, ModelConfig, "model settings (not given: the preset's)")
    add_config_flags(p, TrainConfig, "training settings (not given: the preset's)")


# ---- sample ------------------------------------------------------------------------------------------------------

def read_prompt(args: argparse.Namespace, tokenizer) -> list[int]:
    from gptlab.data.corpus import read_text

    if args.prompt_file:
        text = read_text(args.prompt_file, args.encoding)
    elif args.prompt is not None:
        text = args.prompt
    else:
        return [tokenizer.eot_id] if tokenizer.eot_id is not None else tokenizer.encode("\n")
    if not text and tokenizer.eot_id is not None:
        return [tokenizer.eot_id]
    return tokenizer.encode(text, allow_special=args.allow_special)


@command("sample", "generate text from a trained run, streamed as it is produced")
def cmd_sample(args: argparse.Namespace) -> int:
    from gptlab.inference.loading import load_for_inference
    from gptlab.runs import latest_run
    from gptlab.runtime import resolve_device, set_threads
    from gptlab.textstream import TextStream

    set_threads()
    cfg = sample_config(args)
    if args.num_samples < 1:  # before loading the model (the engine checks it too, for Python callers)
        raise GptlabError(f"--num-samples must be >= 1, not {args.num_samples}")
    prompt: list[int] = []  # read with the run's tokenizer before the model is prepared: a bad one is refused first
    steer: list = []  # --json-schema / --regex / --grammar, compiled for the run's tokenizer (before the model, too)

    def check(tokenizer) -> None:
        prompt.extend(read_prompt(args, tokenizer))
        steer.append(constraint(args, tokenizer))

    if args.engine != "torch":  # a C++ engine: reference or fast
        ready = load_native(args, check)
    else:
        ready = load_for_inference(args.run or latest_run(), resolve_device(args.device), args.precision, check=check)
    # the server's path (gptlab.serve), so the same seed and settings give the same text there
    stream = TextStream(ready.model, ready.tokenizer, [prompt], cfg, args.num_samples, steer=steer[0])
    announce(ready)
    echo = ready.tokenizer.decode(prompt) if args.echo_prompt else ""
    sys.stdout.write(echo)
    for pieces in stream:  # the first sample streams; the others are printed once they are done
        sys.stdout.write(pieces[0])
        sys.stdout.flush()
    sys.stdout.write("\n")
    for completion in stream.completions[1:]:
        sys.stdout.write("-" * 40 + "\n" + echo + completion.text + "\n")
    return 0


def sample_config(args: argparse.Namespace, **defaults) -> SampleConfig:
    """The sampling settings given by the flags of add_config_flags(SampleConfig) (`--stop` unescaped), over
    `defaults`, over SampleConfig's own; GptlabError (one line) for a value out of range. `gptlab chat` reads its
    flags here too."""
    settings = overrides(args, SampleConfig)
    if "stop" in settings:
        settings["stop"] = [unescape(s) for s in settings["stop"]]
    return build(SampleConfig, {}, {**defaults, **settings})


def load_native(args: argparse.Namespace, check: Callable[[Any], None]):
    """The run's model decoded by the C++ engine --engine names (reference or fast: fp32, CPU, no KV cache, each step
    recomputes the window), the prompt read first; what it cannot do is refused in one line naming it, first."""
    from gptlab.inference.loading import load_for_inference
    from gptlab.model import is_gpt
    from gptlab.reference import fast, library, naive_training
    from gptlab.runs import latest_run

    if args.precision not in ("auto", "fp32") or args.device not in ("auto", "cpu"):
        raise GptlabError(f"the {args.engine} engine decodes in fp32 on the CPU: drop --precision and --device, or "
                          "use --engine torch")
    (fast.fast_library if args.engine == "fast" else library.load_library)()  # no compiler: refused in one line
    ready = load_for_inference(args.run or latest_run(), "cpu", "fp32", decode=False, check=check)
    if not is_gpt(ready.model.model):
        raise GptlabError(f"the {args.engine} engine implements the GPT, not the bigram; use --engine torch")
    (fast.fast_model if args.engine == "fast" else naive_training.naive_model)(ready.model.model)  # now the engine's
    return ready


def add_inference_flags(p: argparse.ArgumentParser) -> None:
    """--device and --precision: where and in what a run's model generates (sample, chat)."""
    add_device(p)
    p.add_argument("--precision", choices=INFERENCE_PRECISIONS, default="auto",
                   help="inference weights: fp32 (the reference), bf16 (faster where the hardware computes it "
                        "natively; see docs/benchmarks.md), int8 (weight-only, per-row scales, fp32 activations: "
                        "half bf16's bytes to read per token), or auto (bf16 where native or where the native "
                        "decode step stores it, else fp32) (default auto)")


def add_sample(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="run folder (default: the most recent under runs/)")
    p.add_argument("--prompt", help="text to continue (default: a newline, or end-of-text for BPE models)")
    p.add_argument("--prompt-file", help="read the prompt from this file (see --encoding)")
    p.add_argument("--encoding", default="utf-8", help="text encoding of --prompt-file (default utf-8)")
    p.add_argument("--allow-special", action="store_true", help=f"encode {EOT} in the prompt as end-of-text")
    p.add_argument("--num-samples", type=int, default=1, help="continuations of the prompt, from one prefill; "
                   "sample i draws with --seed + i (as `gptlab serve` does for n)")
    p.add_argument("--no-echo", dest="echo_prompt", action="store_false", help="do not print the prompt")
    add_inference_flags(p)
    p.add_argument("--engine", choices=ENGINES, default="torch",
                   help="torch (the KV-cached engine and its fast paths), reference (the naive C++ engine: fp32, "
                        "no KV cache, every step recomputes the window) or fast (the same, made fast in C++: "
                        "blocked, vectorised, threaded) (default torch)")
    add_constraint_flags(p)
    add_config_flags(p, SampleConfig, "sampling settings")


# ---- eval --------------------------------------------------------------------------------------------------------

@command("eval", "loss, perplexity and bits per character / byte on the validation split or on text files")
def cmd_eval(args: argparse.Namespace) -> int:
    from gptlab.evaluate import score_files, score_split
    from gptlab.inference.loading import load_for_inference
    from gptlab.runs import latest_run, run_data_dir
    from gptlab.runtime import resolve_device, set_threads

    set_threads()
    if args.batch_size < 1:
        raise GptlabError(f"--batch-size must be >= 1, not {args.batch_size}")
    run = args.run or latest_run()
    if args.task or args.lm_eval:
        if args.files or args.data or (args.task and args.lm_eval):
            raise GptlabError("--task and --lm-eval score tasks, not text: give one of them, or text files / --data")
        return eval_tasks(args, run) if args.task else eval_harness(args, run)
    ready = load_for_inference(run, resolve_device(args.device), args.precision, decode=False)
    model, precision = ready.model.model, ready.precision  # int8: the weights sample decodes with, run by torch
    if args.files:
        scores = score_files(model, ready.tokenizer, args.files, args.encoding, args.batch_size, precision)
    else:
        data_dir = args.data or run_data_dir(run)
        if not data_dir:
            raise GptlabError(f"run {run} has no data of its own (it was imported); give text files to score or "
                              "--data")
        scores = [score_split(model, ready.tokenizer, data_dir, args.batch_size, source=f"run {run}",
                              precision=precision)]
    announce(ready)
    if args.json:
        print(json.dumps({"run": str(run), "checkpoint": str(ready.checkpoint.path), "precision": precision,
                          "scores": [s.as_dict() for s in scores]}, indent=2))
        return 0
    width = max([len("text"), *(len(s.name) for s in scores)])  # a path shown whole, never cut
    print(f"{'text':<{width}} {'tokens':>10} {'loss':>8} {'ppl':>9} {'bits/tok':>9} {'bits/char':>9} "
          f"{'bits/byte':>9} {'precision':>9}")
    for s in scores:
        print(f"{s.name:<{width}} {s.tokens:>10,} {s.loss:>8.4f} {s.perplexity:>9.3f} {s.bits_per_token:>9.4f} "
              f"{s.bits_per_char:>9.4f} {s.bits_per_byte:>9.4f} {precision:>9}")
    if any(s.special_tokens for s in scores):
        print("special tokens (end-of-text, chat markers) count 0 characters and 0 bytes: bits per character and "
              "per byte are over the documents' own text")
    return 0


def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="*", help="text files to score (default: the run's validation split)")
    p.add_argument("--run", help="run folder (default: the most recent under runs/)")
    p.add_argument("--data", help="prepared data folder whose val split to score (default: the run's)")
    p.add_argument("--encoding", default="utf-8", help="text encoding of the files (default utf-8)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences scored at once (default 16)")
    add_device(p)
    p.add_argument("--precision", choices=INFERENCE_PRECISIONS, default="auto",
                   help="fp32 (the reference), bf16 (autocast), int8 (weight-only int8 weights, as sample "
                        "--precision int8 uses them), or auto (bf16 where the CPU computes it natively, else fp32: "
                        "scoring runs torch's forward) (default auto); the table and the JSON name the one used")
    p.add_argument("--json", action="store_true", help="print the scores as one JSON object (run, checkpoint, "
                   "precision, scores) instead of the table")
    add_task_flags(p)


# ---- runs and info -------------------------------------------------------------------------------------------------

@command("runs", "list the runs in a folder: preset, steps, best validation loss, tokens, training time, state")
def cmd_runs(args: argparse.Namespace) -> int:
    from gptlab.runs import list_runs

    rows = list_runs(args.folder)
    print(f"{'run':<28} {'preset':<12} {'steps':>13} {'best val':>9} {'tokens':>13} {'time':>9}  state")
    for r in rows:
        best = f"{r.best_val_loss:.4f}" if r.best_val_loss is not None else "-"
        steps = "-" if r.state in ("damaged", "imported") else f"{r.step:,}/{r.max_steps:,}"  # no steps to show
        print(f"{str(r.path)[-28:]:<28} {r.preset:<12} {steps:>13} {best:>9} "
              f"{r.tokens:>13,} {r.train_seconds:>8.1f}s  {r.state}")
    if not rows:
        print(f"(no runs in {args.folder})")
    elif any(r.state == "damaged" for r in rows):
        print("damaged: `gptlab info RUN` says what is wrong with it")
    return 0


def add_runs(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", nargs="?", default="runs", help="the folder that holds the runs (default runs/)")


@command("compare", "the validation loss of several runs against steps and against seconds, in one picture (in "
                    "bits per byte when their tokenizers differ)")
def cmd_compare(args: argparse.Namespace) -> int:
    from gptlab.plots import BITS_PER_BYTE
    from gptlab.runs import compare

    summaries, unit = compare(args.runs, args.out)
    for r in summaries:
        best = f"{r.best_val_loss:.4f}" if r.best_val_loss is not None else "-"
        print(f"{r.path!s:<40} step {r.step:>8,}  best val {best:>7}  {r.train_seconds:>8.1f} s of training")
    if unit == BITS_PER_BYTE:
        print("the runs' tokenizers differ, so the curves are in bits per byte of each run's validation text "
              "(nats per token of different tokenizers do not compare)")
    print(f"validation curves: {args.out}")
    return 0


def add_compare(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run folders")
    p.add_argument("--out", default="compare.png", help="the picture to write: .png, .svg, .pdf or .jpg (default "
                   "compare.png)")


@command("info", "one run's resolved settings, data, checkpoints and resumes")
def cmd_info(args: argparse.Namespace) -> int:
    from gptlab.runs import run_info

    info = run_info(args.run)
    run = info["run"]
    if run["state"] == "imported":  # no data, no training steps
        print(f"run {run['path']}: imported from {info['imported_from']} (no training steps), preset {run['preset']}")
    else:
        print(f"run {run['path']}: {run['state']}, step {run['step']:,} of {run['max_steps']:,}, preset "
              f"{run['preset']}, {run['tokens']:,} tokens in {run['train_seconds']:.1f} s of training")
    if info["data"]:
        print(f"data: {info['data']}")
    if info["lora"]:
        base = info["lora"]["base"]
        print(f"LoRA adapters: {info['lora']['adapters']} ({info['lora']['parameters']:,} parameters) on base "
              f"{base.get('run', '?')} (weights sha256 {base.get('sha256', '?')[:12]})")
    for section in ("model", "train"):
        print(f"{section}: " + ", ".join(f"{k}={v}" for k, v in info[section].items()))
    for c in info["checkpoints"]:
        val = f", val loss {c['val_loss']:.4f}" if isinstance(c["val_loss"], float) else ""
        print(f"checkpoint {c['name']}: {c['valid']}{val}")
    for r in info["resumes"]:
        print(f"resumed at step {r['step']}" + (f" with {r['changes']}" if r.get("changes") else ""))
    return 0


def add_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="the run folder")
