"""Benchmarks that measure side by side in one run and print ratios (these machines are shared and noisy).

`peak` measures what the device can do: dense matmul throughput per precision and memory read bandwidth, and
caches it per device so that training can report MFU against a measured, not a datasheet, peak. `train` trains
one model with several variants (fp32 eager, the reference; bf16; bf16 + compile; flash attention on CUDA),
steps interleaved, and compares tokens/s, MFU and the loss reached; `attention` does the same for the two
attention paths in each precision.

`generate` times the KV-cache engine beside the same model without the cache, transformers' generate() on the
same weights, and the memory-bandwidth floor (decoding one token reads every weight once).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gptlab.config import ModelConfig, SampleConfig, TrainConfig, build, get_preset
from gptlab.engine import (PRECISIONS, InferenceLinear, can_pack, generate_batch, generate_uncached,
                           prepare_for_inference)
from gptlab.fastdecode import load_library
from gptlab.model import GPT
from gptlab.runtime import (Speed, bf16_supported, compile_model, configure_matmul, device_name, peak_cache_file,
                            peak_key, read_peak, resolve_device, set_threads)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def time_it(fn: Callable[[], Any], device: torch.device, min_seconds: float = 0.5, warmup: int = 2,
            max_iters: int = 1000, best: bool = False) -> float:
    """Seconds per call of fn over repeated calls lasting at least min_seconds, after warmup calls: the median,
    or with best the fastest call (what the device can do when nothing else runs)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while (time.perf_counter() - start < min_seconds or len(times) < 3) and len(times) < max_iters:
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return min(times) if best else sorted(times)[len(times) // 2]


CPU_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (4096, 512, 2048), (2048, 4096, 2048))
CUDA_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 4096))


def matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 1.0,
                 shapes: tuple[tuple[int, int, int], ...] | None = None) -> float:
    """Dense matmul FLOP/s in `dtype`: the best over (m, k, n) shapes large enough to keep every core (or SM)
    busy, square and transformer-like (the fp32 BLAS on some CPUs is faster on the latter), each timed by its
    fastest call, so MFU is held against the highest rate the device really reaches."""
    shapes = shapes or (CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES)
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = time_it(lambda: a @ b, device, min_seconds=seconds / len(shapes), best=True)
        best = max(best, 2 * m * k * n / t)
    return best


