"""`gptlab bench generate --peer llama.cpp`: gptlab's batch-1 greedy decoding and prompt processing timed beside
llama.cpp's, on the same weights, in one process, in alternation.

One model with random weights in GPT-2 124M's shape (tanh GELU, which llama.cpp's GPT-2 computes) is written as a
run into a temporary folder and exported to GGUF (gptlab.ggml.gguf_out) as F32, BF16 (where the CPU multiplies
bf16 natively) and Q8_0. Each pair runs the same weights: gptlab fp32 beside llama.cpp F32, bf16 beside BF16,
int8 (weight-only, per-row scales) beside Q8_0 (blocks of 32 weights, each with an fp16 scale).

gptlab is timed on the path `gptlab sample` runs (`engine.generate_batch`, engines.run_gptlab) on torch's threads;
llama.cpp through its C API (gptlab.ggml.peer) on `threads` threads with its own defaults otherwise (its fp16 KV
cache among them): the prompt in one llama_decode, the first token its logits' argmax, then one llama_decode and
llama.cpp's greedy sampler per token. Both are stamped token by token and their decode rate is worked out alike
(GenResult.of: the tokens after the first over the time from the first stamp to the last).

Decode: after one short warm-up each, `rounds` rounds of (gptlab, llama.cpp), so that a drift of the machine's
speed reaches both alike; medians and spreads (lowest .. highest). Before each timed decode run, one measurement
of the memory read bandwidth: that run's floor (decoding one token reads every weight once, the position table
aside). A run's share of its floor = decode tok/s x weight bytes read per token / bandwidth.
Prompt processing: a `prefill_tokens` prompt, gptlab's time to first token (generate_batch, one new token) beside
llama.cpp's llama_decode of the prompt (the last position's logits), alternated the same way.

The goals printed beside the ratios are computed, not asserted: batch-1 decode >= DECODE_GOAL x llama.cpp in every
pair, int8 at >= INT8_FLOOR_GOAL of its floor, prompt processing >= PREFILL_GOAL x; a decode goal that is short
counts as met where gptlab reads at >= AT_FLOOR of its floor (nothing is left to gain there). Prompt processing is
bound by arithmetic, not by reading the weights, so the floor does not excuse it.
"""

from __future__ import annotations

import copy
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gptlab import rundir
from gptlab.bench.engines import GEN_MODELS, GenResult, agreeing_prefix, run_gptlab, weight_bytes_per_token
from gptlab.bench.timing import Clock, LoadWatch, median, read_bandwidth
from gptlab.config import ModelConfig, TrainConfig, build, to_dict
from gptlab.errors import GptlabError
from gptlab.ggml import peer
from gptlab.ggml.gguf_out import export_gguf
from gptlab.inference.loading import prepare_for_inference
from gptlab.inference.prepared import InferenceModel
from gptlab.machine import cpu_model
from gptlab.model import GPT
from gptlab.runtime import bf16_supported, set_threads
from gptlab.tokenizer import GPT2Tokenizer

PEER = "llama.cpp"
PAIRS = (("fp32", "f32"), ("bf16", "bf16"), ("int8", "q8_0"))  # gptlab's precision, the GGUF outtype
GGUF_NAMES = {"f32": "F32", "bf16": "BF16", "q8_0": "Q8_0"}
THREADS = 2  # llama.cpp's threads
WARMUP_TOKENS = 4  # new tokens of each engine's warm-up decode
BANDWIDTH_MB, BANDWIDTH_S = 512, 0.3  # the read probe before each timed decode run: buffer size, seconds
DECODE_GOAL = 1.3  # gptlab's batch-1 decode over llama.cpp's, every pair
INT8_FLOOR_GOAL = 0.8  # gptlab int8's share of its bandwidth floor
PREFILL_GOAL = 1.0  # gptlab's prompt processing over llama.cpp's
AT_FLOOR = 0.95  # a decode goal short of its mark counts as met where gptlab reads at this share of its floor


@dataclass
class EngineSide:
    """One engine of a pair: its timed decode runs (each with the bandwidth read just before it) and prompt
    processing rates."""

    engine: str  # "gptlab" or "llama.cpp"
    weights: str  # "fp32" ... or "F32" ...
    bytes_per_token: int  # weight bytes one decode step reads
    decode: list[GenResult] = field(default_factory=list)
    prefill_tok_s: list[float] = field(default_factory=list)

    @property
    def decode_tok_s(self) -> list[float]:
        return [r.decode_tok_s for r in self.decode]

    @property
    def floor_shares(self) -> list[float]:
        """Each decode run's share of its bandwidth floor."""
        return [r.decode_tok_s * self.bytes_per_token / r.bandwidth for r in self.decode]

    @property
    def ids(self) -> list[int]:
        """The greedy ids of the last timed decode run."""
        return self.decode[-1].ids[0] if self.decode else []


