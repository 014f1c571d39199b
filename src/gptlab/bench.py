"""Benchmarks that measure side by side in one run and print ratios (these machines are shared and noisy).

`peak` measures what the device can do: dense matmul throughput per precision and memory read bandwidth, and
caches it per device so that training can report MFU against a measured, not a datasheet, peak. `train` trains
one model with several variants (fp32 eager, the reference; bf16; bf16 + compile; flash attention on CUDA),
steps interleaved, and compares tokens/s, MFU and the loss reached; `attention` does the same for the two
attention paths in each precision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptlab.config import ModelConfig, TrainConfig
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
