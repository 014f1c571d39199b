"""`gptlab bench generate`: the KV-cache engine timed beside the same model without the cache, transformers'
generate() on the same weights, and the memory-bandwidth floor (decoding one token reads every weight once);
prefill, decode and time to first token, fp32, bf16 and int8 (weight-only, gptlab.inference.int8), batch 1 and 8.
With a trained run (`--quality RUN`), int8's quality beside bf16's: validation perplexity and greedy agreement."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gptlab.bench.timing import Clock, LoadWatch, median, read_bandwidth, read_then, time_it
from gptlab.config import ModelConfig, SampleConfig, build, get_preset
from gptlab.data.batches import load_dataset
from gptlab.engine import generate_batch, generate_uncached
from gptlab.errors import GptlabError
from gptlab.inference import FLOAT_DTYPES, InferenceModel, prepare_for_inference
from gptlab.inference.native import has_int8_vnni, load_library
from gptlab.inference.weights import InferenceLinear, can_pack
from gptlab.model import GPT
from gptlab.runtime import bf16_supported, device_name, resolve_device, set_threads

GEN_MODELS = {  # random weights in the shapes of GPT-2 small and of the char-small preset (Tiny Shakespeare's 65)
    "gpt2-124M": {**get_preset("gpt2").model, "dropout": 0.0},
    "char-small": {**get_preset("char-small").model, "vocab_size": 65, "dropout": 0.0},
}


ENGINE = "gptlab (KV cache)"
@dataclass
class GenResult:
    """One timed generation of `batch` rows."""

    engine: str
    precision: str
    batch: int
    ttft_s: float  # from the call to the first new token of every row
    prefill_tok_s: float  # prompt tokens of all rows / time to first token
    decode_tok_s: float  # new tokens after the first, all rows together, per second
    ids: list[list[int]]  # (batch, new tokens)
    bandwidth: float = float("nan")  # memory read bytes/s measured just before this run (engine runs)
    paired_floor: float = float("nan")  # share of the floor, token by token (batch-1 engine runs; see paired_floor)

    def floor_tok_s(self, bytes_per_token: int) -> float:
        """The bandwidth floor of this run: every row's token from one read of the weights at `bandwidth`."""
        return self.batch * self.bandwidth / bytes_per_token

    @classmethod
    def of(cls, clock: Clock, engine: str, precision: str, batch: int, prompt_tokens: int) -> GenResult:
        s = clock.stamps
        ttft = s[0] - clock.start
        decode = batch * (len(s) - 1) / (s[-1] - s[0]) if len(s) > 1 else float("nan")
        return cls(engine, precision, batch, ttft, batch * prompt_tokens / ttft, decode,
                   [list(row) for row in zip(*clock.ids)])


def run_gptlab(model: InferenceModel, prompts: list[list[int]], new_tokens: int, cached: bool = True) -> Clock:
    """Greedy generation with the engine (or its no-cache reference), timed position by position."""
    cfg = SampleConfig(max_new_tokens=new_tokens, temperature=0)
    clock = Clock()
    for ids in (generate_batch if cached else generate_uncached)(model, prompts, cfg):
        clock.put(ids)
    return clock


def run_transformers(hf: Any, prompts: list[list[int]], new_tokens: int) -> Clock:
    """Greedy generation with transformers' generate() and its KV cache, timed position by position."""
    x = torch.tensor(prompts, device=hf.device)
    clock = Clock(skip=1)
    with torch.inference_mode():
        hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, streamer=clock)
    return clock