@dataclass
class Pair:
    """gptlab at one precision beside llama.cpp on the GGUF file of the same weights."""

    precision: str  # gptlab's
    outtype: str  # the GGUF file's
    ours: EngineSide
    theirs: EngineSide

    @property
    def name(self) -> str:
        return f"{self.precision}↔{GGUF_NAMES[self.outtype]}"


def bench_config(config: ModelConfig | None, vocab_size: int) -> ModelConfig:
    """`config` (tests pass a tiny one), else GPT-2 124M's shape; with the tanh GELU and the tokenizer's vocabulary
    either way (the GGUF file holds the tokenizer's rows alone: no padded rows for gptlab to pick from)."""
    if config is None:
        config = build(ModelConfig, GEN_MODELS["gpt2-124M"], {})
    return build(ModelConfig, {**to_dict(config), "activation": "gelu_tanh", "dropout": 0.0,
                               "vocab_size": vocab_size}, {})


def export_files(model: GPT, tokenizer: GPT2Tokenizer, folder: Path, outtypes: list[str]) -> dict[str, Path]:
    """`model` written as a run under `folder`, then exported as one GGUF file per outtype."""
    from gptlab.hf.gpt2_folders import write_imported_run

    run = folder / "run"
    write_imported_run(run, model, TrainConfig(), tokenizer, {}, rundir.TrainingState(to_dict(model.config)))
    return {t: export_gguf(run, folder / f"model-{t}.gguf", t).path for t in outtypes}


