"""int8's quality beside bf16's on a trained run, for `gptlab bench generate --quality RUN`: the validation
perplexity of each, the KL divergence of each one's next-token distributions from fp32's (the measure llama.cpp
publishes for its quantizations), and how long their greedy continuations agree."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from gptlab.bench.engines import agreeing_prefix
from gptlab.config import SampleConfig
from gptlab.data.batches import load_dataset
from gptlab.engine import generate_batch
from gptlab.errors import GptlabError
from gptlab.inference.loading import bf16_storage_possible, prepare_for_inference
from gptlab.runtime import bf16_supported

TORCH_INT8 = "int8 (torch step)"


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats for each row: p = softmax(reference_logits), q = softmax(logits), over the last dimension,
    computed in float64."""
    log_p = F.log_softmax(reference_logits.double(), dim=-1)
    log_q = F.log_softmax(logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@torch.no_grad()
def total_kl(reference: torch.nn.Module, model: torch.nn.Module, tokens, batch_size: int = 16) -> tuple[float, int]:
    """The sum over every predicted position of `tokens` of KL(reference's next-token distribution || model's), and
    how many positions: the text cut into windows of block_size tokens (as gptlab.evaluate.total_nats cuts it, each
    position predicted once from up to block_size tokens of context), both models over the same windows."""
    T = reference.config.block_size
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[:-1]  # the last token predicts nothing scored
    windows = [ids[s:s + T] for s in range(0, len(ids), T)]
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        for group in _same_length(windows[i:i + batch_size]):
            x = torch.stack(group)
            kl = kl_divergence(reference(x)[0].float(), model(x)[0].float())
            total += kl.sum().item()
            count += kl.numel()
    return total, count


def _same_length(rows: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """rows grouped by length (only the text's last window is shorter), in order."""
    groups: dict[int, list[torch.Tensor]] = {}
    for r in rows:
        groups.setdefault(len(r), []).append(r)
    return list(groups.values())


def int8_quality(run: str, prompts: int = 8, prompt_tokens: int = 16, new_tokens: int = 32) -> list[str]:
    """int8 beside bf16 (fp32 where the CPU neither computes bf16 nor builds the native step that stores it) on a
    trained run: the validation perplexity of each (the weights each decodes with), and greedy continuations of
    `prompts` windows of the validation split, how many agree for all `new_tokens` tokens and the shortest agreeing
    prefix; where the base is bf16, fp32 beside both too, the yardstick of what bf16's own rounding changes; where
    int8 decodes natively, the torch int8 path's text beside fp32's too, what the int8 weights alone change. Returns
    the lines."""
    import math

    from gptlab.checkpoint import load_run
    from gptlab.evaluate import total_nats
    from gptlab.runs import run_data_dir

    loaded = load_run(run)
    data_dir = run_data_dir(run)
    if data_dir is None:
        raise GptlabError(f"run {run} has no data of its own to score int8 on (it was imported)")
    val = load_dataset(data_dir).val
    cpu = torch.device("cpu")
    base = "bf16" if bf16_supported(cpu) or bf16_storage_possible(cpu) else "fp32"  # bf16 as sample would decode it
    precisions = ["fp32", "bf16", "int8"] if base == "bf16" else ["fp32", "int8"]
    step = max(1, (len(val) - prompt_tokens) // prompts)
    windows = [val[i * step:i * step + prompt_tokens].tolist() for i in range(prompts)]
    perplexity, ids, kl = {}, {}, {}
    cfg = SampleConfig(max_new_tokens=new_tokens, temperature=0)
    reference = None
    for precision in precisions:
        model = prepare_for_inference(copy.deepcopy(loaded.model), precision)
        nats, count = total_nats(model.model, val)
        perplexity[precision] = math.exp(nats / max(count, 1))
        if precision == "fp32":
            reference = model.model
        else:  # the same forward as the perplexity's, beside fp32's, over the same windows
            total, positions = total_kl(reference, model.model, val)
            kl[precision] = (total / max(positions, 1), positions)
        ids[precision] = [list(row) for row in zip(*generate_batch(model, windows, cfg))]
        if precision == "int8" and model.fused:  # the torch path's steps (fp32 x over the same int8 weights)
            torch_step = prepare_for_inference(copy.deepcopy(loaded.model), "int8", fused=False)
            ids[TORCH_INT8] = [list(row) for row in zip(*generate_batch(torch_step, windows, cfg))]
    return quality_lines(run, base, perplexity, ids, new_tokens, kl)


def quality_lines(run: str, base: str, perplexity: dict[str, float], ids: dict[str, list[list[int]]],
                  new_tokens: int, kl: dict[str, tuple[float, int]] | None = None) -> list[str]:
    """int8_quality's report: int8's perplexity beside `base`'s with its relative change; each precision's mean KL
    divergence from fp32 (`kl[precision]`: nats per position and the positions) with its perplexity's change over
    fp32's; then for each pair of precisions how many prompts' greedy continuations (`ids[precision]`: one list of
    new ids per prompt) agree for all `new_tokens` tokens, and the shortest agreeing prefix."""
    change = perplexity["int8"] / perplexity[base] - 1
    lines = [f"int8 vs {base} on {run}: validation perplexity {perplexity['int8']:.3f} vs {perplexity[base]:.3f} "
             f"({change:+.2%})"]
    for precision, (mean, positions) in (kl or {}).items():
        lines.append(f"{precision} vs fp32: perplexity {perplexity[precision] / perplexity['fp32'] - 1:+.3%}, "
                     f"next-token KL divergence {mean:.3g} nats (mean of {positions:,} validation positions)")
    pairs = [(base, "int8")] + ([("fp32", "bf16"), ("fp32", "int8")] if base == "bf16" else [])
    pairs += [("fp32", TORCH_INT8)] if TORCH_INT8 in ids else []  # what weight-only int8 gives without the kernel
    for a, b in pairs:
        agree = [agreeing_prefix(x, y) for x, y in zip(ids[a], ids[b])]
        lines.append(f"{b} vs {a} greedy: {sum(n == new_tokens for n in agree)}/{len(agree)} validation prompts "
                     f"agree for all {new_tokens} new tokens (shortest agreement {min(agree)})")
    return lines
