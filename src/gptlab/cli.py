"""The `gptlab` command: it only parses and prints. Every verb is one entry of COMMANDS, made by `@command(name,
help)` over a function that turns its flags into typed values, calls one library function and prints the result;
its flags come from the function `add_NAME` beside it. Policy lives in the library (runs.py: presets, overrides,
resumes, run folders; evaluate.py: scoring), so a Python caller gets what a command does.

Flags for model, training and sampling settings are generated from the dataclasses in config.py, with their help
texts and choices, so the CLI, config files and Python callers share one definition. Errors a user can cause print
one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from gptlab.config import (DEFAULT_PRESET, PRESETS, TOKENIZERS, ModelConfig, SampleConfig, TrainConfig, build,
                           field_help, field_types, get_preset, parse_value)
from gptlab.errors import GptlabError
from gptlab.tokenizer import EOT

COMMANDS: dict[str, tuple[Any, str]] = {}  # name -> (function, help); its flags: the module's add_NAME
DEVICES = ("auto", "cpu", "cuda", "mps")


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit 2) instead of a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise GptlabError(f"{message} (see `{self.prog} --help`)")


def command(name: str, help: str):
    """Register the verb `name`; its flags are added by the function add_NAME of this module."""
    def register(fn):
        COMMANDS[name] = (fn, help)
        return fn
    return register


def add_config_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One --flag per dataclass field, with the field's help and choices; values stay None unless given, so the
    preset (or the run being resumed, or a config file) fills the rest."""
    group = parser.add_argument_group(title)
    helps = field_help(cls)
    for name, kind in field_types(cls).items():
        flag, (text, choices) = "--" + name.replace("_", "-"), helps[name]
        if kind is bool:
            group.add_argument(flag, dest=name, nargs="?", const="true", default=None, metavar="BOOL",
                               help=f"{text} (true / false; the flag alone: true)")
        elif name == "stop":
            group.add_argument(flag, dest=name, action="append", default=None, metavar="TEXT", help=text)
        else:
            group.add_argument(flag, dest=name, default=None, choices=choices, help=text,
                               metavar=None if choices else kind.__name__.upper())


def overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` that were given on the command line, parsed to their types."""
    out = {}
    for name in field_types(cls):
        value = getattr(args, name, None)
        if value is not None:
            out[name] = value if isinstance(value, list) else parse_value(cls, name, value)
    return out


def data_dir_for(data: str | None, preset: str, quiet: bool = False) -> Path:
    """--data, or the bundled corpus prepared for the preset's tokenizer (see runs.data_dir_for)."""
    from gptlab.runs import data_dir_for as resolve_data

    return resolve_data(data, preset, quiet)


# ---- prepare -----------------------------------------------------------------------------------------------------

@command("prepare", "tokenize text files (default: the bundled Tiny Shakespeare) into train/val token files")
def cmd_prepare(args: argparse.Namespace) -> int:
    from gptlab.data import prepare
    from gptlab.runs import default_data_dir

    out = Path(args.out) if args.out else default_data_dir(args.tokenizer)
    meta = prepare(args.paths, out, args.tokenizer, args.vocab_size, args.val_fraction, args.encoding, args.quiet,
                   args.allow_special, args.tokenizer_from, args.text_field, args.include, args.exclude, args.strict,
                   args.val, args.seed, args.workers)
    held = "split by characters" if meta["split"] == "characters" else f"{meta['val_documents']:,} held out"
    print(f"prepared {out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens from "
          f"{meta['documents']:,} document{'s' * (meta['documents'] != 1)} ({held}), {meta['tokenizer']} tokenizer "
          f"with {meta['vocab_size']:,} ids ({meta['dtype']})")
    folders, files = meta["skipped_folders"], meta["skipped_files"]
    if folders:
        print(f"skipped {folders:,} hidden or __pycache__ folder{'s' * (folders != 1)}")
    if files:
        shown = ", ".join(s["path"] for s in meta["skipped"][:3]) + (f" and {files - 3:,} more" if files > 3 else "")
        print(f"skipped {files:,} unreadable file{'s' * (files != 1)} ({shown}): binary, not {args.encoding}, or "
              f"not the kind their names say; the reasons are in {out / 'meta.json'}, and --strict refuses them")
    return 0


def add_prepare(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", help="files or folders (read recursively, hidden ones and __pycache__ "
                   "skipped), or - for standard input (default: bundled Tiny Shakespeare). Text files are one "
                   "document each; .jsonl / .json (one JSON object per line) and .parquet give a document per "
                   "record; .gz, .zst and .bz2 files are decompressed")
    p.add_argument("--text-field", default="text", help="the field of a JSON line or the Parquet column that holds "
                   "the text (default text)")
    p.add_argument("--include", action="append", metavar="GLOB", help="read only files matching GLOB (against the "
                   "path below the folder named, or the bare name); may be repeated")
    p.add_argument("--exclude", action="append", metavar="GLOB", help="skip files matching GLOB; may be repeated")
    p.add_argument("--strict", action="store_true", help="refuse a file found in a folder that is not readable "
                   "text (binary, another encoding, damaged) instead of skipping it")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="char",
                   help="char (one token per character), bpe (a byte-level BPE trained on the text) or gpt2 (GPT-2's "
                        "50,257 tokens) (default char)")
    p.add_argument("--tokenizer-from", metavar="RUN_OR_DATA",
                   help="encode with the tokenizer of this run or data folder instead of building one (to evaluate a "
                        "run on new text, or fine-tune it)")
    p.add_argument("--allow-special", action="store_true",
                   help=f"read {EOT} in the text as the end-of-text token (default: refuse such text)")
    p.add_argument("--vocab-size", type=int, default=1024, help="vocabulary size for --tokenizer bpe (default 1024)")
    p.add_argument("--out", help="output folder (default: data/tinyshakespeare-TOKENIZER)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of the documents held out for "
                   "validation, whole documents chosen at random by --seed, in (0, 1); a corpus of fewer than "
                   "1 / val-fraction documents (one book) is split by characters, its last val-fraction (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the choice of validation documents (default 0)")
    p.add_argument("--val", action="append", metavar="PATH", help="the validation corpus: files or folders read "
                   "like the inputs (instead of --val-fraction); may be repeated")
    p.add_argument("--encoding", default="utf-8", help="text encoding of the inputs (default utf-8)")
    p.add_argument("--workers", type=int, metavar="N", help="processes that encode, with the same token files as "
                   "one (default: the cores available)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


# ---- train -------------------------------------------------------------------------------------------------------

def train_spec(args: argparse.Namespace, resume: bool | str):
    from gptlab.runs import resolve

    return resolve(args.preset, overrides(args, ModelConfig), overrides(args, TrainConfig), args.run, args.data,
                   resume, args.config, args.quiet)


@command("train", "train a model (no arguments: the default preset on the bundled corpus, into runs/)")
def cmd_train(args: argparse.Namespace) -> int:
    from gptlab import distributed
    from gptlab.runs import launch, start

    if args.resume not in (None, "true", "auto"):
        raise GptlabError(f"--resume takes no value or 'auto', not {args.resume!r}")
    if args.nproc is not None and not distributed.launched():  # under torchrun, --nproc has done its job
        spec = train_spec(args, {None: False, "true": True, "auto": "auto"}[args.resume])
        return launch(spec, args.nproc, args.argv + ([] if args.run else ["--run", str(spec.run)]),
                      args.max_restarts)
    resume = distributed.elastic_resume(args.resume, args.run)
    result = start(train_spec(args, {None: False, "true": True, "auto": "auto"}[resume]), quiet=args.quiet)
    if result.rank:
        return 0  # rank 0 speaks for all
    print(f"run {result.run_dir}: {result.step} steps in {result.seconds:.1f} s "
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
                   "in [model] / [train] tables; a run's config.json is one); flags override it")
    p.add_argument("--run", help="run folder (default: runs/PRESET, a new one if that has checkpoints)")
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

ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """\\n, \\t, \\r and \\\\ as a shell passes them in `--stop "\\n\\n"` -> the characters they name."""
    import re

    return re.sub(r"\\(.)", lambda m: ESCAPES.get(m.group(1), m.group(0)), text)


def announce(loaded) -> None:
    """Say on stderr which run and checkpoint a command picked (stdout stays the command's output)."""
    print(f"gptlab: using {loaded.checkpoint.path} ({loaded.checkpoint.kind} checkpoint, step {loaded.checkpoint.step})",
          file=sys.stderr)


def read_prompt(args: argparse.Namespace, tokenizer) -> list[int]:
    from gptlab.corpus import read_text

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
    from gptlab.checkpoint import load_run
    from gptlab.engine import TextStream
    from gptlab.inference import prepare_for_inference
    from gptlab.runs import latest_run
    from gptlab.runtime import resolve_device, resolve_precision, set_threads

    set_threads()
    settings = overrides(args, SampleConfig)
    if "stop" in settings:
        settings["stop"] = [unescape(s) for s in settings["stop"]]
    cfg = build(SampleConfig, {}, settings)
    if args.num_samples < 1:  # before loading the model (the engine checks it too, for Python callers)
        raise GptlabError(f"--num-samples must be >= 1, not {args.num_samples}")
    device = resolve_device(args.device)
    loaded = load_run(args.run or latest_run(), device=device)
    prompt = read_prompt(args, loaded.tokenizer)
    model = prepare_for_inference(loaded.model, resolve_precision(args.precision, device))
    stream = TextStream(model, loaded.tokenizer, [prompt], cfg, args.num_samples)
    announce(loaded)
    echo = loaded.tokenizer.decode(prompt) if args.echo_prompt else ""
    sys.stdout.write(echo)
    for pieces in stream:  # the first sample streams; the others are printed once they are done
        sys.stdout.write(pieces[0])
        sys.stdout.flush()
    sys.stdout.write("\n")
    for completion in stream.completions[1:]:
        sys.stdout.write("-" * 40 + "\n" + echo + completion.text + "\n")
    return 0


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to run: auto picks cuda, then mps, then cpu (default auto)")


def add_sample(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="run folder (default: the most recent under runs/)")
    p.add_argument("--prompt", help="text to continue (default: a newline, or end-of-text for BPE models)")
    p.add_argument("--prompt-file", help="read the prompt from this file (see --encoding)")
    p.add_argument("--encoding", default="utf-8", help="text encoding of --prompt-file (default utf-8)")
    p.add_argument("--allow-special", action="store_true", help=f"encode {EOT} in the prompt as end-of-text")
    p.add_argument("--num-samples", type=int, default=1, help="continuations of the prompt, from one prefill")
    p.add_argument("--no-echo", dest="echo_prompt", action="store_false", help="do not print the prompt")
    add_device(p)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="inference weights: fp32 (the reference), bf16 (faster where the hardware computes it "
                        "natively; see docs/benchmarks.md), or auto (bf16 where native, else fp32) (default auto)")
    add_config_flags(p, SampleConfig, "sampling settings")


# ---- eval --------------------------------------------------------------------------------------------------------

@command("eval", "loss, perplexity and bits per character / byte on the validation split or on text files")
def cmd_eval(args: argparse.Namespace) -> int:
    from gptlab.checkpoint import load_run
    from gptlab.evaluate import score_files, score_split
    from gptlab.runs import latest_run, run_data_dir
    from gptlab.runtime import resolve_device, set_threads

    set_threads()
    if args.batch_size < 1:
        raise GptlabError(f"--batch-size must be >= 1, not {args.batch_size}")
    run = args.run or latest_run()
    loaded = load_run(run, device=resolve_device(args.device))
    if args.files:
        scores = score_files(loaded.model, loaded.tokenizer, args.files, args.encoding, args.batch_size)
    else:
        data_dir = args.data or run_data_dir(run)
        if not data_dir:
            raise GptlabError(f"run {run} has no data of its own (it was imported); give text files to score or "
                              "--data")
        scores = [score_split(loaded.model, loaded.tokenizer, data_dir, args.batch_size, source=f"run {run}")]
    announce(loaded)
    print(f"{'text':<40} {'tokens':>10} {'loss':>8} {'ppl':>9} {'bits/tok':>9} {'bits/char':>9} {'bits/byte':>9}")
    for s in scores:
        print(f"{s.name[-40:]:<40} {s.tokens:>10,} {s.loss:>8.4f} {s.perplexity:>9.3f} {s.bits_per_token:>9.4f} "
              f"{s.bits_per_char:>9.4f} {s.bits_per_byte:>9.4f}")
    return 0


def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="*", help="text files to score (default: the run's validation split)")
    p.add_argument("--run", help="run folder (default: the most recent under runs/)")
    p.add_argument("--data", help="prepared data folder whose val split to score (default: the run's)")
    p.add_argument("--encoding", default="utf-8", help="text encoding of the files (default utf-8)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences scored at once (default 16)")
    add_device(p)


# ---- runs and info -------------------------------------------------------------------------------------------------

@command("runs", "list the runs in a folder: preset, steps, best validation loss, tokens, training time, state")
def cmd_runs(args: argparse.Namespace) -> int:
    from gptlab.runs import list_runs

    rows = list_runs(args.folder)
    print(f"{'run':<28} {'preset':<12} {'steps':>13} {'best val':>9} {'tokens':>13} {'time':>9}  state")
    for r in rows:
        best = f"{r.best_val_loss:.4f}" if r.best_val_loss is not None else "-"
        print(f"{str(r.path)[-28:]:<28} {r.preset:<12} {f'{r.step:,}/{r.max_steps:,}':>13} {best:>9} "
              f"{r.tokens:>13,} {r.train_seconds:>8.1f}s  {r.state}")
    if not rows:
        print(f"(no runs in {args.folder})")
    return 0


def add_runs(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", nargs="?", default="runs", help="the folder that holds the runs (default runs/)")


@command("info", "one run's resolved settings, data, checkpoints and resumes")
def cmd_info(args: argparse.Namespace) -> int:
    from gptlab.runs import describe

    info = describe(args.run)
    run = info["run"]
    print(f"run {run['path']}: {run['state']}, step {run['step']:,} of {run['max_steps']:,}, preset {run['preset']}, "
          f"{run['tokens']:,} tokens in {run['train_seconds']:.1f} s of training")
    print(f"data: {info['data']}")
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


# ---- import / export --------------------------------------------------------------------------------------------

@command("import", "turn a local Hugging Face GPT-2 folder into a gptlab run (nothing is downloaded)")
def cmd_import(args: argparse.Namespace) -> int:
    from gptlab.hf import import_hf
    from gptlab.runs import RUNS

    run = Path(args.run) if args.run else RUNS / Path(args.path).resolve().name
    model = import_hf(args.path, run)
    c = model.config
    print(f"imported {args.path} into {run}: {model.num_params():,} parameters, {c.n_layer} layers x {c.n_head} "
          f"heads x {c.n_embd} wide, context {c.block_size}, vocabulary {c.vocab_size:,}")
    print(f"sample it: gptlab sample --run {run}; fine-tune it: gptlab train --init-from {run} --data DATA")
    return 0


def add_import(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a Hugging Face GPT-2 folder: config.json + model.safetensors or pytorch_model.bin")
    p.add_argument("--run", help="run folder to create (default: runs/ + the folder's name)")


@command("export", "write a run's model as a Hugging Face GPT-2 folder that transformers loads")
def cmd_export(args: argparse.Namespace) -> int:
    from gptlab.hf import export_hf

    names = export_hf(args.run_dir, args.out)
    print(f"exported {args.run_dir} to {args.out}: {', '.join(names)}")
    print(f"load it: transformers.GPT2LMHeadModel.from_pretrained({str(args.out)!r})")
    return 0


def add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run to export (its best checkpoint, else its latest)")
    p.add_argument("--format", choices=("hf",), default="hf", help="hf: Hugging Face GPT-2 (the only format)")
    p.add_argument("--out", required=True, help="folder to write (created if needed; files in it are replaced)")


# ---- inspect -----------------------------------------------------------------------------------------------------

INSPECTORS: dict[str, tuple[Any, Any, str]] = {}  # name -> (add flags, run, help)


def inspector(name: str, help: str, add: Any):
    def register(fn):
        INSPECTORS[name] = (add, fn, help)
        return fn
    return register


def add_inspect_run(p: argparse.ArgumentParser, prompt: bool = True) -> None:
    p.add_argument("--run", help="run folder (default: the most recent under runs/)")
    p.add_argument("--out", help="folder the pictures are written to (default: RUN/inspect)")
    if prompt:
        p.add_argument("--prompt", required=True, metavar="TEXT",
                       help="the text to look at (\\n, \\t, \\r and \\\\ are read as escapes); at most the "
                            "model's context")
        p.add_argument("--generate", type=int, default=0, metavar="N",
                       help="first continue the prompt by N tokens (greedy, with the KV-cached engine) and look at "
                            "prompt + continuation (default 0)")


def inspect_load(args: argparse.Namespace):
    """(the loaded run, the folder pictures go to); the caller announces the checkpoint once its checks pass."""
    from gptlab.checkpoint import load_run
    from gptlab.runs import latest_run

    run = Path(args.run) if args.run else latest_run()
    loaded = load_run(run)
    out = getattr(args, "out", None)
    return loaded, Path(out) if out else run / "inspect"


def inspect_trace(args: argparse.Namespace):
    """(loaded run, output folder, prompt ids, trace): refused before anything is written or announced."""
    from gptlab.inspect.trace import trace, trace_generation

    at_least(args, generate=0)
    loaded, out = inspect_load(args)
    ids = loaded.tokenizer.encode(unescape(args.prompt))
    if not args.generate:
        return loaded, out, ids, trace(loaded.model, ids)
    traced = trace_generation(loaded.model, ids, SampleConfig(max_new_tokens=args.generate, temperature=0))
    return loaded, out, traced.ids[0].tolist(), traced


def add_inspect_attention(p: argparse.ArgumentParser) -> None:
    add_inspect_run(p)
    p.add_argument("--layer", type=int, help="only this layer (from 0)")
    p.add_argument("--head", type=int, help="only this head (from 0); with --layer: one map at full size")
    p.add_argument("--html", action="store_true", help="also write attention.html: an interactive page (one "
                   "self-contained file) where clicking a token shows where each head looks from it")


@inspector("attention", "attention maps of a prompt: a layer x head grid (or one map) as a PNG", add_inspect_attention)
def inspect_attention(args: argparse.Namespace) -> int:
    from gptlab.inspect.page import attention_html, check_page_size
    from gptlab.inspect.pictures import attention_png
    from gptlab.inspect.trace import token_labels

    loaded, out, ids, tr = inspect_trace(args)
    for name, value, limit in (("layer", args.layer, tr.n_layer), ("head", args.head, tr.attention[0].size(1))):
        if value is not None and not 0 <= value < limit:
            raise GptlabError(f"--{name} must be in [0, {limit - 1}] for this model, not {value}")
    if args.html:
        check_page_size(tr)
    announce(loaded)
    labels = token_labels(loaded.tokenizer, ids)
    stem = "attention" + "".join(f"-{n}{v}" for n, v in (("layer", args.layer), ("head", args.head)) if v is not None)
    print(attention_png(tr, labels, out / f"{stem}.png", args.layer, args.head))
    if args.html:
        print(attention_html(tr, labels, out / "attention.html", loaded.tokenizer.decode(ids)))
    return 0


def add_inspect_lens(p: argparse.ArgumentParser) -> None:
    add_inspect_run(p)
    p.add_argument("--top", type=int, default=1, help="next tokens shown per position and depth (default 1)")


@inspector("lens", "the logit lens: the next token read from the residual stream after each block (table + PNG)",
           add_inspect_lens)
def inspect_lens(args: argparse.Namespace) -> int:
    from gptlab.inspect.pictures import lens_png, lens_table
    from gptlab.inspect.trace import logit_lens, token_labels

    at_least(args, top=1)
    loaded, out, ids, tr = inspect_trace(args)
    lens = logit_lens(loaded.model, tr)
    announce(loaded)
    print(lens_table(lens, loaded.tokenizer, ids, min(args.top, lens.size(-1))))
    print(lens_png(lens, token_labels(loaded.tokenizer, ids), loaded.tokenizer, out / "lens.png"))
    return 0


def add_inspect_embeddings(p: argparse.ArgumentParser) -> None:
    add_inspect_run(p, prompt=False)
    p.add_argument("--word", required=True, help="the word to follow (read at its last token)")
    p.add_argument("--context", action="append", required=True, metavar="TEXT",
                   help="a text containing the word (repeat: at least twice)")


@inspector("embeddings", "one word in several contexts: cosine similarity at every depth, and PCA per layer (PNG)",
           add_inspect_embeddings)
def inspect_embeddings(args: argparse.Namespace) -> int:
    import re

    from gptlab.inspect.pictures import embeddings_png, similarity_table
    from gptlab.inspect.trace import word_representations

    loaded, out = inspect_load(args)
    contexts = [unescape(c) for c in args.context]
    reps = word_representations(loaded.model, loaded.tokenizer, args.word, contexts)
    announce(loaded)
    print(similarity_table(reps))
    name = re.sub(r"[^\w-]+", "_", args.word).strip("_") or "word"
    print(embeddings_png(reps, args.word, contexts, out / f"embeddings-{name}.png"))
    return 0


def add_inspect_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="run folder (default: the most recent under runs/, unless --preset)")
    p.add_argument("--preset", choices=tuple(PRESETS), metavar="PRESET",
                   help=f"a preset's shape instead of a run: {', '.join(PRESETS)}")
    p.add_argument("--vocab-size", type=int, help="with --preset: the vocabulary (default: the preset's, else 65)")


@inspector("model", "the architecture: each component with its shape and parameters, and the total by kind",
           add_inspect_model)
def inspect_model(args: argparse.Namespace) -> int:
    from gptlab.inspect.anatomy import describe, model_for

    if args.preset and args.run:
        raise GptlabError("give --run or --preset, not both")
    if args.preset:
        shape = {**get_preset(args.preset).model}
        shape["vocab_size"] = args.vocab_size or shape.get("vocab_size", 65)
        model = model_for(build(ModelConfig, shape, {}))
    else:
        loaded = inspect_load(args)[0]
        announce(loaded)
        model = loaded.model
    print(describe(model))
    return 0


@command("inspect", "look inside a trained model: attention maps, the logit lens, contextual embeddings, anatomy")
def cmd_inspect(args: argparse.Namespace) -> int:
    return INSPECTORS[args.inspect][1](args)


def add_inspect(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="inspect", metavar="WHAT", required=True, parser_class=Parser)
    for name, (add, _, help) in INSPECTORS.items():
        add(sub.add_parser(name, help=help, description=help))


# ---- bench -------------------------------------------------------------------------------------------------------

BENCHES: dict[str, tuple[Any, Any, str]] = {}  # name -> (add flags, run, help)
BENCH_DEVICES = ("auto", "cpu", "cuda", "mps")
# presets that name a GPT's shape (bigram has none; finetune only changes dropout)
SHAPED_PRESETS = tuple(n for n, p in PRESETS.items() if "n_embd" in p.model and p.model.get("arch") != "bigram")


def bench(name: str, help: str, add: Any):
    def register(fn):
        BENCHES[name] = (add, fn, help)
        return fn
    return register


def add_bench_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=BENCH_DEVICES, default="auto",
                   help="where to measure; auto picks cuda, then mps, then cpu (default auto)")


def at_least(args: argparse.Namespace, **minimums: int) -> None:
    """Refuse a numeric flag below its minimum, naming the flag."""
    for name, low in minimums.items():
        if getattr(args, name) < low:
            raise GptlabError(f"--{name.replace('_', '-')} must be >= {low}, not {getattr(args, name)}")


@bench("peak", "measure the device's matmul peak (fp32, bf16, tf32) and memory bandwidth, and the machine's load; "
       "cached per device for MFU unless other work was running", add_bench_device)
def bench_peak(args: argparse.Namespace) -> int:
    from gptlab.bench.peak import run_peak

    run_peak(device=args.device)
    return 0


def add_bench_attention(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=tuple(PRESETS), default="char-small", help="model and training settings to "
                   "time (default char-small)")
    p.add_argument("--data", help="prepared data folder (default: the bundled corpus for the preset's tokenizer)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    add_bench_device(p)


def add_bench_train(p: argparse.ArgumentParser) -> None:
    add_bench_attention(p)
    p.add_argument("--attention", choices=("auto", "sdpa", "naive"), help="attention path (default: the preset's)")
    p.add_argument("--traced", action="store_true", help="add the fp32 reference traced by `gptlab inspect` before "
                   "every step: tracing leaves the step's speed and result alone")


@bench("train", "train one model side by side: fp32 eager (the reference), bf16, bf16 + compile (+ flash attention "
       "on CUDA): tokens/s, ms/step, MFU, and the loss after the same steps", add_bench_train)
def bench_train(args: argparse.Namespace) -> int:
    from gptlab.bench.train import run_train_bench, train_variants
    from gptlab.runtime import resolve_device

    data, model_cfg, train_cfg = _bench_train_settings(args)
    variants = train_variants(resolve_device(args.device), traced=True) if args.traced else None
    run_train_bench(data, model_cfg, train_cfg, steps=args.steps, warmup=args.warmup, variants=variants)
    return 0


def _bench_train_settings(args: argparse.Namespace) -> tuple[Path, ModelConfig, TrainConfig]:
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1:
        raise GptlabError("--steps and --batch-size must be at least 1 and --warmup at least 0")
    preset = get_preset(args.preset)
    attention = getattr(args, "attention", None)
    model_cfg = build(ModelConfig, preset.model, {"attention": attention} if attention else {})
    train_cfg = build(TrainConfig, preset.train, {"batch_size": args.batch_size, "device": args.device})
    return data_dir_for(args.data, args.preset, quiet=True), model_cfg, train_cfg


@bench("attention", "time a training step with each attention path (sdpa, naive) in each precision, side by side",
       add_bench_attention)
def bench_attention(args: argparse.Namespace) -> int:
    from gptlab.bench.train import attention_variants, run_train_bench
    from gptlab.runtime import resolve_device

    data, model_cfg, train_cfg = _bench_train_settings(args)
    run_train_bench(data, model_cfg, train_cfg, steps=args.steps, warmup=args.warmup,
                    variants=attention_variants(resolve_device(args.device)))
    return 0


def add_bench_generate(p: argparse.ArgumentParser) -> None:
    add_bench_device(p)
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per row (default 256)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length per row (default 16)")
    p.add_argument("--char-tokens", type=int, default=1000, help="tokens for the char model (0: skip it; default "
                   "1000)")
    p.add_argument("--repeats", type=int, default=1, help="runs per variant; the fastest is kept (default 1)")
    p.add_argument("--no-uncached", dest="uncached", action="store_false", help="skip the slow no-cache runs")
    p.add_argument("--no-transformers", dest="transformers", action="store_false",
                   help="skip transformers' generate even when it is installed")


@bench("generate", "KV-cache generation on a GPT-2-124M-shaped model and a char model: prefill, decode, time to "
       "first token, fp32 and bf16, beside no cache, transformers' generate and the memory-bandwidth floor",
       add_bench_generate)
def bench_generate(args: argparse.Namespace) -> int:
    from gptlab.bench.generate import run_generate

    at_least(args, new_tokens=1, prompt_tokens=1, repeats=1, char_tokens=0)
    run_generate(device=args.device, new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens,
                 char_tokens=args.char_tokens, repeats=args.repeats, uncached=args.uncached,
                 with_transformers=args.transformers)
    return 0


def add_bench_decode(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=60, help="floor reads and decode steps per case (default 60)")
    p.add_argument("--pages", choices=("2M", "4K", "both"), default="2M",
                   help="weights in transparent huge pages (2M, what the engine does), in ordinary 4 KB pages (4K), "
                        "or both, round by round (default 2M)")


@bench("decode", "the fused decode step of a GPT-2-124M-shaped model (CPU) against the memory-bandwidth floor read "
       "beside each step, batch 1 and batch 8, fp32 and bf16", add_bench_decode)
def bench_decode(args: argparse.Namespace) -> int:
    from gptlab.bench.decode import run_decode

    at_least(args, rounds=1)
    run_decode(rounds=args.rounds, pages=args.pages)
    return 0


def add_bench_matmul(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=SHAPED_PRESETS, default="char-small",
                   help="model whose Linear products are timed (default char-small)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step: rows = batch size x the "
                   "preset's context (default 16)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per product; the fastest is kept (default 10)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one training step per precision: matrix products against the rest")


@bench("matmul", "a preset's own matrix products (forward, input and weight gradients) in fp32 and bf16 on the CPU: "
       "the ceiling on bf16's training speed-up", add_bench_matmul)
def bench_matmul(args: argparse.Namespace) -> int:
    from gptlab.bench.matmul import run_matmul

    at_least(args, batch_size=1, repeats=1)
    run_matmul(preset=args.preset, batch_size=args.batch_size, repeats=args.repeats, profile=args.profile)
    return 0


def add_bench_prepare(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mb", type=float, nargs=2, default=(50.0, 200.0), metavar=("SMALL", "LARGE"),
                   help="the two sizes of the generated corpus, in MB of text (default 50 200)")
    p.add_argument("--tokenizers", nargs="+", choices=TOKENIZERS, default=["gpt2", "bpe", "char"],
                   help="tokenizers to measure (default gpt2 bpe char)")
    p.add_argument("--workers", type=int, help="worker processes of prepare and threads of the limit (default: the "
                   "cores available)")


@bench("prepare", "prepare's throughput (MB/s, tokens/s) on a generated FineWeb-shaped corpus beside the tokenizer "
       "library's own batch encoding with as many threads, and its peak memory at two corpus sizes",
       add_bench_prepare)
def bench_prepare(args: argparse.Namespace) -> int:
    from gptlab.bench.prepare import run_prepare_bench

    if min(args.sizes_mb) <= 0 or (args.workers is not None and args.workers < 1):
        raise GptlabError(f"--sizes-mb must be > 0 and --workers >= 1, not {args.sizes_mb} / {args.workers}")
    run_prepare_bench(tuple(sorted(args.sizes_mb)), args.tokenizers, args.workers)
    return 0


@command("bench", "benchmarks that measure variants side by side in one run and print ratios and the machine's load")
def cmd_bench(args: argparse.Namespace) -> int:
    return BENCHES[args.bench][1](args)


def add_bench(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True, parser_class=Parser)
    for name, (add, _, help) in BENCHES.items():
        add(sub.add_parser(name, help=help, description=help))


# ---- main --------------------------------------------------------------------------------------------------------

def make_parser() -> Parser:
    from gptlab import __version__

    parser = Parser(prog="gptlab", description="Build, train, run and look inside GPT-2-style language models.")
    parser.add_argument("--version", action="version", version=f"gptlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (_, help) in COMMANDS.items():
        globals()[f"add_{name}"](sub.add_parser(name, help=help, description=help))
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="gptlab: warning: %(message)s", level=logging.WARNING)
    parser = make_parser()
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if argv[:1] == ["--"]:  # `torchrun -m gptlab -- train ...` on Pythons whose argparse keeps the "--"
            argv = argv[1:]
        args = parser.parse_args(argv)
        args.argv = argv
        if not args.command:
            parser.print_help()
            return 2
        return COMMANDS[args.command][0](args)
    except GptlabError as exc:
        label = getattr(exc, "label", "error")
        print(f"gptlab: {label + ': ' if label else ''}{exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a file-system refusal no check above anticipated: still one line, never a traceback
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"gptlab: error: {exc.strerror or exc}{where}; check the path, free space and permissions",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gptlab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