def gguf_bytes_per_token(path: str | Path) -> int:
    """Weight bytes llama.cpp reads per decode step: every tensor of the file once, except the position table
    (one row a step)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.name != "position_embd.weight")


def llama_decode(llm: peer.LlamaCpp, prompt: list[int], new_tokens: int) -> Clock:
    """llama.cpp's greedy continuation of `prompt`, stamped token by token as run_gptlab's."""
    clock = Clock()
    llm.clear()
    token = int(np.argmax(llm.decode(prompt)[-1]))
    clock.put([token])
    for _ in range(new_tokens - 1):
        token = llm.step(token)
        clock.put([token])
    return clock


def llama_prefill(llm: peer.LlamaCpp, prompt: list[int]) -> float:
    """Seconds llama.cpp takes to process `prompt` from position 0 (the last position's logits)."""
    start = time.perf_counter()
    llm.clear()
    llm.decode(prompt)
    return time.perf_counter() - start


def gptlab_prefill(model: InferenceModel, prompt: list[int]) -> float:
    """gptlab's time to first token for `prompt`: generate_batch with one new token."""
    clock = run_gptlab(model, [prompt], 1)
    return clock.stamps[0] - clock.start


def time_decode(pair: Pair, model: InferenceModel, llm: peer.LlamaCpp, prompt: list[int], new_tokens: int,
                rounds: int) -> None:
    """The pair's decode runs, in alternation after a warm-up each; each run keeps the bandwidth read before it."""
    runs = {pair.ours.engine: lambda n: run_gptlab(model, [prompt], n), PEER: lambda n: llama_decode(llm, prompt, n)}
    sides = {pair.ours.engine: pair.ours, PEER: pair.theirs}
    for run in runs.values():
        run(min(WARMUP_TOKENS, new_tokens))
    for _ in range(rounds):
        for name, run in runs.items():
            bandwidth = read_bandwidth(torch.device("cpu"), BANDWIDTH_MB, BANDWIDTH_S)
            side = sides[name]
            result = GenResult.of(run(new_tokens), name, side.weights, 1, len(prompt))
            result.bandwidth = bandwidth
            side.decode.append(result)


def time_prefill(pair: Pair, model: InferenceModel, llm: peer.LlamaCpp, prompt: list[int], rounds: int) -> None:
    """The pair's prompt processing rates, in alternation after a warm-up each."""
    runs = {pair.ours.engine: lambda: gptlab_prefill(model, prompt), PEER: lambda: llama_prefill(llm, prompt)}
    sides = {pair.ours.engine: pair.ours, PEER: pair.theirs}
    for run in runs.values():
        run()
    for _ in range(rounds):
        for name, run in runs.items():
            sides[name].prefill_tok_s.append(len(prompt) / run())


def logits_difference(model: GPT, llm: peer.LlamaCpp, prompt: list[int]) -> float:
    """Largest |difference| between gptlab's fp32 logits (the plain forward) and llama.cpp's at the prompt's last
    position."""
    llm.clear()
    theirs = llm.decode(prompt)[-1]
    with torch.no_grad():
        ours = model(torch.tensor([prompt]))[0][0, -1].float().numpy()
    return float(np.abs(ours[:theirs.shape[0]] - theirs).max())


def bench_pair(base: GPT, precision: str, outtype: str, path: Path, prompts: tuple[list[int], list[int]],
               new_tokens: int, rounds: int, threads: int) -> tuple[Pair, float | None]:
    """One pair timed: decode, then prompt processing. Returns it with the fp32 logits difference (fp32 only)."""
    prompt, long_prompt = prompts
    pair = Pair(precision, outtype, EngineSide("gptlab", precision, weight_bytes_per_token(base, precision)),
                EngineSide(PEER, GGUF_NAMES[outtype], gguf_bytes_per_token(path)))
    model = prepare_for_inference(copy.deepcopy(base), precision)
    with peer.LlamaCpp(path, n_ctx=base.config.block_size, threads=threads) as llm:
        difference = logits_difference(base, llm, prompt) if precision == "fp32" else None
        time_decode(pair, model, llm, prompt, new_tokens, rounds)
        time_prefill(pair, model, llm, long_prompt, rounds)
    del model
    return pair, difference


def check_lengths(config: ModelConfig, prompt_tokens: int, new_tokens: int, prefill_tokens: int) -> None:
    """Both engines run inside the model's context (llama.cpp's context is block_size long)."""
    if prompt_tokens + new_tokens > config.block_size:
        raise GptlabError(f"--prompt-tokens {prompt_tokens} + --new-tokens {new_tokens} exceed the model's context "
                          f"of {config.block_size} tokens")
    if prefill_tokens > config.block_size:
        raise GptlabError(f"a prompt of {prefill_tokens} tokens exceeds the model's context of {config.block_size}")


def print_table(pairs: list[Pair]) -> None:
    print(f"\n{'pair':<11} {'engine':<10} {'weights':<7} {'MB/token':>8} "
          f"{'decode tok/s median (lowest .. highest)':>40} {'floor share':>11} {'prefill tok/s':>13}")
    for pair in pairs:
        for side in (pair.ours, pair.theirs):
            rates = side.decode_tok_s
            decode = f"{median(rates):,.1f} ({min(rates):,.1f} .. {max(rates):,.1f})"
            print(f"{pair.name:<11} {side.engine:<10} {side.weights:<7} {side.bytes_per_token / 1e6:>8,.1f} "
                  f"{decode:>40} {median(side.floor_shares) * 100:>9.0f} % {median(side.prefill_tok_s):>13,.0f}")


def verdict(ratio: float, goal: float, share: float | None = None) -> str:
    """"met" or "short"; a decode goal that is short is met where gptlab reads at AT_FLOOR of its floor (`share`)."""
    if ratio >= goal:
        return "met"
    if share is not None and share >= AT_FLOOR:
        return f"met (gptlab at ≥ {AT_FLOOR * 100:.0f} % of its floor)"
    return "short"


def decode_line(pair: Pair) -> str:
    ours, theirs = median(pair.ours.floor_shares), median(pair.theirs.floor_shares)
    ratio = median(pair.ours.decode_tok_s) / median(pair.theirs.decode_tok_s)
    line = (f"{pair.name} batch-1 decode: gptlab {ratio:.2f}x llama.cpp (gptlab {ours * 100:.0f} % of its floor, "
            f"llama.cpp {theirs * 100:.0f} %); goal ≥ {DECODE_GOAL:.1f}x: {verdict(ratio, DECODE_GOAL, ours)}")
    if pair.precision == "int8":
        line += f"; int8 at ≥ {INT8_FLOOR_GOAL * 100:.0f} % of its floor: {verdict(ours, INT8_FLOOR_GOAL)}"
    return line


def prefill_line(pair: Pair, prefill_tokens: int) -> str:
    ratio = median(pair.ours.prefill_tok_s) / median(pair.theirs.prefill_tok_s)
    return (f"{pair.name} prompt processing ({prefill_tokens} tokens): {ratio:.2f}x; goal ≥ {PREFILL_GOAL:.1f}x: "
            f"{verdict(ratio, PREFILL_GOAL)}")


def parity_line(pairs: list[Pair], difference: float | None, prompt_tokens: int) -> str:
    agree = ", ".join(f"{p.name} {agreeing_prefix(p.ours.ids, p.theirs.ids)}/{len(p.ours.ids)}" for p in pairs)
    logits = f"fp32↔F32 logits after the {prompt_tokens}-token prompt differ by at most {difference:.1e}; " \
        if difference is not None else ""
    return f"parity: {logits}greedy ids agree for the first: {agree}"


def header(config: ModelConfig, threads: int, prompt_tokens: int, new_tokens: int, prefill_tokens: int,
           rounds: int) -> None:
    shape = f"{config.n_layer} layers, {config.n_head} heads, {config.n_embd} wide, vocab {config.vocab_size}"
    print(f"gptlab bench generate --peer llama.cpp: a GPT-2 model ({shape}; random weights, tanh GELU), the same "
          "weights in each engine (llama.cpp's from GGUF files exported by gptlab)")
    print(f"CPU: {cpu_model()}; threads: gptlab {torch.get_num_threads()} (torch's), llama.cpp {threads}; "
          f"{peer.version()}")
    print(f"batch 1, greedy: a prompt of {prompt_tokens} tokens and {new_tokens} new tokens; prompt processing of "
          f"{prefill_tokens} tokens; {rounds} round{'s' * (rounds != 1)} in alternation after a warm-up each; "
          "llama.cpp with its defaults (fp16 KV cache)")


def peer_quality(run: str, threads: int = THREADS) -> list[str]:
    """A trained run's GGUF exports (F32, BF16, Q8_0) run by llama.cpp with its defaults, beside gptlab's fp32 on
    the run's validation text (ggml.gelu's windows): the mean KL(gptlab fp32 || llama.cpp) per position and how
    often the most likely token agrees, the measure llama.cpp publishes for its quantizations. An exact-GELU run is
    exported with the tanh form, and that approximation's own divergence is shown beside."""
    from gptlab.bench.quality import kl_divergence
    from gptlab.checkpoint import load_run
    from gptlab.ggml.gelu import validation_windows

    loaded = load_run(run)
    windows = validation_windows(run, loaded, loaded.model_cfg.block_size)
    if windows is None:
        raise GptlabError(f"--quality {run}: its data folder is gone or was prepared again; the comparison needs "
                          "the run's validation text")
    with torch.no_grad():
        ours = [loaded.model(torch.tensor([w]))[0][0] for w in windows]
    parts, gelu = [], ""
    with tempfile.TemporaryDirectory() as folder:
        for outtype in ("f32", "bf16", "q8_0"):
            done = export_gguf(run, Path(folder) / f"{outtype}.gguf", outtype, approximate_gelu=True)
            if done.kl is not None:
                gelu = f"; the run's exact GELU exported as the tanh form: mean KL {done.kl:.2e} of its own"
            with peer.LlamaCpp(done.path, loaded.model_cfg.block_size, threads=threads) as llm:
                theirs = []
                for w in windows:
                    llm.clear()
                    theirs.append(torch.from_numpy(llm.decode(w, all_logits=True)))
            kl = torch.cat([kl_divergence(o, t) for o, t in zip(ours, theirs)]).mean().item()
            agree = torch.cat([o.argmax(-1) == t.argmax(-1) for o, t in zip(ours, theirs)]).double().mean().item()
            parts.append(f"{GGUF_NAMES[outtype]} mean KL {kl:.2e}, top token agrees {agree:.1%}")
    positions = sum(len(w) for w in windows)
    return [f"quality: {run} in llama.cpp beside gptlab fp32 on {positions:,} positions of its validation text: "
            + "; ".join(parts) + gelu]


def run_peer_generate(*, config: ModelConfig | None = None, prompt_tokens: int = 16, new_tokens: int = 128,
                      prefill_tokens: int = 512, rounds: int = 7, threads: int = THREADS,
                      quality_run: str | None = None) -> list[str]:
    """Time every pair, print the header, the table and the ratio lines with their goals (and with `quality_run`,
    peer_quality's line); return the lines."""
    if not peer.available():
        raise GptlabError(f"llama.cpp is not installed; {peer.PEER_INSTALL}")
    set_threads()
    watch = LoadWatch()
    tokenizer = GPT2Tokenizer()
    config = bench_config(config, tokenizer.vocab_size)
    check_lengths(config, prompt_tokens, new_tokens, prefill_tokens)
    torch.manual_seed(0)
    base = GPT(config).eval()
    g = torch.Generator().manual_seed(1)
    prompts = tuple(torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
                    for n in (prompt_tokens, prefill_tokens))
    pairs_wanted = [(p, t) for p, t in PAIRS if p != "bf16" or bf16_supported(torch.device("cpu"))]
    header(config, threads, prompt_tokens, new_tokens, prefill_tokens, rounds)
    pairs, difference = [], None
    with tempfile.TemporaryDirectory() as folder:
        files = export_files(base, tokenizer, Path(folder), [t for _, t in pairs_wanted])
        for precision, outtype in pairs_wanted:
            pair, diff = bench_pair(base, precision, outtype, files[outtype], prompts, new_tokens, rounds, threads)
            pairs.append(pair)
            difference = diff if diff is not None else difference
    print_table(pairs)
    lines = [decode_line(p) for p in pairs] + [prefill_line(p, prefill_tokens) for p in pairs]
    lines.append(parity_line(pairs, difference, prompt_tokens))
    if quality_run:
        lines += peer_quality(quality_run, threads)
    print(watch.stop().report())
    print("\n".join(lines))
    return lines