def transformers_twin(model: GPT) -> Any:
    """transformers' GPT2LMHeadModel holding `model`'s weights (converted by gptlab.hf.hf), or None when transformers
    is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    from gptlab.hf.hf import to_hf_tensors

    transformers.logging.set_verbosity_error()
    c = model.config
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        activation_function="gelu_new" if c.activation == "gelu_tanh" else "gelu",
        layer_norm_epsilon=c.layer_norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=True))
    missing, unexpected = hf.load_state_dict(to_hf_tensors(model, c.vocab_size), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.generation_config.eos_token_id = None  # random weights: never stop before new_tokens
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def weight_bytes_per_token(model: torch.nn.Module, precision: str) -> int:
    """Bytes of weights one decode step reads: every parameter once (the tied embedding once, as the LM head),
    except the position table, of which it reads one row. int8: a byte per matrix weight, and 8 per matrix row
    (its fp32 scale and int32 sum), the vectors (LayerNorm, biases) in fp32."""
    wpe = model.transformer.wpe.weight.numel()
    if precision != "int8":
        return (model.num_params() - wpe) * (2 if precision == "bf16" else 4)
    matrices = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]  # the LM head among them
    weights, rows = sum(w.numel() for w in matrices), sum(w.shape[0] for w in matrices)
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    return weights + 8 * rows + 4 * vectors


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids two generations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def bench_model(config: ModelConfig, device: torch.device, precisions: list[str], batch_sizes: list[int],
                prompt_tokens: int, new_tokens: int, repeats: int = 1, uncached: bool = True,
                with_transformers: bool = True, bandwidth_mb: int = 512) -> list[GenResult]:
    """Time greedy generation of one randomly initialised model with the engine, with transformers' generate on
    the same weights, and (batch 1) without the cache, for each precision and batch size. Each variant is warmed
    up, then run `repeats` times (interleaved with the others) and its fastest run kept; no cache runs once.
    Each engine run carries the read bandwidth (of a `bandwidth_mb` buffer) measured just before it."""
    torch.manual_seed(0)
    base = GPT(config).to(device).eval()
    hf = transformers_twin(base) if with_transformers else None
    results = []
    # the same prompts for every precision, so that their greedy ids can be compared
    prompts_of = {batch: torch.randint(0, config.vocab_size, (batch, prompt_tokens)).tolist() for batch in batch_sizes}
    for precision in precisions:
        model = prepare_for_inference(copy.deepcopy(base), precision)
        # the same engine with the decode step as torch ops (oneDNN-packed weights), beside the fused native step;
        # not for int8, whose torch path (the reference) dequantizes every weight at every step
        torch_ops = model.fused and precision != "int8"
        ops = prepare_for_inference(copy.deepcopy(base), precision, fused=False) if torch_ops else None
        twin = hf if precision in FLOAT_DTYPES else None  # transformers has no weight-only int8 of its own on a CPU
        if twin is not None:
            twin.to(FLOAT_DTYPES[precision])
        for batch in batch_sizes:
            prompts = prompts_of[batch]
            variants: dict[str, Callable[[int], Clock]] = {ENGINE: lambda n: run_gptlab(model, prompts, n)}
            if ops is not None:
                variants["gptlab, torch-op step"] = lambda n: run_gptlab(ops, prompts, n)
            if twin is not None:
                variants["transformers generate"] = lambda n: run_transformers(twin, prompts, n)
            runs: dict[str, list[GenResult]] = {name: [] for name in variants}
            for name, run in variants.items():
                run(2)  # warm-up: first-call allocations and kernel selection
            for _ in range(repeats):
                for name, run in variants.items():
                    # a shared machine's bandwidth drifts by tens of percent: each engine run gets its own floor
                    bandwidth = read_bandwidth(device, bandwidth_mb, 0.3) if name == ENGINE else float("nan")
                    result = GenResult.of(run(new_tokens), name, precision, batch, prompt_tokens)
                    result.bandwidth = bandwidth
                    runs[name].append(result)
            results += [max(r, key=lambda g: g.decode_tok_s) for r in runs.values()]
            if batch == 1 and device.type == "cpu":
                engine, weights = find(results, ENGINE, precision, 1), weight_bytes_per_token(base, precision)
                engine.paired_floor = paired_floor(model, prompts, new_tokens, weights, bandwidth_mb)
            if uncached and batch == 1 and precision != "int8":  # the reference path: fp32 and bf16 show it
                clock = run_gptlab(model, prompts, new_tokens, cached=False)
                results.append(GenResult.of(clock, "gptlab, no cache", precision, batch, prompt_tokens))
    return results


def paired_floor(model: InferenceModel, prompts: list[list[int]], new_tokens: int, bytes_per_token: int,
                 megabytes: int = 512) -> float:
    """How close batch-1 decoding comes to the bandwidth floor, measured token by token: before each decode step,
    one read of a `megabytes` buffer (its rate is the floor for that step); the median over the steps of
    floor time / step time. A shared machine's bandwidth drifts by tens of percent within seconds, so a floor
    measured beside each step, not once per run, is what the step can be held to."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    steps = iter(generate_batch(model, prompts, SampleConfig(max_new_tokens=new_tokens, temperature=0)))
    next(steps)  # the prefill and the first token
    shares = []
    with torch.inference_mode():
        while True:
            bandwidth, seconds, ids = read_then(x, lambda: next(steps, None))
            if ids is None:
                break
            shares.append(bytes_per_token / bandwidth / seconds)
    return median(shares)