def read_bandwidth(device: torch.device, megabytes: int = 512, seconds: float = 1.0) -> float:
    """Memory read bandwidth in bytes/s: summing a buffer much larger than the caches."""
    x = torch.ones(megabytes * (1 << 20) // 4, device=device, dtype=torch.float32)
    t = time_it(lambda: x.sum(), device, min_seconds=seconds, best=True)
    return x.numel() * 4 / t


def measure_peak(device: torch.device, quick: bool = False) -> dict[str, Any]:
    """Matmul peak per precision (fp32; tf32 on CUDA; bf16 where native) and read bandwidth of `device`, now.
    quick: small sizes, a fraction of a second (for tests; too small to reach the peak)."""
    seconds, shapes, megabytes = (0.2, ((256, 256, 256), (512, 512, 512)), 64) if quick else (3.0, None, 512)
    peak: dict[str, Any] = {"device": device_name(device)}
    configure_matmul(device, "fp32")  # exact fp32 products: TF32 is measured on its own below
    peak["fp32"] = matmul_flops(device, torch.float32, seconds, shapes)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        peak["tf32"] = matmul_flops(device, torch.float32, seconds, shapes)
        torch.backends.cuda.matmul.allow_tf32 = False
    if bf16_supported(device):
        peak["bf16"] = matmul_flops(device, torch.bfloat16, seconds, shapes)
    peak["read_bytes_per_s"] = read_bandwidth(device, megabytes, seconds / 2)
    peak["torch"] = torch.__version__
    peak["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return peak


def cached_peak(device: torch.device, refresh: bool = False) -> dict[str, Any]:
    """The device's measured peak, from the per-device cache when present (measured and cached otherwise)."""
    peak = None if refresh else read_peak(device)
    if peak is None:
        peak = measure_peak(device)
        path = peak_cache_file(device)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(peak, indent=2))
        except OSError:
            pass  # a read-only home: measure again next time
    return peak


def run_peak(device_name_arg: str = "auto", refresh: bool = True) -> dict[str, Any]:
    set_threads()
    device = resolve_device(device_name_arg)
    peak = cached_peak(device, refresh=refresh)
    print(f"device: {peak['device']}")
    print(f"{'measure':<24} {'value':>14}")
    for key in ("fp32", "tf32", "bf16"):
        if key in peak:
            print(f"{key + ' matmul':<24} {peak[key] / 1e9:>10,.0f} GFLOP/s")
    print(f"{'memory read':<24} {peak['read_bytes_per_s'] / 1e9:>11,.1f} GB/s")
    if "bf16" in peak:
        print(f"{'bf16 / fp32':<24} {peak['bf16'] / peak['fp32']:>13.2f}x")
    return peak


# ---- generate: the KV-cache engine beside no cache, transformers' generate, and the bandwidth floor ------------

GEN_MODELS = {  # random weights in the shapes of GPT-2 small and of the char-small preset (Tiny Shakespeare's 65)
    "gpt2-124M": {**get_preset("gpt2").model, "dropout": 0.0},
    "char-small": {**get_preset("char-small").model, "vocab_size": 65, "dropout": 0.0},
}


ENGINE = "gptlab (KV cache)"


class Clock:
    """Time stamps of each new position of a generation; also a transformers streamer (whose first put() is the
    prompt, skipped)."""

    def __init__(self, skip: int = 0) -> None:
        self.skip, self.stamps, self.ids = skip, [], []
        self.start = time.perf_counter()

    def put(self, value: Any) -> None:
        if self.skip:
            self.skip -= 1
            return
        self.stamps.append(time.perf_counter())
        self.ids.append(value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else list(value))

    def end(self) -> None:
        pass

    @property
    def seconds(self) -> float:
        """From the start to the last new position."""
        return self.stamps[-1] - self.start


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


def run_gptlab(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, cached: bool = True) -> Clock:
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
    """transformers' GPT2LMHeadModel holding `model`'s weights (converted by gptlab.hf), or None when transformers
    is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    from gptlab.hf import to_hf_tensors

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
    except the position table, of which it reads one row."""
    wpe = model.transformer.wpe.weight.numel()
    return (model.num_params() - wpe) * (2 if precision == "bf16" else 4)


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
    for precision in precisions:
        model = prepare_for_inference(copy.deepcopy(base), precision)
        # the same engine with the decode step as torch ops (oneDNN-packed weights), beside the fused native step
        ops = prepare_for_inference(copy.deepcopy(base), precision, fused=False) if model.fused_decoder else None
        if hf is not None:
            hf.to(PRECISIONS[precision])
        for batch in batch_sizes:
            prompts = torch.randint(0, config.vocab_size, (batch, prompt_tokens)).tolist()
            variants: dict[str, Callable[[int], Clock]] = {ENGINE: lambda n: run_gptlab(model, prompts, n)}
            if ops is not None:
                variants["gptlab, torch-op step"] = lambda n: run_gptlab(ops, prompts, n)
            if hf is not None:
                variants["transformers generate"] = lambda n: run_transformers(hf, prompts, n)
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
            if uncached and batch == 1:
                clock = run_gptlab(model, prompts, new_tokens, cached=False)
                results.append(GenResult.of(clock, "gptlab, no cache", precision, batch, prompt_tokens))
    return results


def paired_floor(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, bytes_per_token: int,
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
            t0 = time.perf_counter()
            x.sum()
            t1 = time.perf_counter()
            if next(steps, None) is None:
                break
            floor_s = bytes_per_token / (x.numel() * 4 / (t1 - t0))
            shares.append(floor_s / (time.perf_counter() - t1))
    return sorted(shares)[len(shares) // 2] if shares else float("nan")


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
        if ours.paired_floor == ours.paired_floor:  # measured (not NaN): the floor of each step's own moment
            parts = [f"{ours.paired_floor:.0%} of the bandwidth floor (token by token)"]
        else:
            parts = [f"{ours.decode_tok_s / ours.floor_tok_s(bytes_per_token[precision]):.0%} of the bandwidth floor"]
        if theirs is not None:
            same = agreeing_prefix(ours.ids[0], theirs.ids[0])
            parts.insert(0, f"{ours.decode_tok_s / theirs.decode_tok_s:.2f}x transformers' generate (greedy ids "
                            f"agree for the first {same}/{len(ours.ids[0])})")
        if uncached is not None:
            parts.append(f"{ours.decode_tok_s / uncached.decode_tok_s:.1f}x no cache")
        lines.append(f"{precision} batch 1 decode: " + ", ".join(parts))
        if batch8 is not None:
            lines.append(f"{precision} batch 8 aggregate decode: {batch8.decode_tok_s / ours.decode_tok_s:.2f}x "
                         "batch 1")
    return lines


def linear_kernel_times(model: torch.nn.Module, precision: str, device: torch.device) -> dict[str, float]:
    """Seconds to pass one row through every Linear of `model` (the matrices a batch-1 decode step reads): with
    F.linear, with oneDNN-packed weights, and packed with the row padded to 4 rows (what the engine does)."""
    dtype = PRECISIONS[precision]
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


def run_generate(device_arg: str = "auto", new_tokens: int = 256, prompt_tokens: int = 16, char_tokens: int = 1000,
                 repeats: int = 1, uncached: bool = True, with_transformers: bool = True) -> list[str]:
    """`gptlab bench generate`: prints the table and the ratios; returns the ratio lines (the last: the headline)."""
    set_threads()
    device = resolve_device(device_arg)
    precisions = ["fp32", "bf16"] if device.type != "cpu" or bf16_supported(device) else ["fp32"]
    name, config = "gpt2-124M", build(ModelConfig, GEN_MODELS["gpt2-124M"], {})
    bandwidth = read_bandwidth(device)
    print(f"gptlab bench generate: {name} shape (random weights), prompt {prompt_tokens} tokens, {new_tokens} new "
          f"tokens, greedy; best of {repeats}")
    print(f"device: {device_name(device)}; memory read {bandwidth / 1e9:.1f} GB/s now (each engine run's floor: "
          "the read measured just before it)")
    step = "fused native step (gptlab.fastdecode)" if device.type == "cpu" and load_library() else "torch ops"
    print(f"gptlab (KV cache) decodes with: {step}")
    model = GPT(config).to(device)
    if can_pack(device, torch.float32):
        print_kernel_lines(model, precisions, device)
    bytes_per_token = {p: weight_bytes_per_token(model, p) for p in precisions}
    del model
    results = bench_model(config, device, precisions, [1, 8], prompt_tokens, new_tokens, repeats, uncached,
                          with_transformers)
    print_generation_table(name, results, bytes_per_token)
    lines = generation_ratios(results, bytes_per_token)
    if char_tokens:
        cached_s, uncached_s = char_model_speedup(device, char_tokens, prompt_tokens)
        print(f"char-small  fp32      1  {char_tokens} tokens at context 256: KV cache {cached_s:.1f} s, no cache "
              f"{uncached_s:.1f} s")
        lines.append(f"char-small: {char_tokens} tokens at context 256 {uncached_s / cached_s:.1f}x faster with the "
                     "KV cache")
    ours = {p: find(results, ENGINE, p, 1) for p in precisions}
    theirs = {p: find(results, "transformers generate", p, 1) for p in precisions}
    if all(theirs.values()):
        lines.append("headline: batch-1 decode vs transformers' generate: " + ", ".join(
            f"{p} {ours[p].decode_tok_s / theirs[p].decode_tok_s:.2f}x" for p in precisions))
    else:
        lines.append("headline: batch-1 decode at " + ", ".join(
            f"{p} {ours[p].decode_tok_s / ours[p].floor_tok_s(bytes_per_token[p]):.0%}" for p in precisions)
            + " of the bandwidth floor")
    print("\n".join(lines))
    return lines


# ---- bench train -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One way to run the same training step."""

    name: str
    precision: str
    compile: bool = False
    flash: bool = False  # CUDA: force SDPA's flash-attention kernel
    attention: str = ""  # naive / sdpa / auto; "" keeps the model's setting


def train_variants(device: torch.device) -> list[Variant]:
    """The plain fp32 eager path (the reference) first, then the fast paths this device has."""
    fast = "bf16" if bf16_supported(device) else "fp32"
    variants = [Variant("fp32 eager (reference)", "fp32")]
    if fast == "bf16":
        variants.append(Variant("bf16 eager", "bf16"))
    variants.append(Variant(f"{fast} + compile", fast, compile=True))
    if device.type == "cuda":
        variants.append(Variant(f"{fast} + compile + flash attention", fast, compile=True, flash=True,
                                attention="sdpa"))
    return variants


def attention_variants(device: torch.device) -> list[Variant]:
    """Both attention paths in each precision, eager: the evidence behind attention="auto"."""
    precisions = ["fp32"] + (["bf16"] if bf16_supported(device) else [])
    return [Variant(f"{p} eager, {a} attention" + (" (reference)" if (p, a) == ("fp32", "sdpa") else ""), p,
                    attention=a) for p in precisions for a in ("sdpa", "naive")]


@dataclass
class Contender:
    """A variant's own model and optimizer, built from the same seed as every other, and its step times."""

    variant: Variant
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    eager: torch.nn.Module
    rng: list[torch.Tensor]
    compile_s: float = 0.0
    times: list[float] = dataclasses.field(default_factory=list)

    @contextlib.contextmanager
    def running(self, device: torch.device) -> Iterator[None]:
        """This variant's attention kernel and matmul precision, and its own random stream, so that every
        variant draws the same dropout masks as it would alone (steps are interleaved)."""
        configure_matmul(device, self.variant.precision)
        saved = _rng_state(device)
        _set_rng_state(device, self.rng)
        with contextlib.ExitStack() as stack:
            if self.variant.flash:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                stack.enter_context(sdpa_kernel(SDPBackend.FLASH_ATTENTION))
            yield
        self.rng = _rng_state(device)
        _set_rng_state(device, saved)


def _rng_state(device: torch.device) -> list[torch.Tensor]:
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])


def _set_rng_state(device: torch.device, state: list[torch.Tensor]) -> None:
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)


