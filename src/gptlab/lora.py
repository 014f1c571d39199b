"""LoRA: low-rank adapters on the GPT's Linear layers, applied from outside the model (as parallelism is).

An adapted layer computes W x + b + (alpha / r) B A dropout(x), with W and b frozen, A (r x in) drawn as PEFT draws
it and B (out x r) zero, so that training starts from the base model exactly. The adapted layer keeps the Linear's
own names (weight, bias) and adds lora_A.weight and lora_B.weight beside them, the names PEFT gives them on
transformers' GPT-2 (minus its base_layer), so checkpoints and exports map one to one. A model with adapters saves
and loads its adapters alone: its base is stored once, in the run it came from, and named by its path and the
sha256 of its weights (tensors_sha256).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab.config import LORA_TARGETS as TARGETS  # a name matches a module named so or ending in "." + it
from gptlab.config import ModelConfig, TrainConfig
from gptlab.errors import GptlabError
from gptlab.model import build_model, is_gpt
from gptlab.ops import Dropout

if TYPE_CHECKING:
    from gptlab.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def __str__(self) -> str:
        return f"rank {self.rank}, alpha {self.alpha:g}, dropout {self.dropout:g} on {','.join(self.targets)}"


_DEFAULTS = {f.name: f.default for f in fields(TrainConfig) if f.name.startswith("lora_")}


def settings(train: TrainConfig | dict[str, Any] | None) -> LoraSettings | None:
    """The LoRA settings of a TrainConfig or its JSON (a run's or a checkpoint's), None without adapters."""
    if not train:
        return None
    given = train if isinstance(train, dict) else vars(train)
    get = {**_DEFAULTS, **{k: v for k, v in given.items() if k in _DEFAULTS}}.get  # unset: TrainConfig's defaults
    if not get("lora_rank"):
        return None
    targets = tuple(t.strip() for t in str(get("lora_targets")).split(",") if t.strip())
    return LoraSettings(int(get("lora_rank")), float(get("lora_alpha")), float(get("lora_dropout")), targets)


TOKEN_IDS = "transformer.wte.token_ids"  # a checkpoint's ids of the tokens whose rows train whole


def is_adapter(name: str) -> bool:
    """Whether the tensor called `name` is an adapter's (lora_A or lora_B of an adapted layer, or the rows and ids
    of the tokens a fine-tune added)."""
    return ".lora_A." in name or ".lora_B." in name or name.endswith((".token_values", ".token_ids"))


class LoRALinear(nn.Linear):
    """A frozen Linear plus its low-rank update: y = x W^T + b + scaling * dropout(x) A^T B^T."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate a second weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        kind = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kind)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kind)
        self.lora_dropout = Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init: A random, B zero
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def merged(self) -> nn.Linear:
        """A plain Linear whose weight is W + scaling * B A (computed in fp32), the bias shared."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            delta = self.lora_B.weight.float() @ self.lora_A.weight.float()  # (out, in)
            out.weight.copy_(self.weight.float() + self.scaling * delta)
            if self.bias is not None:
                out.bias = self.bias
        return out


class TrainableTokens(nn.Embedding):
    """The token embedding of a LoRA fine-tune that added tokens (the chat markers): their rows are its own trained
    `token_values`, every other row the frozen base's `weight` (PEFT's trainable tokens)."""

    def __init__(self, base: nn.Embedding, ids: list[int]):
        nn.Module.__init__(self)  # nn.Embedding's own __init__ would allocate a second weight
        self.num_embeddings, self.embedding_dim, self.weight = base.num_embeddings, base.embedding_dim, base.weight
        self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, None, 2.0, \
            False, False
        index = torch.tensor(ids, dtype=torch.long, device=base.weight.device)
        self.register_buffer("token_ids", index)
        slot = torch.full((base.num_embeddings,), -1, dtype=torch.long, device=base.weight.device)
        self.register_buffer("slot", slot.index_copy(0, index, torch.arange(len(ids), device=index.device)),
                             persistent=False)  # id -> its row of token_values, -1 for the base's ids
        self.token_values = nn.Parameter(base.weight.detach()[index].clone())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        slot = self.slot[idx]
        own = F.embedding(slot.clamp(min=0), self.token_values)
        return torch.where((slot >= 0).unsqueeze(-1), own, F.embedding(idx, self.weight))

    def merged_weight(self) -> torch.Tensor:
        return self.weight.detach().index_copy(0, self.token_ids, self.token_values.detach())


class TrainableTokensHead(nn.Linear):
    """The LM head tied to a TrainableTokens embedding: the added tokens' logits from their trained rows."""

    def __init__(self, head: nn.Linear, embedding: TrainableTokens):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.weight = head.in_features, head.out_features, head.weight
        self.register_parameter("bias", None)
        self.embedding = (embedding,)  # in a tuple: not a submodule, so its tensors are named once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embedding[0]
        logits = F.linear(x, self.weight)
        logits[..., tokens.token_ids] = F.linear(x, tokens.token_values)  # the same dtype: both rows of wte's
        return logits

    def tied_weight(self) -> torch.Tensor:
        """The whole (V, C) weight this head multiplies by: the base's rows, the added tokens' trained ones in their
        place (for a loss computed in chunks; gradients reach token_values)."""
        tokens = self.embedding[0]
        return self.weight.index_copy(0, tokens.token_ids, tokens.token_values.to(self.weight.dtype))