def find(results: list[GenResult], engine: str, precision: str, batch: int) -> GenResult | None:
    return next((r for r in results if (r.engine, r.precision, r.batch) == (engine, precision, batch)), None)


def print_generation_table(name: str, results: list[GenResult], bytes_per_token: dict[str, int]) -> None:
    """One row per engine, precision and batch size, with the bandwidth floor under each engine row."""
    print(f"{'model':<11} {'prec':<5} {'batch':>5}  {'engine':<22} {'prefill tok/s':>13} {'decode tok/s':>12} "
          f"{'TTFT ms':>8}")
    for r in results:
        print(f"{name:<11} {r.precision:<5} {r.batch:>5}  {r.engine:<22} {r.prefill_tok_s:>13,.0f} "
              f"{r.decode_tok_s:>12,.1f} {r.ttft_s * 1e3:>8,.0f}")
        if r.engine == ENGINE:
            floor = r.floor_tok_s(bytes_per_token[r.precision])  # one read of the weights serves every row
            print(f"{name:<11} {r.precision:<5} {r.batch:>5}  {'bandwidth floor':<22} {'-':>13} {floor:>12,.1f} "
                  f"{'-':>8}  (memory read {r.bandwidth / 1e9:.1f} GB/s just before)")


def generation_ratios(results: list[GenResult], bytes_per_token: dict[str, int]) -> list[str]:
    """The lines comparing the engine with transformers, no cache, the floor, and batch 8 with batch 1."""
    lines = []
    for precision in bytes_per_token:
        ours, theirs = find(results, ENGINE, precision, 1), find(results, "transformers generate", precision, 1)
        uncached, batch8 = find(results, "gptlab, no cache", precision, 1), find(results, ENGINE, precision, 8)
        if ours is None:
            continue
        token_by_token = " (token by token)" if ours.paired_floor == ours.paired_floor else ""  # measured: not NaN
        parts = [f"{floor_share(ours, bytes_per_token[precision]):.0%} of the bandwidth floor{token_by_token}"]
        if theirs is not None:
            same = agreeing_prefix(ours.ids[0], theirs.ids[0])
            parts.insert(0, f"{ours.decode_tok_s / theirs.decode_tok_s:.2f}x transformers' generate (greedy ids "
                            f"agree for the first {same}/{len(ours.ids[0])})")
        if uncached is not None:
            parts.append(f"{ours.decode_tok_s / uncached.decode_tok_s:.1f}x no cache")
        if precision == "int8":
            parts += int8_parts(results, ours)
        lines.append(f"{precision} batch 1 decode: " + ", ".join(parts))
        if batch8 is not None:
            lines.append(f"{precision} batch 8 aggregate decode: {batch8.decode_tok_s / ours.decode_tok_s:.2f}x "
                         "batch 1")
    return lines


