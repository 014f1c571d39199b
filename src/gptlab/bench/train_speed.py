"""`gptlab bench train` and `gptlab bench attention`: one model trained with several variants (fp32 eager, the
reference; with --traced, the same traced by gptlab.inspect before every step; bf16; bf16 + compile; flash
attention on CUDA; or each attention path in each precision; or without and with activation checkpointing, with
each one's memory), steps interleaved so that a busy machine slows them alike, compared by tokens/s, MFU and the
loss reached. Training runs through gptlab.training's public functions, as a user's loop would."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gptlab import lora
from gptlab.bench.device_peak import cached_peak
from gptlab.bench.memory import measure_in_fresh_process
from gptlab.bench.timing import Load, LoadWatch, median, sync
from gptlab.config import ModelConfig, TrainConfig
from gptlab.peak import Peak, Speed, peak_key, read_peak
from gptlab.runtime import (bf16_supported, compile_model, configure_matmul, resolve_device, reuse_freed_memory,
                            set_threads)

if TYPE_CHECKING:
    from gptlab.data.batches import Dataset
    from gptlab.training.step import StepContext


@dataclass(frozen=True)
class Variant:
    """One way to run the same training step."""

    name: str
    precision: str
    compile: bool = False
    flash: bool = False  # CUDA: force SDPA's flash-attention kernel
    attention: str = ""  # naive / sdpa / auto; "" keeps the model's setting
    traced: bool = False  # gptlab.inspect traces the model before each step, outside the timed region
    checkpointing: bool = False  # activation checkpointing: each block recomputed in backward
    lora_rank: int = 0  # LoRA adapters of this rank on c_attn (PEFT's default for GPT-2), the rest frozen


def train_variants(device: torch.device, traced: bool = False) -> list[Variant]:
    """The plain fp32 eager path (the reference) first, then (traced) the same path with the model traced before
    every step, then the fast paths this device has."""
    fast = "bf16" if bf16_supported(device) else "fp32"
    variants = [Variant("fp32 eager (reference)", "fp32")]
    if traced:
        variants.append(Variant("fp32 eager, traced before each step", "fp32", traced=True))
    if fast == "bf16":
        variants.append(Variant("bf16 eager", "bf16"))
    variants.append(Variant(f"{fast} + compile", fast, compile=True))
    if device.type == "cuda":
        variants.append(Variant(f"{fast} + compile + flash attention", fast, compile=True, flash=True,
                                attention="sdpa"))
    return variants


def checkpointing_variants(device: torch.device) -> list[Variant]:
    """The precision training picks by default (bf16 where native), eager, without and with activation
    checkpointing."""
    fast = "bf16" if bf16_supported(device) else "fp32"
    return [Variant(f"{fast} eager (reference)", fast),
            Variant(f"{fast} eager, activation checkpointing", fast, checkpointing=True)]


def lora_variants(device: torch.device, rank: int) -> list[Variant]:
    """Fine-tuning every weight (the reference), LoRA adapters of `rank`, and LoRA with activation checkpointing,
    in the precision training picks by default, eager."""
    fast = "bf16" if bf16_supported(device) else "fp32"
    return [Variant(f"{fast} full fine-tuning (reference)", fast),
            Variant(f"{fast} LoRA rank {rank}", fast, lora_rank=rank),
            Variant(f"{fast} LoRA rank {rank}, activation ckpt", fast, checkpointing=True, lora_rank=rank)]


def attention_variants(device: torch.device) -> list[Variant]:
    """Both attention paths in each precision, eager: the evidence behind attention="auto"."""
    precisions = ["fp32"] + (["bf16"] if bf16_supported(device) else [])
    return [Variant(f"{p} eager, {a} attention" + (" (reference)" if (p, a) == ("fp32", "sdpa") else ""), p,
                    attention=a) for p in precisions for a in ("sdpa", "naive")]


@dataclass
class Contender:
    """A variant's own model and optimizer, built from the same seed as every other, and its step times."""

    variant: Variant
    ctx: StepContext  # the data, settings and device every variant shares, in its own precision
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


