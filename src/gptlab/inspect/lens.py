"""A run's GPT as TransformerLens's `HookedTransformer`, for the rest of its toolkit, built offline.

TransformerLens 3.9 is the last release with `HookedTransformer` (4.0 replaced it with `TransformerBridge`, which
wraps a Hugging Face model: `gptlab export --format hf` gives it one). The weights are not processed: no LayerNorm
folding, no centering, so every hook holds what gptlab's own hook points hold.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from gptlab.errors import GptlabError
from gptlab.model import GPT, is_gpt

LENS_HINT = "pip install 'transformer-lens==3.9.0' (or gptlab's extra: pip install -e '.[lens]')"


def lens_config(model: GPT) -> dict[str, Any]:
    """HookedTransformerConfig's arguments for this GPT (no BOS prepended: gptlab's ids are the text's)."""
    c = model.config
    return dict(n_layers=c.n_layer, d_model=c.n_embd, n_ctx=c.block_size, d_head=c.head_dim, n_heads=c.n_head,
                d_vocab=c.vocab_size, d_mlp=4 * c.n_embd, act_fn="gelu_new" if c.activation == "gelu_tanh" else "gelu",
                normalization_type="LN", eps=c.layer_norm_eps, positional_embedding_type="standard",
                default_prepend_bos=False, dtype=model.transformer.wte.weight.dtype)


def lens_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The GPT's weights under TransformerLens's names and layouts: W_Q/W_K/W_V (H, C, D), W_O (H, D, C), W_in
    (C, 4C), W_out (4C, C), W_U (C, V); zero biases where the model has none."""
    c, t = model.config, model.transformer
    H, D, C = c.n_head, c.head_dim, c.n_embd
    out = {"embed.W_E": t.wte.weight, "pos_embed.W_pos": t.wpe.weight, "unembed.W_U": model.lm_head.weight.T,
           "unembed.b_U": torch.zeros(c.vocab_size, dtype=t.wte.weight.dtype)}

    def bias(linear: torch.nn.Module, n: int) -> torch.Tensor:
        return linear.bias if linear.bias is not None else torch.zeros(n, dtype=linear.weight.dtype)
    for name, ln in [("ln_final", t.ln_f), *((f"blocks.{i}.ln{j}", getattr(b, f"ln_{j}"))
                                             for i, b in enumerate(t.h) for j in (1, 2))]:
        out[f"{name}.w"], out[f"{name}.b"] = ln.weight, bias(ln, C)
    for i, block in enumerate(t.h):
        p, attn, mlp = f"blocks.{i}.", block.attn, block.mlp
        for which, w, b in zip("QKV", attn.c_attn.weight.split(C), bias(attn.c_attn, 3 * C).split(C)):
            out[f"{p}attn.W_{which}"] = w.T.reshape(C, H, D).permute(1, 0, 2)  # (out, in) -> (H, C, D)
            out[f"{p}attn.b_{which}"] = b.reshape(H, D)
        out[f"{p}attn.W_O"] = attn.c_proj.weight.T.reshape(H, D, C)
        out[f"{p}attn.b_O"] = bias(attn.c_proj, C)
        out[f"{p}mlp.W_in"], out[f"{p}mlp.b_in"] = mlp.c_fc.weight.T, bias(mlp.c_fc, 4 * C)
        out[f"{p}mlp.W_out"], out[f"{p}mlp.b_out"] = mlp.c_proj.weight.T, bias(mlp.c_proj, C)
    return {k: v.detach().clone() for k, v in out.items()}


def hooked_transformer(model: GPT) -> Any:
    """A TransformerLens `HookedTransformer` holding a copy of this GPT's weights, unprocessed."""
    if not is_gpt(model):
        raise GptlabError("TransformerLens needs a GPT: this run is a bigram table")
    try:
        from transformer_lens import HookedTransformer, HookedTransformerConfig
    except ImportError:
        raise GptlabError(f"TransformerLens is not installed: {LENS_HINT}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "removed in 4.0": 3.9 is the version pinned
        lens = HookedTransformer(HookedTransformerConfig(**lens_config(model)), move_to_device=False)
    lens.load_and_process_state_dict(lens_state_dict(model), fold_ln=False, center_writing_weights=False,
                                     center_unembed=False, fold_value_biases=False,
                                     refactor_factored_attn_matrices=False)
    return lens.eval()