def train_tokens(model: nn.Module, ids: list[int]) -> None:
    """Give the tokens `ids` trainable rows of their own in `model`'s embedding and tied LM head (in place)."""
    wte = TrainableTokens(model.transformer.wte, ids)
    model.transformer.wte = wte
    model.lm_head = TrainableTokensHead(model.lm_head, wte)


def added_tokens(tokenizer: Tokenizer | None, base_run: str | Path) -> list[int]:
    """The ids a LoRA fine-tune of `base_run` on data tokenized by `tokenizer` trains whole rows for: the chat
    markers, when the base run's tokenizer lacks them."""
    from gptlab.tokenizer import ChatTokenizer, load as load_tokenizer

    if not isinstance(tokenizer, ChatTokenizer) or isinstance(load_tokenizer(Path(base_run) / "tokenizer.json"),
                                                             ChatTokenizer):
        return []
    return sorted(tokenizer.special_ids.values())


def _targets_of(model: nn.Module, lora: LoraSettings) -> dict[str, nn.Linear]:
    """The Linear layers of the model's blocks that `lora` targets; GptlabError for a target that names none."""
    if not is_gpt(model):
        raise GptlabError("LoRA adapts a GPT's layers; this model (a bigram) has none: fine-tune it in full")
    found: dict[str, nn.Linear] = {}
    for target in lora.targets:
        if target not in TARGETS:
            raise GptlabError(f"--lora-targets: unknown layer {target!r}; choose among {', '.join(TARGETS)} "
                              "(comma-separated)")
        for name, module in model.named_modules():
            if name.startswith("transformer.h.") and (name == target or name.endswith("." + target)) \
                    and isinstance(module, nn.Linear):
                found[name] = module
    return found