def _contender(variant: Variant, model_cfg: ModelConfig, cfg: TrainConfig, dataset: Any,
               device: torch.device) -> Contender:
    from gptlab.model import build_model
    from gptlab.optim import make_optimizer
    from gptlab.train import warm_up

    torch.manual_seed(cfg.seed)
    model_cfg = dataclasses.replace(model_cfg, attention=variant.attention or model_cfg.attention)
    eager = build_model(model_cfg).to(device)
    contender = Contender(variant, eager, make_optimizer(eager, cfg), eager, _rng_state(device))
    if variant.compile:
        start = time.perf_counter()
        with contender.running(device):
            contender.model = compile_model(eager, warm_up(dataset, cfg, model_cfg.block_size, device,
                                                           variant.precision))
        contender.compile_s = time.perf_counter() - start
    return contender


def run_train_bench(data_dir: str | Path, model_cfg: ModelConfig, cfg: TrainConfig, steps: int = 10, warmup: int = 2,
                    variants: list[Variant] | None = None) -> list[dict[str, Any]]:
    """Train the same model on the same batches with every variant, steps interleaved so that a busy machine
    slows them alike: `warmup` untimed steps, then `steps` timed ones. Prints the table (tokens/s, ms/step, MFU
    against the measured peak, ratio to the fp32 reference, validation loss after all steps next to fp32's) and
    returns its rows. `variants` defaults to train_variants(device); the first is the reference."""
    from gptlab.data import load_dataset
    from gptlab.train import estimate_loss, train_step

    set_threads()
    device = resolve_device(cfg.device)
    if read_peak(device) is None:
        print("measuring this device's matmul peak first (cached for later runs) ...", flush=True)
    peak = cached_peak(device)
    dataset = load_dataset(data_dir)
    model_cfg = dataclasses.replace(model_cfg, vocab_size=model_cfg.vocab_size or dataset.tokenizer.vocab_size)
    total = warmup + steps
    cfg = dataclasses.replace(cfg, grad_accum=1, max_steps=total, warmup_steps=min(cfg.warmup_steps, total // 4),
                              eval_batches=4)
    contenders = [_contender(v, model_cfg, cfg, dataset, device) for v in variants or train_variants(device)]
    for step in range(total):
        for c in contenders:
            with c.running(device):
                start = time.perf_counter()
                train_step(c.model, c.optimizer, dataset, cfg, model_cfg.block_size, step, device, c.variant.precision)
                sync(device)
            if step >= warmup:
                c.times.append(time.perf_counter() - start)
    configure_matmul(device, "fp32")
    rows = [_row(c, estimate_loss(c.eager, dataset, cfg, model_cfg.block_size, device, "fp32")["val"], peak,
                 cfg.batch_size * model_cfg.block_size) for c in contenders]
    _print_train_table(rows, peak, model_cfg, cfg, total, contenders[0].eager)
    return rows


def _row(c: Contender, val_loss: float, peak: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
    seconds = sorted(c.times)[len(c.times) // 2]
    key = peak_key(c.variant.precision)
    tokens_per_s, mfu = Speed(tokens_per_step, c.eager.flops_per_token(), peak.get(key)).rates(1, seconds)
    return {"variant": c.variant.name, "ms_per_step": seconds * 1e3, "best_ms": min(c.times) * 1e3,
            "tokens_per_s": tokens_per_s, "mfu": float("nan") if mfu is None else mfu, "peak": key,
            "val_loss": val_loss, "compile_s": c.compile_s, "compiled": c.model is not c.eager}


def _print_train_table(rows: list[dict[str, Any]], peak: dict[str, Any], model_cfg: ModelConfig, cfg: TrainConfig,
                       total: int, model: torch.nn.Module) -> None:
    print(f"device: {peak['device']}; peaks measured {peak.get('measured_at', '?')}: "
          + ", ".join(f"{k} {peak[k] / 1e9:,.0f} GFLOP/s" for k in ("fp32", "tf32", "bf16") if k in peak))
    print(f"model: {model_cfg.n_layer} layers x {model_cfg.n_embd} wide, context {model_cfg.block_size}, "
          f"{model.num_params() / 1e6:.2f}M parameters, {model.flops_per_token() / 1e6:.1f} MFLOP per token "
          f"(training); batch {cfg.batch_size}; dropout {model_cfg.dropout}; {total} steps from seed {cfg.seed}")
    ref = rows[0]
    print("ms/step: the median of the timed steps (best: the fastest); tokens/s and MFU from the median")
    print(f"{'variant':<40} {'ms/step':>9} {'best':>8} {'tokens/s':>9} {'MFU':>6} {'vs ref':>7} {'val loss':>9} "
          f"{'Δ loss':>8}")
    for r in rows:
        note = "" if r["compiled"] or "compile" not in r["variant"] else "  (compile unavailable: ran eager)"
        note += f"  (compiled in {r['compile_s']:.0f} s)" if r["compiled"] else ""
        print(f"{r['variant']:<40} {r['ms_per_step']:>9.1f} {r['best_ms']:>8.1f} {r['tokens_per_s']:>9,.0f} {r['mfu']:>6.1%} "
              f"{r['tokens_per_s'] / ref['tokens_per_s']:>6.2f}x {r['val_loss']:>9.4f} "
              f"{r['val_loss'] - ref['val_loss']:>+8.4f}{note}")
    best = max(rows, key=lambda r: r["tokens_per_s"])
    print(f"{best['variant']}: {best['tokens_per_s'] / ref['tokens_per_s']:.2f}x the fp32 reference's tokens/s, "
          f"MFU {best['mfu']:.1%} of the measured {best['peak']} peak")
