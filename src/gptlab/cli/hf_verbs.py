"""The interchange verbs: import (a Hugging Face GPT-2 folder, a PEFT LoRA adapter, or a GPT-2 GGUF file, into a run)
and export (a run as a GPT-2 folder transformers loads, merged or not, a LoRA run's adapters in PEFT's format, or a
GGUF file llama.cpp runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.cli.common import command
from gptlab.errors import GptlabError


# ---- import / export --------------------------------------------------------------------------------------------

@command("import", "turn a local Hugging Face GPT-2 folder, a PEFT LoRA adapter or a GPT-2 GGUF file into a gptlab "
                   "run (nothing is downloaded)")
def cmd_import(args: argparse.Namespace) -> int:
    from gptlab.runs import RUNS

    kind, path = _import_source(args.source)
    run = Path(args.run) if args.run else RUNS / Path(path).resolve().name.removesuffix(".gguf")
    if kind == "gguf":
        return _import_gguf(path, run, args)
    if kind == "peft":
        from gptlab.hf.peft import import_peft

        if not args.base:
            raise GptlabError("import peft needs the run of the model the adapter was trained on: --base RUN")
        count = import_peft(path, args.base, run)
        print(f"imported the LoRA adapter in {path} into {run}: {count:,} adapter parameters on base {args.base}")
        print(f"sample it: gptlab sample --run {run}; export it merged: gptlab export {run} --merge --out DIR")
        return 0
    from gptlab.hf.gpt2_folders import import_hf

    if args.base:
        raise GptlabError("--base is for `gptlab import peft DIR --base RUN`; a Hugging Face model is whole")
    return _imported(path, run, import_hf(path, run))


def _imported(path: str, run: Path, model, more: str = "") -> int:
    """The lines an import of a whole model prints: what it holds, and what to do next."""
    c = model.config
    print(f"imported {path} into {run}: {model.num_params():,} parameters, {c.n_layer} layers x {c.n_head} "
          f"heads x {c.n_embd} wide, context {c.block_size}, vocabulary {c.vocab_size:,}{more}")
    print(f"sample it: gptlab sample --run {run}; fine-tune it: gptlab train --init-from {run} --data DATA")
    return 0


def _import_gguf(path: str, run: Path, args: argparse.Namespace) -> int:
    from gptlab.ggml.gguf_in import import_gguf

    if args.base:
        raise GptlabError("--base is for `gptlab import peft DIR --base RUN`; a GGUF file is a whole model")
    model = import_gguf(path, run)
    return _imported(path, run, model, f", GELU {model.config.activation}")


def _import_source(source: list[str]) -> tuple[str, str]:
    """("hf", "peft" or "gguf", the folder or file) from `import [hf|peft|gguf] PATH`."""
    if len(source) == 1:
        return ("gguf" if source[0].endswith(".gguf") else "hf"), source[0]
    if len(source) == 2 and source[0] in ("hf", "peft", "gguf"):
        return source[0], source[1]
    raise GptlabError(f"import takes [hf|peft|gguf] PATH, not {' '.join(source)}")


def add_import(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", nargs="+", metavar="[hf|peft|gguf] PATH", help="a Hugging Face GPT-2 folder "
                   "(config.json + model.safetensors or pytorch_model.bin), `peft` and a PEFT LoRA adapter folder "
                   "(adapter_config.json + adapter_model.safetensors), or `gguf` and a GPT-2 GGUF file (F32, F16, "
                   "BF16 or Q8_0 tensors)")
    p.add_argument("--run", help="run folder to create (default: runs/ + the folder's name)")
    p.add_argument("--base", help="peft: the gptlab run of the model the adapter was trained on")


@command("export", "write a run's model as a Hugging Face GPT-2 folder that transformers loads, a LoRA run's "
                   "adapters in PEFT's format, or a GGUF file llama.cpp runs")
def cmd_export(args: argparse.Namespace) -> int:
    if args.format != "gguf" and (args.outtype or args.approximate_gelu):
        raise GptlabError("--outtype and --approximate-gelu are for --format gguf")
    if args.format == "gguf":
        return _export_gguf(args)
    if args.format == "peft":
        from gptlab.hf.peft import export_peft

        if args.merge:
            raise GptlabError("--format peft writes the adapters apart from their base; drop --merge, or export "
                              "--format hf --merge for one merged model")
        names = export_peft(args.run_dir, args.out, overwrite=args.overwrite)
        print(f"exported the LoRA adapters of {args.run_dir} to {args.out}: {', '.join(names)}")
        grow = "; first grow the base to the adapter's tokenizer (it adds the chat markers): model." \
            "resize_token_embeddings(len(AutoTokenizer.from_pretrained(OUT)))" if "tokenizer.json" in names else ""
        print(f"load them: peft.PeftModel.from_pretrained(GPT2LMHeadModel of the exported base, {str(args.out)!r})"
              f"{grow}")
        return 0
    from gptlab.hf.gpt2_folders import export_hf

    names = export_hf(args.run_dir, args.out, merge=args.merge, overwrite=args.overwrite)
    print(f"exported {args.run_dir} to {args.out}: {', '.join(names)}")
    print(f"load it: transformers.GPT2LMHeadModel.from_pretrained({str(args.out)!r})")
    return 0


def _export_gguf(args: argparse.Namespace) -> int:
    from gptlab.ggml.gguf_out import export_gguf

    if args.merge:
        raise GptlabError("--format gguf always writes a LoRA run with its adapters merged in; drop --merge")
    done = export_gguf(args.run_dir, args.out, args.outtype or "f32", args.approximate_gelu, args.overwrite)
    kinds = ", ".join(f"{n} {kind.upper()}" for kind, n in sorted(done.types.items()))
    print(f"exported {args.run_dir} to {done.path}: {done.bytes / 1e6:,.1f} MB, tensors {kinds}")
    if done.kl is not None:
        print(f"GELU: the run's exact GELU becomes llama.cpp's tanh form: mean KL divergence {done.kl:.3g} nats per "
              f"token, the most likely token unchanged at {done.agree:.2%} of positions ({done.kl_text})")
    print(f"run it: llama-cli -m {done.path} -p TEXT (or llama_cpp.Llama({str(done.path)!r})); bring it back: "
          f"gptlab import gguf {done.path} --run RUN")
    return 0


def add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run to export (its best checkpoint, else its latest)")
    p.add_argument("--format", choices=("hf", "peft", "gguf"), default="hf", help="hf: Hugging Face GPT-2 "
                   "(default); peft: a LoRA run's adapters as PEFT writes them; gguf: one GGUF file for llama.cpp "
                   "(ollama, LM Studio, llamafile)")
    p.add_argument("--outtype", choices=("f32", "bf16", "q8_0"), help="gguf: the matrices' type (default f32; "
                   "q8_0: blocks of 32 int8 weights with an fp16 scale, as llama.cpp quantizes)")
    p.add_argument("--approximate-gelu", action="store_true", help="gguf of a run trained with the exact GELU: "
                   "export it although llama.cpp computes GELU's tanh form, and report the KL divergence that costs")
    p.add_argument("--merge", action="store_true", help="hf of a LoRA run: its adapters merged into the base")
    p.add_argument("--out", required=True, help="folder to write: new, empty, or an earlier export (created if "
                   "needed; an earlier export's files are replaced); gguf: the .gguf file to write")
    p.add_argument("--overwrite", action="store_true", help="write into --out although it holds files gptlab did "
                   "not export there (those of the export's names are replaced, the rest stay); gguf: replace the "
                   "file")
