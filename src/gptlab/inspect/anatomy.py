"""The architecture as the seed writes it: every component of a GPT with the shape it produces and its parameters,
read from the modules themselves (so a count can never disagree with the weights), and the total split into
embeddings, attention, MLP and LayerNorms."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptlab.config import ModelConfig
from gptlab.model import GPT, build_model, is_gpt

KINDS = ("embeddings", "attention", "MLP", "LayerNorms")


@dataclass
class Part:
    """One row: a component's name, the shape of what it computes (or holds), its parameters and their kind."""

    name: str
    shape: str
    params: int = 0
    kind: str = ""


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _block_parts(model: GPT) -> list[Part]:
    """The rows of one block (every block has the same shape), indented under it."""
    c = model.config
    block = model.transformer.h[0]
    C, H, D = c.n_embd, c.n_head, c.head_dim
    norm = "γ and β" if c.bias else "γ"  # LayerNorm's scale, and its shift where the model has biases
    return [
        Part("  ln_1", f"B×T×C, {norm} of C = {C}", _count(block.ln_1), "LayerNorms"),
        Part("  attn.c_attn (W_Q, W_K, W_V)", f"C → 3C = {C} → {3 * C}", _count(block.attn.c_attn), "attention"),
        Part("  q, k, v per head", f"B×H×T×d_k, heads × d_k = {H} × {D}"),
        Part("  softmax(QKᵀ/√d_k + mask)", "B×H×T×T, −∞ above the diagonal"),
        Part("  attn.c_proj (W_O)", f"C → C = {C} → {C}", _count(block.attn.c_proj), "attention"),
        Part("  + residual", "B×T×C"),
        Part("  ln_2", f"B×T×C, {norm} of C = {C}", _count(block.ln_2), "LayerNorms"),
        Part("  mlp.c_fc + GELU", f"C → 4C = {C} → {4 * C}", _count(block.mlp.c_fc), "MLP"),
        Part("  mlp.c_proj", f"4C → C = {4 * C} → {C}", _count(block.mlp.c_proj), "MLP"),
        Part("  + residual", "B×T×C"),
    ]


def anatomy(model: torch.nn.Module) -> list[Part]:
    """The rows describing `model` (a GPT or the bigram table), top to bottom, each with its parameter count;
    repeated blocks are listed once with "× n_layer" and their counts multiplied by n_layer."""
    c = model.config
    if not is_gpt(model):
        return [Part("input ids", "B×T"),
                Part("logits_table", f"V×V = {c.vocab_size}×{c.vocab_size}", _count(model), "embeddings"),
                Part("logits", "B×T×V")]
    per_block = _block_parts(model)
    parts = [Part("input ids", "B×T"),
             Part("wte (token embedding)", f"V×C = {c.vocab_size}×{c.n_embd}", _count(model.transformer.wte),
                  "embeddings"),
             Part("wpe (position embedding)", f"block_size×C = {c.block_size}×{c.n_embd}",
                  _count(model.transformer.wpe), "embeddings"),
             Part("x = wte[ids] + wpe[0..T)", "B×T×C"),
             Part(f"h.0 … h.{c.n_layer - 1}: {c.n_layer} blocks, each", "B×T×C → B×T×C",
                  sum(p.params for p in per_block))]
    parts += per_block
    norm = "γ and β" if c.bias else "γ"
    parts += [Part("ln_f", f"B×T×C, {norm} of C = {c.n_embd}", _count(model.transformer.ln_f), "LayerNorms"),
              Part("lm_head (tied to wte: no parameters of its own)", f"C → V = {c.n_embd} → {c.vocab_size}"),
              Part("logits", "B×T×V")]
    return parts


def totals(model: torch.nn.Module) -> dict[str, int]:
    """Parameters by kind (embeddings, attention, MLP, LayerNorms) and "total"; the tied LM head counted once."""
    n_layer = model.config.n_layer  # per-block rows (indented) exist only in a GPT's anatomy
    out = dict.fromkeys(KINDS, 0)
    for part in anatomy(model):
        if part.kind:
            out[part.kind] += part.params * (n_layer if part.name.startswith("  ") else 1)
    out["total"] = sum(out.values())
    assert out["total"] == model.num_params(), (out, model.num_params())
    return out


def anatomy_table(model: torch.nn.Module) -> str:
    """The anatomy as a text table, then the totals by kind with their shares."""
    c = model.config
    rows = [("component", "shape", "parameters")]
    for part in anatomy(model):
        rows.append((part.name, part.shape, f"{part.params:,}" if part.params else ""))
    w0, w1 = (max(len(r[i]) for r in rows) for i in range(2))
    w2 = max(len(r[2]) for r in rows)
    lines = [f"{a:<{w0}}  {b:<{w1}}  {p:>{w2}}" for a, b, p in rows]
    lines.insert(1, "-" * len(lines[0]))
    sums = totals(model)
    lines.append("-" * len(lines[0]))
    if is_gpt(model):
        lines.append(f"B batch, T ≤ block_size {c.block_size}, C = n_embd {c.n_embd}, H = n_head {c.n_head}, "
                     f"d_k = C/H = {c.head_dim}, V = vocab {c.vocab_size}, {c.n_layer} blocks")
    for kind in KINDS:
        if sums[kind]:
            lines.append(f"{kind:<11} {sums[kind]:>14,}  ({100 * sums[kind] / sums['total']:.1f}%)")
    lines.append(f"{'total':<11} {sums['total']:>14,}")
    return "\n".join(lines)


def model_for(config: ModelConfig) -> torch.nn.Module:
    """A model of this shape on the meta device: every parameter's shape, no memory, no initialisation time."""
    with torch.device("meta"):
        return build_model(config)
