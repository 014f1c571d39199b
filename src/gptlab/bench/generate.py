"""`gptlab bench generate`: the KV-cache engine, timed on the path `gptlab sample` runs (`engine.generate_batch` over
a `RunningBatch`: the chunked prompt pass, then the decode step, sampling and the loop in Python), beside the same
model without the cache, transformers' generate() on the same weights, and the memory-bandwidth floor (decoding one
token reads every weight once);
prefill, decode and time to first token, fp32, bf16 and int8 (weight-only, gptlab.inference.int8), batch 1 and 8.
With a trained run (`--quality RUN`), int8's quality beside bf16's: validation perplexity and greedy agreement.

Its programs, one module each: `engines` (the engines' table and ratios), `kernels` (one decode step's products
and attention alone), `sliding` (the char model past its context, with and without the cache), `quality` (int8
beside bf16 on a trained run); this module runs them and prints the headline."""

from __future__ import annotations

import torch

from gptlab.bench.engines import (ENGINE, GEN_MODELS, GenResult, bench_model, find, floor_share, generation_ratios,
                                  int8_base, print_generation_table, weight_bytes_per_token)
from gptlab.bench.kernels import print_kernel_lines
from gptlab.bench.quality import int8_quality
from gptlab.bench.sliding import char_model_speedup
from gptlab.bench.timing import LoadWatch, read_bandwidth
from gptlab.config import ModelConfig, build
from gptlab.inference.loading import FLOAT_DTYPES
from gptlab.inference.native import describe, has_int8_vnni, load_library
from gptlab.inference.weights import can_pack
from gptlab.model import GPT
from gptlab.runtime import bf16_supported, device_name, resolve_device, set_threads


def run_generate(*, device: str = "auto", new_tokens: int = 256, prompt_tokens: int = 16, char_tokens: int = 1000,
                 repeats: int = 1, uncached: bool = True, with_transformers: bool = True,
                 quality_run: str | None = None, quality_prompts: int = 8) -> list[str]:
    """`gptlab bench generate`: prints the table, the machine's load and the ratios; returns the ratio lines (the
    last: the headline). char_tokens 0 skips the char model; uncached / with_transformers False skip those rows;
    quality_run, a trained run, adds int8's quality beside bf16's on it (`int8_quality`)."""
    set_threads()
    watch = LoadWatch()
    dev = resolve_device(device)
    precisions = ["fp32", "bf16"] if dev.type != "cpu" or bf16_supported(dev) else ["fp32"]
    precisions.append("int8")
    name, config = "gpt2-124M", build(ModelConfig, GEN_MODELS["gpt2-124M"], {})
    bandwidth = read_bandwidth(dev)
    print(f"gptlab bench generate: {name} shape (random weights), prompt {prompt_tokens} tokens, {new_tokens} new "
          f"tokens, greedy; best of {repeats}")
    print(f"device: {device_name(dev)}; memory read {bandwidth / 1e9:.1f} GB/s now (each engine run's floor: "
          "the read measured just before it)")
    lib = load_library() if dev.type == "cpu" else None
    step = f"fused native step (gptlab.inference.fused), build {describe(lib)}" if lib else "torch ops"
    int8 = ("VNNI" if has_int8_vnni(lib) else "fp32 FMAs") if lib else "torch ops (widened to fp32)"
    print(f"{ENGINE}: engine.generate_batch over a RunningBatch, the path `gptlab sample` runs (batch 1: sample's "
          f"own; no prefix cache, as sample); decodes with: {step}; int8 products by {int8}")
    model = GPT(config).to(dev)
    if can_pack(dev, torch.float32):
        print_kernel_lines(model, [p for p in precisions if p in FLOAT_DTYPES], dev)
    bytes_per_token = {p: weight_bytes_per_token(model, p) for p in precisions}
    del model
    results = bench_model(config, dev, precisions, [1, 8], prompt_tokens, new_tokens, repeats, uncached,
                          with_transformers)
    print_generation_table(name, results, bytes_per_token)
    lines = generation_ratios(results, bytes_per_token)
    if char_tokens:
        cached_s, uncached_s = char_model_speedup(dev, char_tokens, prompt_tokens)
        print(f"char-small  fp32      1  {char_tokens} tokens at context 256: KV cache {cached_s:.1f} s, no cache "
              f"{uncached_s:.1f} s")
        lines.append(f"char-small: {char_tokens} tokens at context 256 {uncached_s / cached_s:.1f}x faster with the "
                     "KV cache")
    if quality_run:
        lines += int8_quality(quality_run, quality_prompts)
    lines.append(headline(results, precisions, bytes_per_token))
    print(watch.stop().report())
    print("\n".join(lines))
    return lines


def headline(results: list[GenResult], precisions: list[str], bytes_per_token: dict[str, int]) -> str:
    """Batch-1 decode against transformers' generate, or (without transformers) against the bandwidth floor; and
    int8's step against bf16's (or fp32's) with its share of its own floor."""
    floats = [p for p in precisions if p in FLOAT_DTYPES]
    ours = {p: find(results, ENGINE, p, 1) for p in precisions}
    theirs = {p: find(results, "transformers generate", p, 1) for p in floats}
    if all(theirs.values()):
        line = "headline: batch-1 decode vs transformers' generate: " + ", ".join(
            f"{p} {ours[p].decode_tok_s / theirs[p].decode_tok_s:.2f}x" for p in floats)
    else:
        line = "headline: batch-1 decode at " + ", ".join(
            f"{p} {floor_share(ours[p], bytes_per_token[p]):.0%}" for p in floats) + " of the bandwidth floor"
    base = int8_base(results)
    if ours.get("int8") is not None and base is not None:
        line += (f"; int8 {ours['int8'].decode_tok_s / base.decode_tok_s:.2f}x the {base.precision} step at "
                 f"{floor_share(ours['int8'], bytes_per_token['int8']):.0%} of its floor")
    return line
