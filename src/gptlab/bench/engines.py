"""The engine timed, for `gptlab bench generate`: greedy generation with the KV-cache engine (`generate_batch` over a
`RunningBatch`, the path `gptlab sample` runs) beside the same model without the cache and transformers' generate() on the same weights, each engine run held to the
memory-bandwidth floor (decoding one token reads every weight once); prefill, decode and time to first token, fp32,
bf16 and int8 (weight-only, gptlab.inference.int8), batch 1 and 8; the table and the ratio lines."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gptlab.bench.timing import Clock, median, read_bandwidth, read_then
from gptlab.config import ModelConfig, SampleConfig, get_preset
from gptlab.engine import generate_batch, generate_uncached
from gptlab.inference.loading import FLOAT_DTYPES, prepare_for_inference
from gptlab.inference.prepared import InferenceModel
from gptlab.model import GPT

if TYPE_CHECKING:  # transformers is optional: the twin is None without it
    from transformers import GPT2LMHeadModel

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
    """Greedy generation with the engine (or its no-cache reference), timed position by position: the engine is
    `generate_batch`, a `RunningBatch` decoding, as `gptlab sample` runs it (no prefix cache, as sample)."""
    cfg = SampleConfig(max_new_tokens=new_tokens, temperature=0)
    clock = Clock()
    for ids in (generate_batch if cached else generate_uncached)(model, prompts, cfg):
        clock.put(ids)
    return clock


def run_transformers(hf: GPT2LMHeadModel, prompts: list[list[int]], new_tokens: int) -> Clock:
    """Greedy generation with transformers' generate() and its KV cache, timed position by position."""
    x = torch.tensor(prompts, device=hf.device)
    clock = Clock(skip=1)
    with torch.inference_mode():
        hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, streamer=clock)
    return clock


def transformers_twin(model: GPT) -> GPT2LMHeadModel | None:
    """transformers' GPT2LMHeadModel holding `model`'s weights (converted by gptlab.hf.gpt2_folders), or None when
    transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    from gptlab.hf.gpt2_folders import to_hf_tensors

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
        # not for int8, whose torch path (the reference) widens every weight at every step
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
                    # a shared machine's bandwidth drifts from moment to moment: each engine run gets its own floor
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
    floor time / step time. A shared machine's bandwidth drifts from moment to moment, so a floor
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
                  f"{'-':>8}  ({bytes_per_token[r.precision] / 1e6:,.0f} MB of weights a step; memory read "
                  f"{r.bandwidth / 1e9:.1f} GB/s just before)")


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


def floor_share(result: GenResult, bytes_per_token: int) -> float:
    """A batch-1 engine run's share of the bandwidth floor: token by token where measured, else from the run."""
    if result.paired_floor == result.paired_floor:  # not NaN
        return result.paired_floor
    return result.decode_tok_s / result.floor_tok_s(bytes_per_token)