def build_contender(variant: Variant, model_cfg: ModelConfig, cfg: TrainConfig, dataset: Dataset,
                    device: torch.device) -> Contender:
    """The variant's model and optimizer, built from cfg.seed (compiled now where the variant compiles)."""
    from gptlab.model import build_model
    from gptlab.optim import make_optimizer
    from gptlab.training.step import StepContext, warm_up

    torch.manual_seed(cfg.seed)
    model_cfg = dataclasses.replace(model_cfg, attention=variant.attention or model_cfg.attention)
    eager = build_model(model_cfg).to(device)
    if variant.lora_rank:
        lora.apply_lora(eager, lora.LoraSettings(variant.lora_rank, 8.0, 0.0, ("c_attn",)))
        if variant.precision == "bf16":  # as training stores a LoRA run's frozen base
            lora.store_frozen_matrices(eager, torch.bfloat16)
    eager.checkpoint_blocks, eager.loss_chunk = variant.checkpointing, cfg.loss_chunk
    ctx = StepContext(dataset, cfg, model_cfg.block_size, device, variant.precision)
    contender = Contender(variant, ctx, eager, make_optimizer(eager, cfg), eager, _rng_state(device))
    if variant.compile:
        start = time.perf_counter()
        with contender.running(device):
            contender.model = compile_model(eager, warm_up(ctx))
        contender.compile_s = time.perf_counter() - start
    return contender


