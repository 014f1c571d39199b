"""`gptlab bench`: one subcommand per module of gptlab.bench, each comparing variants side by side."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from gptlab.bench.presets import SHAPED_PRESETS, train_bench_settings
from gptlab.cli.common import Subcommands, add_device, at_least, command
from gptlab.config import INFERENCE_PRECISIONS, PRESETS, TOKENIZERS, TRAIN_PRECISIONS, ModelConfig, TrainConfig
from gptlab.errors import GptlabError

# ---- bench -------------------------------------------------------------------------------------------------------

BENCHES = Subcommands("bench", "BENCH")  # also the decorator that registers one: @BENCHES(name, help, add)


@BENCHES("peak", "measure the device's matmul peak (fp32, bf16, tf32) and memory bandwidth, and the machine's load; "
         "cached per device for MFU unless other work was running", add_device)
def bench_peak(args: argparse.Namespace) -> int:
    from gptlab.bench.device_peak import run_peak

    run_peak(device=args.device)
    return 0


def add_bench_attention(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=tuple(PRESETS), default="char-small", help="model and training settings to "
                   "time (default char-small; finetune: GPT-2 124M at context 256; try --batch-size 4)")
    p.add_argument("--data", help="prepared data folder (default: the bundled corpus for the preset's tokenizer)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    add_device(p)


def add_bench_train(p: argparse.ArgumentParser) -> None:
    add_bench_attention(p)
    p.add_argument("--attention", choices=("auto", "sdpa", "naive"), help="attention path (default: the preset's)")
    p.add_argument("--traced", action="store_true", help="add the fp32 reference traced by `gptlab inspect` before "
                   "every step: tracing leaves the step's speed and result alone")
    p.add_argument("--activation-checkpointing", action="store_true", help="instead: the default precision "
                   "without and with activation checkpointing, and each one's memory, measured in a fresh process "
                   "(try --preset gpt2 --batch-size 2)")
    p.add_argument("--lora-rank", type=int, metavar="R", help="instead: full fine-tuning beside LoRA adapters of "
                   "rank R on c_attn, without and with activation checkpointing: step time and peak memory split "
                   "into weights, gradients + AdamW state and activations, each in a fresh process (try --preset "
                   "finetune --batch-size 4 --lora-rank 8)")
    p.add_argument("--loss-chunk", type=int, default=0, metavar="N", help="every variant computes its loss over "
                   "chunks of N positions, as `train --loss-chunk N` does (default 0: all the logits at once)")


@BENCHES("train", "train one model side by side: fp32 eager (the reference), bf16, bf16 + compile (+ flash attention "
         "on CUDA), or without and with activation checkpointing: tokens/s, ms/step, MFU, and the loss after the same "
         "steps (and memory)", add_bench_train)
def bench_train(args: argparse.Namespace) -> int:
    from gptlab.bench.train_speed import checkpointing_variants, lora_variants, run_train_bench, train_variants
    from gptlab.runtime import resolve_device

    if args.traced and args.activation_checkpointing:
        raise GptlabError("--traced and --activation-checkpointing are two different comparisons; choose one")
    data, model_cfg, train_cfg = _bench_train_settings(args)
    train_cfg = dataclasses.replace(train_cfg, loss_chunk=args.loss_chunk)  # a negative one: refused there
    device = resolve_device(args.device)
    variants = train_variants(device, traced=True) if args.traced else None
    if args.activation_checkpointing:
        variants = checkpointing_variants(device)
    if args.lora_rank is not None:
        if args.traced or args.activation_checkpointing or args.lora_rank < 1:
            raise GptlabError("--lora-rank N (at least 1) is its own comparison: full fine-tuning, LoRA, and LoRA "
                              "with activation checkpointing; drop --traced and --activation-checkpointing")
        variants = lora_variants(device, args.lora_rank)
    run_train_bench(data, model_cfg, train_cfg, steps=args.steps, warmup=args.warmup, variants=variants,
                    memory=args.activation_checkpointing or args.lora_rank is not None)
    return 0


def _bench_train_settings(args: argparse.Namespace) -> tuple[Path, ModelConfig, TrainConfig]:
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1:
        raise GptlabError("--steps and --batch-size must be at least 1 and --warmup at least 0")
    return train_bench_settings(args.preset, args.batch_size, args.device, getattr(args, "attention", None),
                                args.data)


@BENCHES("attention", "time a training step with each attention path (sdpa, naive) in each precision, side by side",
         add_bench_attention)
def bench_attention(args: argparse.Namespace) -> int:
    from gptlab.bench.train_speed import attention_variants, run_train_bench
    from gptlab.runtime import resolve_device

    data, model_cfg, train_cfg = _bench_train_settings(args)
    run_train_bench(data, model_cfg, train_cfg, steps=args.steps, warmup=args.warmup,
                    variants=attention_variants(resolve_device(args.device)))
    return 0


def add_bench_reference(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", nargs="+", choices=SHAPED_PRESETS, default=["char-quick", "char-small"],
                   help="presets whose model and training settings are timed (default: char-quick char-small)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per contender (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per contender first (default 1)")
    p.add_argument("--batch-size", type=int, help="sequences per step for every preset (default: the preset's, or "
                   "1 where a naive step of it is over a TFLOP, as char-small's is)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object instead of the tables")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: each preset at a tiny shape


@BENCHES("reference", "one training step of each preset computed by the naive C++ engine (fp32), by torch in fp32 "
         "and by the fastest torch path on this CPU: ms/step, tokens/s, GFLOP/s and the share of the measured peak, "
         "and the naive step's time by function", add_bench_reference)
def bench_reference(args: argparse.Namespace) -> int:
    from gptlab.bench.reference import reference_shapes, run_reference_bench

    at_least(args, steps=1, warmup=0)
    if args.batch_size is not None and args.batch_size < 1:
        raise GptlabError(f"--batch-size must be >= 1, not {args.batch_size}")
    shapes = reference_shapes(args.presets, args.batch_size, tiny=args.tiny)
    run_reference_bench(shapes, steps=args.steps, warmup=args.warmup, as_json=args.json)
    return 0


def add_bench_metal(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", nargs="+", metavar="PRESET[@CONTEXT]", help="shapes timed: a preset's model and "
                   "training settings, with @CONTEXT at that context (default: char-quick char-small gpt2@256)")
    p.add_argument("--batch-size", type=int, help="sequences per step for every shape (default: char-quick its own, "
                   "char-small 8, gpt2 4; another preset its own, or 1 where a step of it is over a TFLOP)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per contender (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per contender first (default 1)")
    p.add_argument("--rungs", metavar="RUNG,RUNG", help="the fast engine's rungs timed, comma-separated (default: all, "
                   "loop order to fusion; an unknown one is refused with the list); the top one is split by function")
    p.add_argument("--naive", action="store_true", help="also time the naive C++ engine (slow)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object instead of the tables")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: each shape 2 layers x 32, batch 2


@BENCHES("metal", "one training step of each shape computed by each rung of the fast C++ engine (fp32), by torch in "
         "fp32 and by the fastest torch path (and the naive engine with --naive): ms/step, tokens/s, GFLOP/s, the "
         "share of the measured peak, the speed over torch fp32, and the top rung's time by function", add_bench_metal)
def bench_metal(args: argparse.Namespace) -> int:
    from gptlab.bench.metal import metal_shapes, parse_rungs, run_metal_bench

    at_least(args, steps=1, warmup=0)
    shapes, rungs = metal_shapes(args.presets, args.batch_size, tiny=args.tiny), parse_rungs(args.rungs)
    run_metal_bench(shapes, rungs, naive=args.naive, steps=args.steps, warmup=args.warmup, as_json=args.json)
    return 0


def add_bench_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("--items", type=int, default=40, help="HellaSwag-shaped items to score (default 40)")
    p.add_argument("--shape", choices=("gpt2", "tiny"), default="gpt2",
                   help="the random GPT-2's shape: gpt2 (124M, default) or tiny (a smoke test)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16],
                   help="batch sizes of the harness's hf model (default 1 16; its own default is 1)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object instead of the table")


@BENCHES("eval", "items/s of gptlab eval --task beside lm-evaluation-harness's hf model on the same items and the "
         "same GPT-2-shaped model (needs the eval extra)", add_bench_eval)
def bench_eval(args: argparse.Namespace) -> int:
    from gptlab.bench.tasks import run_eval_bench

    at_least(args, items=1)
    if min(args.batch_sizes) < 1:
        raise GptlabError(f"--batch-sizes must each be >= 1, not {min(args.batch_sizes)}")
    run_eval_bench(args.items, args.shape, tuple(args.batch_sizes), as_json=args.json)
    return 0


def add_bench_chat(p: argparse.ArgumentParser) -> None:
    from gptlab.bench.chat_finetune import ChatBenchSettings

    d = ChatBenchSettings()
    for flag, kind, text in (("train", int, "training conversations"), ("held", int, "held-out questions"),
                             ("min-len", int, "shortest word"), ("max-len", int, "longest word"),
                             ("alphabet", str, "the words' letters"), ("seed", int, "seed of the task and the runs"),
                             ("n-layer", int, "the model's layers"), ("n-head", int, "its heads"),
                             ("n-embd", int, "its width"), ("batch-size", int, "rows per training step"),
                             ("base-steps", int, "the base's pretraining steps on Tiny Shakespeare"),
                             ("steps", int, "fine-tuning steps of each variant"), ("lr", float, "fine-tuning's peak "
                                                                                    "learning rate")):
        default = getattr(d, flag.replace("-", "_"))
        p.add_argument(f"--{flag}", type=kind, default=default, help=f"{text} (default {default})")
    p.add_argument("--precision", choices=TRAIN_PRECISIONS, default=d.precision,
                   help=f"training precision (default {d.precision})")
    p.add_argument("--keep", metavar="DIR", help="work in DIR (a new or empty folder) and keep the conversations, data "
                   "and runs there")


@BENCHES("chat", "chat fine-tuning on a synthetic task (reverse a word): a char GPT pretrained briefly, fine-tuned on "
         "generated conversations with the loss mask and without it: exact-match accuracy on held-out questions, "
         "beside the base before fine-tuning", add_bench_chat)
def bench_chat(args: argparse.Namespace) -> int:

    from gptlab.bench.chat_finetune import ChatBenchSettings, run_chat_bench  # too few words: refused before any training

    at_least(args, train=1, held=1, min_len=1, max_len=args.min_len, n_layer=1, n_head=1, n_embd=1, batch_size=1,
             base_steps=1, steps=1)
    if not args.lr > 0:
        raise GptlabError(f"--lr must be > 0, not {args.lr}")
    settings = ChatBenchSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ChatBenchSettings)
                                    if hasattr(args, f.name)})
    run_chat_bench(settings, folder=Path(args.keep) if args.keep else None)
    return 0


def add_bench_decode(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=60, help="floor reads and decode steps per case (default 60)")
    p.add_argument("--pages", choices=("2M", "4K", "both"), default="2M",
                   help="weights in transparent huge pages (2M, what the engine does), in ordinary 4 KB pages (4K), "
                        "or both, round by round (default 2M)")


DECODE_LABEL = ("gptlab bench decode: the fused kernel's decode step alone (no prompt pass, no sampling, no engine "
                "loop; `gptlab bench generate` times the path `gptlab sample` runs)")


@BENCHES("decode", "the fused decode kernel's step alone (no prompt pass, sampling or engine loop) of a "
         "GPT-2-124M-shaped model (CPU) against the memory-bandwidth floor read beside each step, batch 1 and batch "
         "8, fp32, bf16 and int8", add_bench_decode)
def bench_decode(args: argparse.Namespace) -> int:
    from gptlab.bench.decode import run_decode

    at_least(args, rounds=1)
    print(DECODE_LABEL)
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


@BENCHES("matmul", "a preset's own matrix products (forward, input and weight gradients) in fp32 and bf16 on the CPU: "
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


@BENCHES("prepare", "prepare's throughput (MB/s, tokens/s) on a generated FineWeb-shaped corpus beside the tokenizer "
         "library's own batch encoding with as many threads, and its peak memory at two corpus sizes",
         add_bench_prepare)
def bench_prepare(args: argparse.Namespace) -> int:
    from gptlab.bench.prepare_speed import run_prepare_bench

    if min(args.sizes_mb) <= 0 or (args.workers is not None and args.workers < 1):
        raise GptlabError(f"--sizes-mb must be > 0 and --workers >= 1, not {args.sizes_mb} / {args.workers}")
    run_prepare_bench(tuple(sorted(args.sizes_mb)), args.tokenizers, args.workers)
    return 0


def add_bench_race(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", nargs="+", choices=("char-quick", "char-race"), default=["char-quick"],
                   help="the presets raced (default: char-quick, the default; char-race is tuned for the race in "
                        "fp32) ...")
    p.add_argument("--optimizers", nargs="+", choices=("adamw", "muon"), default=["adamw", "muon"],
                   help="... each once with each of these optimizers (default: adamw muon)")
    p.add_argument("--precisions", nargs="+", choices=TRAIN_PRECISIONS, default=["auto"],
                   help="... in each of these precisions (default auto: bf16 where the CPU computes it natively; "
                        "fp32 shows what a CPU without native bf16 gets)")
    p.add_argument("--target", type=float, help="validation loss to reach (default: the reference's final loss)")
    p.add_argument("--eval-every", type=int, default=25, help="steps between evaluations (default 25)")


@BENCHES("race", "training time to reach the nanoGPT CPU recipe's final validation loss: the recipe itself (the "
         "reference) beside the default preset with each optimizer, in one run", add_bench_race)
def bench_race(args: argparse.Namespace) -> int:
    from gptlab.bench.race import run_race

    at_least(args, eval_every=1)
    run_race(args.optimizers, target=args.target, eval_every=args.eval_every, precisions=args.precisions,
             presets=args.presets)
    return 0


def add_bench_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=("concurrent", "shared-prefix"), default="concurrent",
                   help="concurrent: one client, then concurrent clients, same short prompt (default); "
                        "shared-prefix: servers with and without the prefix cache, prompts of a long shared prefix "
                        "and a suffix of each request's own: time to first token one at a time, then tokens/s of "
                        "concurrent clients")
    p.add_argument("--model", choices=("gpt2-124M",), default="gpt2-124M",
                   help="a model with random weights in this shape, and GPT-2's tokenizer (default gpt2-124M)")
    p.add_argument("--run", help="serve this run instead of --model")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients, 1 to 256 (default 8)")
    p.add_argument("--requests", type=int, default=2, help="requests each concurrent client sends, one after "
                   "another (default 2)")
    p.add_argument("--sequential", type=int, default=4, help="requests sent one at a time first, the baseline "
                   "(shared-prefix: to each server; default 4)")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 128; shared-prefix 64)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="about this many prompt tokens (default 16; "
                   "concurrent)")
    p.add_argument("--prefix-tokens", type=int, default=768, help="shared-prefix: tokens of the prefix every "
                   "prompt shares (default 768)")
    p.add_argument("--suffix-tokens", type=int, default=64, help="shared-prefix: tokens of each request's own "
                   "suffix after it (default 64)")
    p.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch (default 16)")
    p.add_argument("--queue", type=int, default=64, help="the server's --queue: a small one shows 429s (default 64)")
    p.add_argument("--precision", choices=INFERENCE_PRECISIONS, default="auto",
                   help="inference weights, as in `gptlab serve` (default auto)")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds after which no client starts a new "
                   "request, per phase (default 60)")


@BENCHES("serve", "concurrent streaming clients against a `gptlab serve` it starts on 127.0.0.1 (continuous "
         "batching), beside the same requests one at a time: tokens/s, p50 / p95 time to first token and latency, "
         "429s, errors; or (--scenario shared-prefix) time to first token and tokens/s with and without the prefix "
         "cache", add_bench_serve)
def bench_serve(args: argparse.Namespace) -> int:
    import math

    from gptlab.bench.serve import run_serve_bench, run_shared_prefix_bench

    shared = args.scenario == "shared-prefix"
    if args.max_tokens is None:
        args.max_tokens = 64 if shared else 128
    at_least(args, clients=1, requests=1, sequential=1, max_tokens=1, prompt_tokens=1, prefix_tokens=1,
             suffix_tokens=1, max_batch=1, queue=1)
    if args.clients > 256:
        raise GptlabError(f"--clients must be at most 256, not {args.clients}")
    if not (math.isfinite(args.time_limit) and 0 < args.time_limit <= 600):
        raise GptlabError(f"--time-limit must be in (0, 600] seconds, not {args.time_limit}")
    common = {name: getattr(args, name) for name in ("model", "run", "clients", "requests", "sequential", "max_tokens",
                                                     "max_batch", "queue", "precision", "time_limit")}
    if shared:
        run_shared_prefix_bench(**common, prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens)
    else:
        run_serve_bench(**common, prompt_tokens=args.prompt_tokens)
    return 0


@command("bench", "benchmarks that measure variants side by side in one run and print ratios and the machine's load")
def cmd_bench(args: argparse.Namespace) -> int:
    return BENCHES.run(args)


def add_bench(p: argparse.ArgumentParser) -> None:
    BENCHES.add_to(p)


def add_bench_speculative(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("gpt2-124M",), default="gpt2-124M",
                   help="a model with random weights in this shape, and GPT-2's tokenizer (default gpt2-124M)")
    p.add_argument("--run", help="decode with this run instead of --model")
    p.add_argument("--precision", choices=INFERENCE_PRECISIONS, default="auto",
                   help="inference weights, as in `gptlab sample` (default auto)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per task (default 4)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")


@BENCHES("speculative", "batch-1 decoding with --speculate auto beside off (the path `gptlab sample` runs) on text "
         "the model can copy from (a passage repeated, a passage edited) and on open text: tokens/s, the share of "
         "proposed tokens kept, tokens per step, beside the bandwidth floor", add_bench_speculative)
def bench_speculative(args: argparse.Namespace) -> int:
    from gptlab.bench.speculative import run_speculative

    at_least(args, prompts=1, new_tokens=2)
    run_speculative(model=args.model, run=args.run, precision=args.precision, prompts=args.prompts,
                    new_tokens=args.new_tokens)
    return 0


def add_bench_structured(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="decode with this run instead of a GPT-2-124M-shaped model with random weights")
    p.add_argument("--precision", choices=INFERENCE_PRECISIONS, default="auto", help="as in `gptlab sample`")
    p.add_argument("--samples", type=int, default=8, help="seeded samples of each schema decoded each way (default 8)")


@BENCHES("structured", "constrained decoding (JSON schemas) on the path `gptlab sample` runs: compile time, the "
         "mask's time per step (mean, p99) and what it adds to a step, tokens/s with and without a constraint, "
         "forced runs fed in one step vs drawn one by one", add_bench_structured)
def bench_structured(args: argparse.Namespace) -> int:
    from gptlab.bench.constrained import run_structured

    at_least(args, samples=1)
    run_structured(run=args.run, precision=args.precision, samples=args.samples)
    return 0
