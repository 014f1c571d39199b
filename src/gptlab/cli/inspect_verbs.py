"""`gptlab inspect`: the model's anatomy, attention maps, the logit lens and contextual embeddings."""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.cli.bench_verbs import BENCHES
from gptlab.cli.common import Subcommands, announce, at_least, command, unescape
from gptlab.config import PRESETS, ModelConfig, SampleConfig, build, get_preset
from gptlab.errors import GptlabError
from gptlab.tokenizer import CHAT_TOKENS, EOT

# ---- inspect -----------------------------------------------------------------------------------------------------

INSPECTORS = Subcommands("inspect", "WHAT")
inspector = INSPECTORS  # the decorator that registers one


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
        p.add_argument("--allow-special", action="store_true", help=f"read {EOT} and a chat run's markers "
                       f"({', '.join(CHAT_TOKENS)}) in the prompt as their special tokens, as `sample` does")


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
    ids = loaded.tokenizer.encode(unescape(args.prompt), allow_special=args.allow_special)
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
    from gptlab.inspect.anatomy import anatomy_table, model_for

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
    print(anatomy_table(model))
    return 0


# the sweeps inspect/patching.py runs (PATCH_KINDS) and inspect/circuit.py's default, named here so that parsing
# never imports torch (tests/test_inspect_patch.py holds the two lists equal)
PATCH_SWEEPS = ("resid_pre", "attn_out", "mlp_out", "head_out", "head_out_by_pos")
DEFAULT_PATCH_SWEEPS = PATCH_SWEEPS[:4]
LENS_BENCH_MODELS = ("gpt2-124M", "tiny")  # bench/interp.py's MODELS


def add_inspect_patch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="run folder (default: the most recent under runs/)")
    p.add_argument("--out", help="folder the pictures and the page are written to (default: RUN/inspect)")
    p.add_argument("--clean", required=True, metavar="TEXT", help="the prompt the model gets right (\\n, \\t "
                   "read as escapes)")
    p.add_argument("--corrupt", required=True, metavar="TEXT", help="the same prompt with what matters changed: "
                   "as many tokens as --clean")
    p.add_argument("--answer", required=True, metavar="TOKEN", help="the clean prompt's next token (one token)")
    p.add_argument("--wrong", required=True, metavar="TOKEN", help="the token the corrupted prompt points to")
    p.add_argument("--sweep", action="append", choices=PATCH_SWEEPS, metavar="SWEEP",
                   help=f"what to patch (repeat; default: {', '.join(DEFAULT_PATCH_SWEEPS)}); one of "
                        f"{', '.join(PATCH_SWEEPS)}")
    p.add_argument("--attribution", action="store_true", help="also attribution patching (the gradient "
                   "estimate, one backward) beside each sweep")


@inspector("patch", "activation patching of a clean / corrupted prompt pair: which activations carry the answer "
           "(tables, heat maps PNG, an HTML page) and the direct logit attribution", add_inspect_patch)
def inspect_patch(args: argparse.Namespace) -> int:
    from gptlab.inspect.circuit import study
    from gptlab.inspect.heatmaps import logit_png, logit_table, patch_html, patch_png, patch_table

    loaded, out = inspect_load(args)
    found = study(loaded.model, loaded.tokenizer, unescape(args.clean), unescape(args.corrupt),
                  unescape(args.answer), unescape(args.wrong), args.sweep or DEFAULT_PATCH_SWEEPS,
                  args.attribution)
    announce(loaded)
    first = found.activation[0]
    print(f"logit difference {args.answer!r} - {args.wrong!r}: clean {first.clean:.4f}, corrupted {first.corrupt:.4f}")
    for result in found.activation + found.attribution:
        print("\n" + patch_table(result, found.tokens))
    print("\n" + logit_table(found.parts))
    print(patch_png(found.activation, found.tokens, out / "patch.png", f"patching {args.answer!r} vs {args.wrong!r}"))
    if found.attribution:
        print(patch_png(found.attribution, found.tokens, out / "attribution.png", "attribution patching"))
    print(logit_png(found.parts, out / "logit-attribution.png"))
    print(patch_html(found.activation + found.attribution, found.parts, found.tokens, out / "patch.html",
                     f"patching: {args.clean} / {args.corrupt}"))
    return 0


def add_inspect_heads(p: argparse.ArgumentParser) -> None:
    add_inspect_run(p, prompt=False)
    p.add_argument("--half", type=int, help="random tokens in the probe, then the same again (default: half the "
                   "context, at most 32)")
    p.add_argument("--batch", type=int, default=8, help="probe rows averaged over (default 8)")
    p.add_argument("--seed", type=int, default=0, help="the probe's random tokens (default 0)")


@inspector("heads", "head detectors: every head's previous-token, duplicate-token and induction score on repeated "
           "random tokens (table + PNG)", add_inspect_heads)
def inspect_heads(args: argparse.Namespace) -> int:
    from gptlab.heads import head_scores
    from gptlab.inspect.heatmaps import heads_png, heads_table

    at_least(args, batch=1)
    loaded, out = inspect_load(args)
    special = [t for t in (getattr(loaded.tokenizer, "eot_id", None),) if t is not None]
    scores = head_scores(loaded.model, loaded.tokenizer.vocab_size, args.half, args.batch, args.seed, special)
    announce(loaded)
    print(heads_table(scores))
    print(heads_png(scores, out / "heads.png"))
    return 0


def add_bench_lens(p: argparse.ArgumentParser, tokens: int, rounds: int) -> None:
    p.add_argument("--model", choices=LENS_BENCH_MODELS, default="gpt2-124M", help="a model of this shape with random "
                   "weights (default gpt2-124M)")
    p.add_argument("--run", help="this run's model instead of --model")
    p.add_argument("--tokens", type=int, default=tokens, help=f"prompt length in tokens (default {tokens})")
    p.add_argument("--rounds", type=int, default=rounds, help=f"timed rounds, in alternation (default {rounds})")


@BENCHES("hooks", "gptlab's hook points beside TransformerLens: every hook's worst difference, and the forward with "
         "no hook, with none attached, caching every activation, and TransformerLens's, timed in alternation",
         lambda p: add_bench_lens(p, 64, 15))
def bench_hooks(args: argparse.Namespace) -> int:
    from gptlab.bench.interp import run_hooks

    at_least(args, tokens=2, rounds=1)
    run_hooks(args.model, args.run, args.tokens, args.rounds)
    return 0


@BENCHES("patching", "activation patching (layer x position, layer x position x head) beside TransformerLens's on "
         "one prompt pair: results compared, then timed in alternation; attribution patching beside",
         lambda p: add_bench_lens(p, 12, 3))
def bench_patching(args: argparse.Namespace) -> int:
    from gptlab.bench.interp import run_patching

    at_least(args, tokens=4, rounds=1)
    run_patching(args.model, args.run, args.tokens, args.rounds)
    return 0


@command("inspect", "look inside a trained model: attention maps, the logit lens, contextual embeddings, anatomy")
def cmd_inspect(args: argparse.Namespace) -> int:
    return INSPECTORS.run(args)


def add_inspect(p: argparse.ArgumentParser) -> None:
    INSPECTORS.add_to(p)


