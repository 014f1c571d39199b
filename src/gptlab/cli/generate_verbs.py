"""`gptlab bench generate`: the engine on the path `gptlab sample` runs, beside no cache, transformers' generate and
the bandwidth floor, or (`--peer llama.cpp`) beside llama.cpp on the same weights exported to GGUF."""

from __future__ import annotations

import argparse

from gptlab.cli.bench_verbs import BENCHES
from gptlab.cli.common import add_device, at_least


def add_bench_generate(p: argparse.ArgumentParser) -> None:
    add_device(p)
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per row (default 256)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length per row (default 16)")
    p.add_argument("--char-tokens", type=int, default=1000, help="tokens for the char model (0: skip it; default "
                   "1000)")
    p.add_argument("--repeats", type=int, default=1, help="runs per variant; the fastest is kept (default 1)")
    p.add_argument("--no-uncached", dest="uncached", action="store_false", help="skip the slow no-cache runs")
    p.add_argument("--no-transformers", dest="transformers", action="store_false",
                   help="skip transformers' generate even when it is installed")
    p.add_argument("--quality", metavar="RUN", help="also compare int8 with bf16 on this trained run: validation "
                   "perplexity and greedy agreement on validation prompts; with --peer: its GGUF exports in "
                   "llama.cpp beside gptlab's fp32 (mean KL divergence, top-token agreement)")
    p.add_argument("--quality-prompts", type=int, default=8, metavar="N", help="validation prompts of the greedy "
                   "comparison of --quality (default 8)")
    p.add_argument("--peer", choices=("llama.cpp",), help="instead: gptlab's batch-1 decode and prompt processing "
                   "beside llama.cpp's on the same weights exported to GGUF (fp32/F32, bf16/BF16, int8/Q8_0), in "
                   "alternation; needs `pip install 'gptlab[peers]'` (or `make peers`)")
    p.add_argument("--rounds", type=int, default=7, help="alternating repetitions of each engine with --peer "
                   "(default 7)")


@BENCHES("generate", "KV-cache generation on the path `gptlab sample` runs (generate_batch over a RunningBatch) "
         "on a GPT-2-124M-shaped model and a char model: prefill, decode, time to first token, fp32, bf16 and int8, "
         "beside no cache, transformers' generate and the memory-bandwidth floor", add_bench_generate)
def bench_generate(args: argparse.Namespace) -> int:
    from gptlab.bench.generate import run_generate

    at_least(args, new_tokens=1, prompt_tokens=1, repeats=1, char_tokens=0, quality_prompts=1, rounds=1)
    if args.peer:
        from gptlab.bench.llamacpp import run_peer_generate

        run_peer_generate(new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens, rounds=args.rounds,
                          quality_run=args.quality)
        return 0
    run_generate(device=args.device, new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens,
                 char_tokens=args.char_tokens, repeats=args.repeats, uncached=args.uncached,
                 with_transformers=args.transformers, quality_run=args.quality,
                 quality_prompts=args.quality_prompts)
    return 0