def apply_lora(model: nn.Module, lora: LoraSettings, tokens: list[int] | None = None) -> list[str]:
    """Freeze every parameter of `model` and put a fresh adapter on each targeted layer (in place, drawing A from
    torch's default generator), and trainable rows for the added `tokens`; returns the adapted layers' names.
    GptlabError when a target or the rank does not fit the model."""
    if lora.rank < 1:
        raise GptlabError(f"--lora-rank must be at least 1, not {lora.rank}")
    layers = _targets_of(model, lora)
    narrowest = min(min(m.in_features, m.out_features) for m in layers.values())
    if lora.rank > narrowest:
        raise GptlabError(f"--lora-rank {lora.rank} is more than the narrowest adapted layer's width "
                          f"({narrowest}); choose a rank of at most {narrowest}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, LoRALinear(layer, lora.rank, lora.alpha, lora.dropout))
    if tokens:
        train_tokens(model, tokens)
    return sorted(layers)


def store_frozen_matrices(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen matrices of a LoRA model's blocks in `dtype` (in place), for training under autocast to that
    dtype, which rounds them so before every product anyway: the same results from half the bytes, and no rounded
    copy kept for backward. Embeddings (the tied head), LayerNorms and biases stay as they are, so the residual
    stream keeps its precision. Returns the bytes saved (negative when `dtype` is wider: fp32 restores them
    exactly)."""
    saved = 0
    for name, module in list(model.named_modules()):
        weight = getattr(module, "weight", None)
        if name.startswith("transformer.h.") and isinstance(module, nn.Linear) and not weight.requires_grad:
            module.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
            saved += weight.nbytes - module.weight.nbytes
    return saved


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace each adapted layer of `model` (in place) by a plain Linear with its update merged into the weight,
    so that inference runs the model's own paths (fused, int8) unchanged; returns the model."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.merged())
    if isinstance(model.transformer.wte, TrainableTokens):
        wte = nn.Embedding(model.transformer.wte.num_embeddings, model.transformer.wte.embedding_dim,
                           _weight=model.transformer.wte.merged_weight())
        model.transformer.wte = wte
        model.lm_head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        model.lm_head.weight = wte.weight
    return model


def adapter_count(model: nn.Module) -> int:
    """The number of adapter parameters in `model`."""
    return sum(p.numel() for name, p in model.named_parameters() if is_adapter(name))


def count_parameters(model_cfg: ModelConfig, lora: LoraSettings | None, tokens: int = 0) -> tuple[int, int]:
    """(the parameters of a model of `model_cfg`, those `lora`'s adapters would add to it, with whole rows for
    `tokens` added tokens, as adapter_count counts them), counted on a model built on the meta device (nothing
    allocated)."""
    with torch.device("meta"):
        model = build_model(model_cfg)
        params = model.num_params()
        if lora is not None:
            apply_lora(model, lora, list(range(model_cfg.vocab_size - tokens, model_cfg.vocab_size)))
    return params, adapter_count(model)


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """A fingerprint of a model's weights: sha256 over each tensor's name, dtype, shape and bytes, in name order
    (the same weights give the same hash whatever file holds them)."""
    sha = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        sha.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        sha.update(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own memory, not a copy
    return sha.hexdigest()


def adapt(model: nn.Module, cfg: TrainConfig, init: dict[str, torch.Tensor] | None,
          resumed: tuple[dict[str, Any] | None, dict[str, str] | None] | None, tokenizer: Tokenizer | None,
          precision: str) -> dict[str, str] | None:
    """Training's start: with cfg.lora_rank (a TrainConfig), put fresh adapters on `model` (built from `init`, its
    base), with trainable rows for the tokens the data's `tokenizer` adds to the base's (added_tokens), the frozen
    matrices in bf16 when training in `precision` bf16 (store_frozen_matrices), and return the base's reference
    for the run's checkpoints ({"run", "sha256"}); a resume (`resumed`: the checkpoint's training settings and its
    base) must find the same adapters on the same base."""
    saved, saved_base = resumed or (None, None)
    adapters, before = settings(cfg), settings(saved)
    if adapters != before and saved is not None:
        raise GptlabError(f"this run's LoRA adapters are {before or 'none'}; a resume keeps them (drop the --lora-* "
                          "settings, or fine-tune into a new --run)")
    if adapters is None:
        return None
    assert init is not None, "train() checks that a LoRA run has its base's weights"
    apply_lora(model, adapters, added_tokens(tokenizer, cfg.init_from))
    base = {"run": str(Path(cfg.init_from).resolve()), "sha256": tensors_sha256(init)}
    if saved is not None and saved_base != base:
        raise GptlabError(f"the base of this LoRA run, {cfg.init_from}, is not the one its adapters were trained on "
                          f"({(saved_base or {}).get('run')}: moved, or its weights changed); restore it or fine-tune "
                          "again into a new --run")
    if precision == "bf16":
        store_frozen_matrices(model, torch.bfloat16)  # autocast rounds them to bf16 for every product anyway
    return base