def int8_base(results: list[GenResult]) -> GenResult | None:
    """The batch-1 engine run int8's is compared with: bf16's, else fp32's."""
    return find(results, ENGINE, "bf16", 1) or find(results, ENGINE, "fp32", 1)


def int8_parts(results: list[GenResult], int8: GenResult) -> list[str]:
    """int8's batch-1 step in ms and beside bf16's (or fp32's), with how long their greedy ids agree."""
    base = int8_base(results)
    parts = [f"{1e3 / int8.decode_tok_s:.2f} ms/step"]
    if base is not None:
        same = agreeing_prefix(int8.ids[0], base.ids[0])
        parts.append(f"{int8.decode_tok_s / base.decode_tok_s:.2f}x the {base.precision} step "
                     f"({1e3 / base.decode_tok_s:.2f} ms; greedy ids agree for the first {same}/{len(int8.ids[0])})")
    return parts


TORCH_INT8 = "int8 (torch step)"


def int8_quality(run: str, prompts: int = 8, prompt_tokens: int = 16, new_tokens: int = 32) -> list[str]:
    """int8 beside bf16 (fp32 where the CPU has no native bf16) on a trained run: the validation perplexity of
    each (the weights each decodes with), and greedy continuations of `prompts` windows of the validation split,
    how many agree for all `new_tokens` tokens and the shortest agreeing prefix; where the base is bf16, fp32 beside
    both too, the yardstick of what bf16's own rounding changes; where int8 decodes natively, the torch int8 path's
    text beside fp32's too, what the int8 weights alone change. Returns the lines."""
    import math

    from gptlab.checkpoint import load_run
    from gptlab.evaluate import total_nats
    from gptlab.runs import run_data_dir

    loaded = load_run(run)
    data_dir = run_data_dir(run)
    if data_dir is None:
        raise GptlabError(f"run {run} has no data of its own to score int8 on (it was imported)")
    val = load_dataset(data_dir).val
    base = "bf16" if bf16_supported(torch.device("cpu")) else "fp32"
    precisions = ["fp32", "bf16", "int8"] if base == "bf16" else ["fp32", "int8"]
    step = max(1, (len(val) - prompt_tokens) // prompts)
    windows = [val[i * step:i * step + prompt_tokens].tolist() for i in range(prompts)]
    perplexity, ids = {}, {}
    cfg = SampleConfig(max_new_tokens=new_tokens, temperature=0)
    for precision in precisions:
        model = prepare_for_inference(copy.deepcopy(loaded.model), precision)
        nats, count = total_nats(model.model, val)
        perplexity[precision] = math.exp(nats / max(count, 1))
        ids[precision] = [list(row) for row in zip(*generate_batch(model, windows, cfg))]
        if precision == "int8" and model.fused:  # the torch path's steps (fp32 x over the same int8 weights)
            torch_step = prepare_for_inference(copy.deepcopy(loaded.model), "int8", fused=False)
            ids[TORCH_INT8] = [list(row) for row in zip(*generate_batch(torch_step, windows, cfg))]
    change = perplexity["int8"] / perplexity[base] - 1
    lines = [f"int8 vs {base} on {run}: validation perplexity {perplexity['int8']:.3f} vs {perplexity[base]:.3f} "
             f"({change:+.2%})"]
    pairs = [(base, "int8")] + ([("fp32", "bf16"), ("fp32", "int8")] if base == "bf16" else [])
    pairs += [("fp32", TORCH_INT8)] if TORCH_INT8 in ids else []  # what weight-only int8 gives without the kernel
    for a, b in pairs:
        agree = [agreeing_prefix(x, y) for x, y in zip(ids[a], ids[b])]
        lines.append(f"{b} vs {a} greedy: {sum(n == new_tokens for n in agree)}/{prompts} validation prompts agree "
                     f"for all {new_tokens} new tokens (shortest agreement {min(agree)})")
    return lines


def linear_kernel_times(model: torch.nn.Module, precision: str, device: torch.device) -> dict[str, float]:
    """Seconds to pass one row through every Linear of `model` (the matrices a batch-1 decode step reads): with
    F.linear, with oneDNN-packed weights, and packed with the row padded to 4 rows (what the engine does)."""
    dtype = FLOAT_DTYPES[precision]
    linears = [copy.deepcopy(m).to(dtype) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [InferenceLinear(m) for m in linears]
    xs = [torch.randn(1, m.in_features, dtype=dtype, device=device) for m in linears]

    def plain() -> None:
        for x, m in zip(xs, linears):
            F.linear(x, m.weight, m.bias)

    def one_row() -> None:
        for x, m in zip(xs, packed):
            torch.ops.mkldnn._linear_pointwise(x, m.packed, m.bias, "none", [], "")

    def padded() -> None:
        for x, m in zip(xs, packed):
            m(x)

    with torch.inference_mode():
        return {name: time_it(fn, device, min_seconds=0.5) for name, fn in
                (("F.linear", plain), ("oneDNN-packed", one_row), ("packed, padded to 4 rows", padded))}


def attention_times(device: torch.device, rows: int = 8, keys: int = 272, n_head: int = 12,
                    head_dim: int = 64) -> dict[str, float]:
    """Seconds for one decode step's attention of one layer (one query per row over `keys` cached positions) in
    fp32 and in bf16."""
    out = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        q = torch.randn(rows, n_head, 1, head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(rows, n_head, keys, head_dim, dtype=dtype, device=device) for _ in range(2))
        with torch.inference_mode():
            out[precision] = time_it(lambda: F.scaled_dot_product_attention(q, k, v), device, min_seconds=0.3)
    return out


def print_kernel_lines(model: torch.nn.Module, precisions: list[str], device: torch.device) -> None:
    """The measurements behind the engine's choices of weight layout and attention precision."""
    for p in precisions:
        times = linear_kernel_times(model, p, device)
        print(f"{p} matrices of one batch-1 decode step: " + ", ".join(f"{name} {t * 1e3:.1f} ms"
                                                                        for name, t in times.items()))
    if "bf16" in precisions:
        att = attention_times(device)
        print(f"attention of one layer, 8 rows, 1 query over 272 keys: fp32 {att['fp32'] * 1e3:.2f} ms, bf16 "
              f"{att['bf16'] * 1e3:.2f} ms")


def char_model_speedup(device: torch.device, new_tokens: int, prompt_tokens: int) -> tuple[float, float]:
    """Seconds to generate `new_tokens` with the char-small-shaped model (context 256, so the window slides), with
    the KV cache and without."""
    torch.manual_seed(0)
    config = build(ModelConfig, GEN_MODELS["char-small"], {})
    model = prepare_for_inference(GPT(config).to(device), "fp32")
    prompt = [torch.randint(0, config.vocab_size, (prompt_tokens,)).tolist()]
    run_gptlab(model, prompt, 2)
    return run_gptlab(model, prompt, new_tokens).seconds, run_gptlab(model, prompt, new_tokens, cached=False).seconds


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
    step = "fused native step (gptlab.inference.fused)" if lib else "torch ops"
    int8 = ("VNNI" if has_int8_vnni(lib) else "fp32 FMAs") if lib else "torch ops (dequantized, fp32)"
    print(f"gptlab (KV cache) decodes with: {step}; int8 products by {int8}")
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


def floor_share(result: GenResult, bytes_per_token: int) -> float:
    """A batch-1 engine run's share of the bandwidth floor: token by token where measured, else from the run."""
    if result.paired_floor == result.paired_floor:  # not NaN
        return result.paired_floor
    return result.decode_tok_s / result.floor_tok_s(bytes_per_token)
