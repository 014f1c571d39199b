"""int8's quality beside bf16's on a trained run, for `gptlab bench generate --quality RUN`: the validation
perplexity of each and how long their greedy continuations agree."""

from __future__ import annotations

import copy

import torch

from gptlab.bench.engines import agreeing_prefix
from gptlab.config import SampleConfig
from gptlab.data.batches import load_dataset
from gptlab.engine import generate_batch
from gptlab.errors import GptlabError
from gptlab.inference import prepare_for_inference
from gptlab.runtime import bf16_supported

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
    return quality_lines(run, base, perplexity, ids, new_tokens)


def quality_lines(run: str, base: str, perplexity: dict[str, float], ids: dict[str, list[list[int]]],
                  new_tokens: int) -> list[str]:
    """int8_quality's report: int8's perplexity beside `base`'s with its relative change, then for each pair of
    precisions how many prompts' greedy continuations (`ids[precision]`: one list of new ids per prompt) agree for
    all `new_tokens` tokens, and the shortest agreeing prefix."""
    change = perplexity["int8"] / perplexity[base] - 1
    lines = [f"int8 vs {base} on {run}: validation perplexity {perplexity['int8']:.3f} vs {perplexity[base]:.3f} "
             f"({change:+.2%})"]
    pairs = [(base, "int8")] + ([("fp32", "bf16"), ("fp32", "int8")] if base == "bf16" else [])
    pairs += [("fp32", TORCH_INT8)] if TORCH_INT8 in ids else []  # what weight-only int8 gives without the kernel
    for a, b in pairs:
        agree = [agreeing_prefix(x, y) for x, y in zip(ids[a], ids[b])]
        lines.append(f"{b} vs {a} greedy: {sum(n == new_tokens for n in agree)}/{len(agree)} validation prompts "
                     f"agree for all {new_tokens} new tokens (shortest agreement {min(agree)})")
    return lines
