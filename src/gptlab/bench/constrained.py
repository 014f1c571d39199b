"""`gptlab bench structured`: constrained decoding on the path `gptlab sample` runs (generate_batch over a
RunningBatch, batch 1, greedy), in one run, beside the same model decoding without a constraint.

For each of a few JSON schemas (one with long fixed keys, one nested with arrays and enums, a tool call's):
- the schema's compile time (llguidance: grammar and matcher, the tokenizer's tables made once before);
- the mask's raw time per step (mean and p99): the tokens the row took replayed through a fresh Constraint, each
  step's mask computed as the row computes it (llguidance's bitmask, unpacked to a bool per id);
- what the mask adds to a step (mean and p99, as a share of a step without a constraint): each step's draw
  (RunningBatch.sample: the mask, the masked draw, the grammar's move) over the median draw without a constraint;
  computed between steps, and on a worker thread while the model runs (the engine's default), then the draw over
  the median plus the wait after the model; tokens/s both ways (the worker's core taken from the model's threads
  shows there);
- decode tokens/s (seeded samples, temperature 1) with the constraint (forced runs fed in one step: fast-forward),
  with it but every token drawn under the mask (no fast-forward), and without a constraint for as many tokens;
- fast-forward's speed-up over drawing every token: tokens/s with it over tokens/s without.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gptlab.bench.serve import served_model
from gptlab.bench.timing import LoadWatch, median
from gptlab.config import SampleConfig
from gptlab import engine
from gptlab.engine import RunningBatch, overlap_masks
from gptlab.errors import GptlabError
from gptlab.inference.grammar import compile_grammar, lltokenizer
from gptlab.inference.rows import Steer
from gptlab.runtime import device_name, resolve_precision, set_threads

SCHEMAS = {
    "long keys": {"type": "object", "additionalProperties": False, "properties": {
        "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 999999},
        "preferred_delivery_time_window": {"enum": ["morning", "afternoon", "evening"]},
        "requires_signature_on_delivery": {"type": "boolean"},
        "special_handling_instructions_text": {"type": "string", "maxLength": 24}},
        "required": ["customer_account_identifier", "preferred_delivery_time_window",
                     "requires_signature_on_delivery", "special_handling_instructions_text"]},
    "nested": {"type": "object", "additionalProperties": False, "required": ["name", "tags", "address"],
               "properties": {"name": {"type": "string", "maxLength": 12},
                              "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                       "minItems": 1, "maxItems": 4},
                              "address": {"type": "object", "additionalProperties": False,
                                          "required": ["city", "zip"],
                                          "properties": {"city": {"type": "string", "maxLength": 10},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "tool call": {"anyOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": "get_weather"}, "arguments": {
             "type": "object", "additionalProperties": False, "required": ["city", "unit"],
             "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}}}}},
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": "get_time"}, "arguments": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}}}}]},
}
BENCH_PROMPT = "Here is the answer as JSON:\n"
NEW_TOKENS = 160  # the most a sample may take (the schemas bound their outputs well below)


def timed_decode(model, prompt: list[int], cfg: SampleConfig, steer: Steer | None) -> tuple[list[int], float,
                                                                                        list[float], list[float]]:
    """One prompt decoded by a RunningBatch, step by step as generate_batch decodes one row: its ids, the seconds
    from the first token to the last, each step's draw (RunningBatch.sample: the mask, the draw, the grammar's
    move), and the seconds each step waited for its mask after the model (RunningBatch.mask_waits)."""
    batch = RunningBatch(model)
    batch.join(prompt, cfg, steer=steer)
    ids, draws, first, last = [], [], None, 0.0
    while batch.rows:
        start = time.perf_counter()
        ids += [token for _, token, _ in batch.sample()]
        last = time.perf_counter()
        draws.append(last - start)
        first = first if first is not None else last
        batch.advance()
    return ids, last - (first or last), draws, list(batch.mask_waits)


def mask_times(grammar, ids: list[int]) -> list[float]:
    """Seconds each step's mask takes, the row's tokens replayed through a fresh Constraint (fast-forward off: a
    mask every step, as the row computed them)."""
    constraint, times = grammar.start(fast_forward=False), []
    for token in ids:
        start = time.perf_counter()
        constraint.allowed()
        times.append(time.perf_counter() - start)
        constraint.consume(token)
    return times


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@dataclass
class Way:
    """One way of decoding a schema's prompts: tokens after the first, seconds, each step's draw, mask waits."""

    tokens: int = 0
    seconds: float = 0.0
    draws: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)

    def add(self, ids: list[int], seconds: float, draws: list[float] = (), waits: list[float] = ()) -> None:
        self.tokens, self.seconds = self.tokens + len(ids) - 1, self.seconds + seconds
        self.draws += draws
        self.waits += waits

    @property
    def per_token(self) -> float:
        return self.seconds / max(self.tokens, 1)


def run_schema(model, tokenizer, name: str, samples: int) -> dict[str, float]:
    """A schema compiled (median of 3), then `samples` seeded samples (temperature 1) decoded four ways, in turn:
    fast-forward; every token drawn under the mask, computed between steps, then while the model runs; no
    constraint for as many tokens as the drawn one gave. What the mask adds to a step: a step's draw over the
    median draw without a constraint (and, computed while the model runs, the wait after the model)."""
    compiles = []
    for _ in range(3):
        start = time.perf_counter()
        grammar = compile_grammar("json_schema", SCHEMAS[name], tokenizer)
        compiles.append(time.perf_counter() - start)
    prompt = tokenizer.encode(BENCH_PROMPT)
    ways, masks, first = {"ff": Way(), "drawn": Way(), "overlap": Way(), "free": Way()}, [], []
    for seed in range(samples):
        cfg = SampleConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=seed)
        ways["ff"].add(*timed_decode(model, prompt, cfg, Steer(grammar=grammar)))
        for way, overlap in (("drawn", False), ("overlap", True)):
            default, engine.OVERLAP_MASKS = engine.OVERLAP_MASKS, overlap
            try:
                ids, *timed = timed_decode(model, prompt, cfg, Steer(grammar=grammar, fast_forward=False))
            finally:
                engine.OVERLAP_MASKS = default
            ways[way].add(ids, *timed)
        first = first if seed else ids
        masks += mask_times(grammar, ids)
        ways["free"].add(*timed_decode(model, prompt, SampleConfig(max_new_tokens=len(ids), temperature=1.0,
                                                                   seed=seed), None))
    base, step = median(ways["free"].draws), ways["free"].per_token
    added = [d - base for d in ways["drawn"].draws]
    overlap = [d - base for d in ways["overlap"].draws]
    waits = ways["overlap"].waits or [0.0]
    return {"compile": median(compiles), "mask mean": sum(masks) / len(masks), "mask p99": p99(masks),
            "step": step, "added mean": sum(added) / len(added), "added p99": p99(added),
            "overlap mean": sum(overlap) / len(overlap) + sum(waits) / len(waits),
            "overlap p99": p99(overlap) + p99(waits), "ff rate": 1 / ways["ff"].per_token,
            "drawn rate": 1 / ways["drawn"].per_token, "overlap rate": 1 / ways["overlap"].per_token,
            "free rate": 1 / step, "tokens": ways["drawn"].tokens, "ways": ways, "first": first}


def run_structured(*, run: str | None = None, precision: str = "auto", samples: int = 8, served=None) -> list[str]:
    """The table and its summary lines (returned); `served`: a Served to bench instead (tests)."""
    set_threads()
    watch, device = LoadWatch(), torch.device("cpu")
    from gptlab.inference.loading import bf16_storage_possible

    if served is None:
        served = served_model("gpt2-124M", run, resolve_precision(precision, device, bf16_storage_possible(device)))
    prepared, tokenizer = served.model, served.tokenizer
    if len(tokenizer.encode(BENCH_PROMPT)) + NEW_TOKENS + 1 > prepared.config.block_size:
        raise GptlabError("the model's context is too short for this bench's prompt and 160 new tokens")
    start = time.perf_counter()
    lltokenizer(tokenizer)
    tables = time.perf_counter() - start
    print(f"gptlab bench structured: {served.name} ({served.parameters / 1e6:.0f}M parameters, {prepared.precision}, "
          f"{'fused' if prepared.fused else 'torch'} step), batch 1, {samples} seeded samples a schema each way")
    print(f"device: {device_name(device)}; {torch.get_num_threads()} threads; llguidance's tokenizer tables made "
          f"once in {tables * 1e3:.0f} ms")
    print(f"the engine computes masks {'while the model runs' if overlap_masks() else 'between steps'} by default; "
          "both measured")
    print(f"{'schema':<10} {'compile ms':>10} {'mask us':>8} {'p99 us':>7} {'step ms':>8} {'adds':>6} {'p99':>6} "
          f"{'overlap':>8} {'p99':>6} {'free tok/s':>10} {'drawn tok/s':>11} {'overlap':>8} {'ff tok/s':>9} {'ff/drawn':>9}")
    out = []
    for name in SCHEMAS:
        r = run_schema(prepared, tokenizer, name, samples)
        share = {k: r[k] / r["step"] for k in ("added mean", "added p99", "overlap mean", "overlap p99")}
        print(f"{name:<10} {r['compile'] * 1e3:>10.2f} {r['mask mean'] * 1e6:>8.0f} {r['mask p99'] * 1e6:>7.0f} "
              f"{r['step'] * 1e3:>8.2f} {share['added mean']:>6.1%} {share['added p99']:>6.1%} "
              f"{share['overlap mean']:>8.1%} {share['overlap p99']:>6.1%} {r['free rate']:>10.1f} "
              f"{r['drawn rate']:>11.1f} {r['overlap rate']:>8.1f} {r['ff rate']:>9.1f} "
              f"{r['ff rate'] / r['drawn rate']:>8.2f}x")
        out.append(f"{name}: the mask adds {share['added mean']:.1%} to a step ({share['added p99']:.1%} at p99) "
                   f"computed between steps, {share['overlap mean']:.1%} ({share['overlap p99']:.1%} at p99) computed "
                   f"while the model runs, of a {r['step'] * 1e3:.2f} ms step; {r['free rate']:.1f} tokens/s without a "
                   f"constraint, {r['drawn rate']:.1f} / {r['overlap rate']:.1f} with (between / while); raw mask {r['mask mean'] * 1e6:.0f} us "
                   f"mean, {r['mask p99'] * 1e6:.0f} us p99; compile {r['compile'] * 1e3:.2f} ms; fast-forward "
                   f"{r['ff rate'] / r['drawn rate']:.2f}x drawing every token")
    print(watch.stop().report())
    for line in out:
        print(line)
    return out
