"""`gptlab bench structured`: constrained decoding on the path `gptlab sample` runs (generate_batch over a
RunningBatch, batch 1, greedy), in one run, beside the same model decoding without a constraint.

For each of a few JSON schemas (one with long fixed keys, one nested with arrays and enums, a tool call's):
- the schema's compile time (llguidance: grammar and matcher, the tokenizer's tables made once before);
- the mask's raw time per step (mean and p99): the tokens the row took replayed through a fresh Constraint, each
  step's mask computed as the row computes it (llguidance's bitmask, unpacked to a bool per id);
- what the mask adds to a step: the engine computes the next masks on a worker thread while the model runs the
  step (both let go of the GIL), so a step waits only for what is left after the model (p99 of those waits, as a
  share of a step); and, in all (the worker's core taken from the model's threads included), the time per token
  with every token drawn under the mask over the time per token without a constraint;
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
from gptlab.engine import RunningBatch, _decode_running, overlap_masks
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


def timed_decode(model, prompt: list[int], cfg: SampleConfig, steer: Steer | None) -> tuple[list[int], float, list[float]]:
    """One prompt decoded by generate_batch's loop: its ids, the seconds from the first token to the last, and the
    seconds each step waited for its mask after the model (RunningBatch.mask_waits)."""
    batch = RunningBatch(model)
    batch.join(prompt, cfg, steer=steer)
    stamps, ids = [], []
    for step in _decode_running(batch, cfg.max_new_tokens):
        stamps.append(time.perf_counter())
        ids.append(step[0])
    return [i for i in ids if i is not None], stamps[-1] - stamps[0], list(batch.mask_waits)


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
    """One way of decoding a schema's prompts: tokens after the first, seconds, per-step mask waits."""

    tokens: int = 0
    seconds: float = 0.0
    waits: list[float] = field(default_factory=list)

    def add(self, ids: list[int], seconds: float, waits: list[float] = ()) -> None:
        self.tokens, self.seconds = self.tokens + len(ids) - 1, self.seconds + seconds
        self.waits += waits

    @property
    def per_token(self) -> float:
        return self.seconds / max(self.tokens, 1)


def run_schema(model, tokenizer, name: str, samples: int) -> dict[str, float]:
    """A schema compiled (median of 3), then `samples` seeded samples (temperature 1) decoded three ways, in turn:
    fast-forward, every token drawn under the mask, no constraint for as many tokens as the drawn one gave."""
    compiles = []
    for _ in range(3):
        start = time.perf_counter()
        grammar = compile_grammar("json_schema", SCHEMAS[name], tokenizer)
        compiles.append(time.perf_counter() - start)
    prompt = tokenizer.encode(BENCH_PROMPT)
    sides, masks = {"ff": Way(), "drawn": Way(), "overlap": Way(), "free": Way()}, []
    for seed in range(samples):
        cfg = SampleConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=seed)
        sides["ff"].add(*timed_decode(model, prompt, cfg, Steer(grammar=grammar)))
        for side, overlap in (("drawn", False), ("overlap", True)):
            engine.OVERLAP_MASKS = overlap
            try:
                ids, seconds, waits = timed_decode(model, prompt, cfg, Steer(grammar=grammar, fast_forward=False))
            finally:
                engine.OVERLAP_MASKS = None
            sides[side].add(ids, seconds, waits)
        masks += mask_times(grammar, ids)
        free = timed_decode(model, prompt, SampleConfig(max_new_tokens=len(ids), temperature=1.0, seed=seed), None)
        sides["free"].add(*free[:2])
    step = sides["free"].per_token
    return {"compile": median(compiles), "mask mean": sum(masks) / len(masks), "mask p99": p99(masks),
            "wait p99": p99(sides["overlap"].waits), "step": step, "added": sides["drawn"].per_token - step,
            "added overlap": sides["overlap"].per_token - step,
            "ff rate": 1 / sides["ff"].per_token, "drawn rate": 1 / sides["drawn"].per_token, "free rate": 1 / step,
            "tokens": sides["drawn"].tokens}


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
    print(f"masks computed {'while the model runs (a core is spare)' if overlap_masks() else 'between steps (no core is spare)'} by "
          "default here; both measured")
    print(f"{'schema':<10} {'compile ms':>10} {'mask us':>8} {'p99 us':>7} {'step ms':>8} {'added':>7} "
          f"{'overlap':>8} {'wait p99':>9} {'free tok/s':>10} {'drawn tok/s':>11} {'ff tok/s':>9} {'ff/drawn':>9}")
    out = []
    for name in SCHEMAS:
        r = run_schema(prepared, tokenizer, name, samples)
        share, overlap, wait = (r[k] / r["step"] for k in ("added", "added overlap", "wait p99"))
        print(f"{name:<10} {r['compile'] * 1e3:>10.2f} {r['mask mean'] * 1e6:>8.0f} {r['mask p99'] * 1e6:>7.0f} "
              f"{r['step'] * 1e3:>8.2f} {share:>+7.1%} {overlap:>+8.1%} {wait:>9.1%} {r['free rate']:>10.1f} "
              f"{r['drawn rate']:>11.1f} {r['ff rate']:>9.1f} {r['ff rate'] / r['drawn rate']:>8.2f}x")
        out.append(f"{name}: the mask adds {share:+.1%} to a step computed between steps ({r['added'] * 1e3:+.2f} of "
                   f"{r['step'] * 1e3:.2f} ms), {overlap:+.1%} computed while the model runs (a step then waits "
                   f"{wait:.1%} of a step for it at p99); raw mask {r['mask mean'] * 1e6:.0f} us mean, "
                   f"{r['mask p99'] * 1e6:.0f} us p99; compile {r['compile'] * 1e3:.2f} ms; fast-forward "
                   f"{r['ff rate'] / r['drawn rate']:.2f}x drawing every token")
    print(watch.stop().report())
    for line in out:
        print(line)
    return out