def run_train_bench(data_dir: str | Path, model_cfg: ModelConfig, cfg: TrainConfig, *, steps: int = 10,
                    warmup: int = 2, variants: list[Variant] | None = None,
                    memory: bool = False) -> list[dict[str, Any]]:
    """Train the same model on the same batches with every variant, steps interleaved so that a busy machine
    slows them alike: `warmup` untimed steps, then `steps` timed ones. Prints the machine's load and the table
    (tokens/s, ms/step, MFU against the measured peak, ratio to the fp32 reference, validation loss after all
    steps next to fp32's), the headline last, and returns its rows. `variants` defaults to
    train_variants(device); the first is the reference. With `memory`, each variant's memory is measured first,
    in a fresh process each (gptlab.bench.memory), and a memory table follows, its headline (the second
    variant against the first) last."""
    from gptlab.data.batches import load_dataset
    from gptlab.training.step import StepContext, estimate_loss, train_step

    set_threads()
    reuse_freed_memory()
    device = resolve_device(cfg.device)
    if read_peak(device) is None:
        print("measuring this device's matmul peak first (cached for later runs on a quiet machine) ...", flush=True)
    peak = cached_peak(device)
    dataset = load_dataset(data_dir)
    model_cfg = dataclasses.replace(model_cfg, vocab_size=model_cfg.vocab_size or dataset.tokenizer.vocab_size)
    total = warmup + steps
    cfg = dataclasses.replace(cfg, grad_accum=1, max_steps=total, warmup_steps=min(cfg.warmup_steps, total // 4),
                              eval_batches=4)
    variants = variants or train_variants(device)
    memories = [measure_in_fresh_process(build_contender, v, model_cfg, cfg, Path(data_dir))
                for v in variants] if memory else []
    watch = LoadWatch()  # after the memory's processes: their time is not other work
    contenders = [build_contender(v, model_cfg, cfg, dataset, device) for v in variants]
    for step in range(total):
        for c in contenders:
            with c.running(device):
                if c.variant.traced:
                    _trace(c.eager, dataset, cfg.seed, step, model_cfg.block_size, device)
                start = time.perf_counter()
                train_step(c.model, c.optimizer, c.ctx, step)
                sync(device)
            if step >= warmup:
                c.times.append(time.perf_counter() - start)
    load = watch.stop()
    configure_matmul(device, "fp32")
    reference = StepContext(dataset, cfg, model_cfg.block_size, device, "fp32")
    rows = [_row(c, estimate_loss(_in_fp32(c.eager), reference)["val"], peak, cfg.batch_size * model_cfg.block_size)
            for c in contenders]
    _print_train_table(rows, peak, model_cfg, cfg, total, contenders[0].eager, load, headline=not memory)
    for row, measured in zip(rows, memories):
        row.update({f"{key}_bytes": value for key, value in measured.items()})
    if memory:
        _print_memory_table(rows, device)
    return rows


def _in_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """The model with a LoRA variant's bf16 frozen matrices back in fp32 (exactly), for the fp32 evaluation."""
    lora.store_frozen_matrices(model, torch.float32)
    return model


def _trace(model: torch.nn.Module, dataset: Dataset, seed: int, step: int, block_size: int, device: torch.device) -> None:
    """What a user looking inside the model between steps does: trace one window of the training split."""
    from gptlab.data.batches import batch_generator, get_batch
    from gptlab.inspect.trace import trace

    x, _ = get_batch(dataset.train, 1, block_size, batch_generator(seed, step, -2))
    trace(model, x.to(device))


def _row(c: Contender, val_loss: float, peak: Peak, tokens_per_step: int) -> dict[str, Any]:
    seconds = median(c.times)
    key = peak_key(c.variant.precision)
    tokens_per_s, mfu = Speed(tokens_per_step, c.eager.flops_per_token(), peak.flops(key)).rates(1, seconds)
    return {"variant": c.variant.name, "ms_per_step": seconds * 1e3, "best_ms": min(c.times) * 1e3,
            "tokens_per_s": tokens_per_s, "mfu": float("nan") if mfu is None else mfu, "peak": key,
            "val_loss": val_loss, "compile_s": c.compile_s, "compiled": c.model is not c.eager}


def _print_train_table(rows: list[dict[str, Any]], peak: Peak, model_cfg: ModelConfig, cfg: TrainConfig,
                       total: int, model: torch.nn.Module, load: Load, headline: bool = True) -> None:
    flops = {"fp32": peak.fp32, "tf32": peak.tf32, "bf16": peak.bf16}
    print(f"device: {peak.device}; peaks measured {peak.measured_at or '?'}: "
          + ", ".join(f"{k} {v / 1e9:,.0f} GFLOP/s" for k, v in flops.items() if v is not None))
    print(load.report())
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
        print(f"{r['variant']:<40} {r['ms_per_step']:>9.1f} {r['best_ms']:>8.1f} {r['tokens_per_s']:>9,.0f} "
              f"{r['mfu']:>6.1%} {r['tokens_per_s'] / ref['tokens_per_s']:>6.2f}x {r['val_loss']:>9.4f} "
              f"{r['val_loss'] - ref['val_loss']:>+8.4f}{note}")
    best = max(rows, key=lambda r: r["tokens_per_s"])
    if headline:
        print(f"{best['variant']}: {best['tokens_per_s'] / ref['tokens_per_s']:.2f}x the fp32 reference's tokens/s, "
              f"MFU {best['mfu']:.1%} of the measured {best['peak']} peak")


def _print_memory_table(rows: list[dict[str, Any]], device: torch.device) -> None:
    """Each variant's memory beside the reference's (the first row), then the second row against the first."""
    what = "torch's allocated bytes" if device.type == "cuda" else "the resident set"
    print("memory, each variant in a fresh process: saved = the distinct storages one forward keeps for backward "
          f"(parameters left out); step = the peak of {what} during one step above its level once the model and "
          "the optimizer's state exist (base)")
    print(f"{'variant':<40} {'saved MB':>9} {'vs ref':>7} {'step MB':>9} {'vs ref':>7} {'base MB':>9} "
          f"{'ms/step':>9} {'vs ref':>7}")
    ref, mb = rows[0], 1 / 2**20
    for r in rows:
        print(f"{r['variant']:<40} {r['saved_bytes'] * mb:>9,.1f} {r['saved_bytes'] / ref['saved_bytes']:>6.2f}x "
              f"{r['step_bytes'] * mb:>9,.1f} {r['step_bytes'] / max(ref['step_bytes'], 1):>6.2f}x "
              f"{r['base_bytes'] * mb:>9,.1f} {r['ms_per_step']:>9.1f} {r['ms_per_step'] / ref['ms_per_step']:>6.2f}x")
    if any(r["variant"] != ref["variant"] and "LoRA" in r["variant"] for r in rows):
        _print_lora_memory(rows)
    elif len(rows) > 1:
        r = rows[1]
        print(f"{r['variant']}: saved for backward {ref['saved_bytes'] / max(r['saved_bytes'], 1):.2f}x smaller, "
              f"step memory {ref['step_bytes'] / max(r['step_bytes'], 1):.2f}x smaller, "
              f"step time {r['ms_per_step'] / ref['ms_per_step']:.2f}x the reference's")


def _print_lora_memory(rows: list[dict[str, Any]]) -> None:
    """Each variant's peak (base + step) split into weights, gradients + AdamW state and activations (saved for
    backward), then each LoRA variant's peak and step time against full fine-tuning's (the first row)."""
    print(f"{'variant':<40} {'peak MB':>9} {'vs ref':>7} {'weights':>9} {'grad+opt':>9} {'activ.':>9} {'rest':>9}")
    ref, mb = rows[0], 1 / 2**20
    peak = {r["variant"]: r["base_bytes"] + r["step_bytes"] for r in rows}
    for r in rows:
        rest = peak[r["variant"]] - r["weights_bytes"] - r["trained_bytes"] - r["saved_bytes"]
        print(f"{r['variant']:<40} {peak[r['variant']] * mb:>9,.1f} {peak[r['variant']] / peak[ref['variant']]:>6.0%} "
              f" {r['weights_bytes'] * mb:>9,.1f} {r['trained_bytes'] * mb:>9,.1f} {r['saved_bytes'] * mb:>9,.1f} "
              f"{rest * mb:>9,.1f}")
    print("; ".join(f"{r['variant']}: peak {peak[r['variant']] / peak[ref['variant']]:.0%} of full fine-tuning's, "
                    f"step time {r['ms_per_step'] / ref['ms_per_step']:.2f}x" for r in rows[1:]))
