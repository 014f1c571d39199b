"""`gptlab bench speculative`: batch-1 decoding on the path `gptlab sample` runs (generate_batch over a
RunningBatch), with `--speculate auto` beside `off`, in one run, on text a model can copy from and on open text.

Tasks, each prompts from the bundled corpus (Tiny Shakespeare) through the model's tokenizer:
- "repeat": a passage, then "Once more:" and the passage's first line: the continuation that copies the passage
  is what a lookup proposes (greedy);
- "edit": a passage, then the same passage with one word changed, cut after the change (greedy);
- "open": a passage to continue, sampled (temperature 0.8, seeded): proposals are mostly refused;
- "predicted": the open task's prompts, each with its true answer as a predicted output (OpenAI's `prediction`),
  speculation otherwise off: what a client that knows most of the answer (an edit of a file) gets.
Per task: decode tokens/s without and with speculation (from the first token to the last, prompt pass left out,
the same tokens either way: checked), their ratio, the share of proposed tokens kept, the tokens per step (per read
of the weights), and the bandwidth floor's tokens/s (the weights' bytes a step over the memory's read rate,
measured just before: `memory_rate`). Where the weights fit the CPU's last-level cache, one token a step can run
past that floor too: steps back to back find them there. What a model keeps depends on what it learnt: a random model's greedy text falls into loops
a lookup predicts, a trained model copies what induction heads copy; the table names the model.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from gptlab.bench.engines import weight_bytes_per_token
from gptlab.bench.serve import served_model
from gptlab.bench.timing import LoadWatch, median, read_then
from gptlab.config import SampleConfig
from gptlab.data.corpus import bundled_source
from gptlab.engine import RunningBatch, _decode_running
from gptlab.errors import GptlabError
from gptlab.runtime import device_name, resolve_precision, set_threads

TASKS = ("repeat", "edit", "open", "predicted")


@dataclass
class Decoded:
    """One task decoded one way: tokens generated after the first, the seconds they took, proposals."""

    tokens: int = 0
    seconds: float = 0.0
    proposed: int = 0
    kept: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def passages(text: str, count: int, lines: int, seed: int) -> list[str]:
    """`count` passages of `lines` whole lines from `text`, drawn at random (seeded)."""
    all_lines = [line for line in text.splitlines() if line.strip()]
    rng = random.Random(seed)
    starts = [rng.randrange(len(all_lines) - lines) for _ in range(count)]
    return ["\n".join(all_lines[s:s + lines]) for s in starts]


def prompt_text(task: str, passage: str, rng: random.Random) -> str:
    """The prompt of `task` for `passage` (see the module's docstring)."""
    if task == "repeat":
        return f"{passage}\n\nOnce more:\n{passage.splitlines()[0]}\n"
    if task == "edit":
        words = passage.split(" ")
        i = rng.randrange(len(words) // 3, max(len(words) // 3 + 1, len(words) // 2))
        changed = " ".join(words[:i] + ["and"] + words[i + 1:])
        return f"{passage}\n\nThe same, one word changed:\n{' '.join(changed.split(' ')[:i + 1])}"
    return passage + "\n"


def encode(tokenizer, text: str) -> list[int]:
    """`text`'s ids; where the tokenizer refuses it (a char vocabulary that never saw some of its characters),
    those characters are left out."""
    try:
        return tokenizer.encode(text)
    except GptlabError:
        known: dict[str, bool] = {}
        for c in set(text):
            try:
                known[c] = bool(tokenizer.encode(c))
            except GptlabError:
                known[c] = False
        return tokenizer.encode("".join(c for c in text if known[c]))


def decode(model, prompt: list[int], cfg: SampleConfig, prediction: list[int] | None = None
           ) -> tuple[list[int], Decoded]:
    """One prompt decoded by generate_batch's loop; its ids and what it took from the first token on."""
    batch = RunningBatch(model)
    batch.join(prompt, cfg, prediction=prediction)
    stamps, ids = [], []
    for step in _decode_running(batch, cfg.max_new_tokens):
        stamps.append(time.perf_counter())
        ids.append(step[0])
    return ids, Decoded(len(ids) - 1, stamps[-1] - stamps[0], batch.tally.proposed, batch.tally.kept)


def run_task(model, tokenizer, task: str, texts: list[str], new_tokens: int, seed: int) -> dict[str, Decoded]:
    """Every passage's prompt decoded with speculation off, then auto (alternating which goes first); sums."""
    rng, context = random.Random(seed), model.config.block_size
    sides = {"off": Decoded(), "auto": Decoded()}
    for n, passage in enumerate(texts):
        prompt = encode(tokenizer, prompt_text(task, passage, rng))[-(context - new_tokens):]
        greedy, outs = task in ("repeat", "edit"), {}
        modes = ("off", "auto") if n % 2 == 0 or task == "predicted" else ("auto", "off")
        for mode in modes:  # (a prediction is the answer without it: that run first)
            cfg = SampleConfig(max_new_tokens=new_tokens, temperature=0 if greedy else 0.8, seed=seed + n,
                               speculate="off" if task == "predicted" else mode)
            predicted = outs["off"] if task == "predicted" and mode == "auto" else None
            outs[mode], side = decode(model, prompt, cfg, predicted)
            total = sides[mode]
            total.tokens, total.seconds = total.tokens + side.tokens, total.seconds + side.seconds
            total.proposed, total.kept = total.proposed + side.proposed, total.kept + side.kept
        if outs["off"] != outs["auto"]:
            raise GptlabError(f"speculation changed the tokens of {task} prompt {n}: a bug, please report it")
    return sides


def summary(task: str, off: Decoded, auto: Decoded, floor: float) -> tuple[str, str]:
    """The table's row and the summary line of a task: auto's rate over off's, the share of proposed tokens kept,
    tokens per step (each step gives one token and the proposals kept), auto's rate over the floor's."""
    kept = auto.kept / auto.proposed if auto.proposed else 0.0
    per_step = auto.tokens / max(auto.tokens - auto.kept, 1)
    ratio = auto.rate / off.rate if off.rate else float("nan")
    row = (f"{task:<8} {off.rate:>10.1f} {auto.rate:>11.1f} {ratio:>8.2f}x {kept:>7.0%} {per_step:>9.2f} "
           f"{floor:>12.1f} {auto.rate / floor:>10.2f}x")
    return row, (f"{task}: {ratio:.2f}x ({auto.rate:.1f} vs {off.rate:.1f} tokens/s; {kept:.0%} of {auto.proposed} "
                 f"proposed tokens kept; {per_step:.2f} tokens a step; {auto.rate / floor:.2f}x the floor)")


def memory_rate(megabytes: int = 512, reads: int = 3) -> float:
    """The memory's read rate in bytes/s: the median of `reads` reads of one buffer, each after a read of another as
    large (so that neither is left in the CPU's caches, which on some CPUs hold hundreds of MB)."""
    a, b = (torch.ones(megabytes * (1 << 20) // 4) for _ in range(2))
    rates = []
    for _ in range(reads):
        b.sum()
        rates.append(read_then(a, lambda: None)[0])
    return median(rates)


def run_speculative(*, model: str | None = "gpt2-124M", run: str | None = None, precision: str = "auto",
                    prompts: int = 4, new_tokens: int = 128, lines: int = 6, seed: int = 0) -> list[str]:
    """The table and its summary lines (returned, the last: every task's ratio)."""
    set_threads()
    watch, device = LoadWatch(), torch.device("cpu")
    from gptlab.inference.loading import bf16_storage_possible

    served = served_model(model, run, resolve_precision(precision, device, bf16_storage_possible(device)))
    prepared = served.model
    if not prepared.fused:
        raise GptlabError("speculation runs on the fused CPU decode step, which cannot run here (no g++?)")
    if new_tokens + 16 > prepared.config.block_size:
        raise GptlabError(f"--new-tokens {new_tokens} leaves no room for a prompt in the model's context of "
                          f"{prepared.config.block_size} tokens")
    text = bundled_source().open().read().decode("utf-8")
    texts = passages(text, prompts, lines, seed)
    weights = weight_bytes_per_token(prepared.model, prepared.precision or "fp32")
    print(f"gptlab bench speculative: {served.name} ({served.parameters / 1e6:.0f}M parameters, {prepared.precision}, "
          f"fused step), batch 1, {prompts} prompts a task of {lines}-line passages, {new_tokens} new tokens each")
    print(f"device: {device_name(device)}; {torch.get_num_threads()} threads")
    print(f"{'task':<8} {'off tok/s':>10} {'auto tok/s':>11} {'auto/off':>9} {'kept':>8} {'tok/step':>9} "
          f"{'floor tok/s':>12} {'auto/floor':>11}")
    lines_out = []
    for i, task in enumerate(TASKS):
        floor = memory_rate() / weights
        sides = run_task(prepared, served.tokenizer, task, texts, new_tokens, seed + 100 * min(i, 2))
        row, line = summary(task, sides["off"], sides["auto"], floor)
        print(row)
        lines_out.append(line)
    print(watch.stop().report())
    for line in lines_out:
        print(line)
    return lines_out
