"""A gptlab GPT's weights handed to the naive C++ engine, and its logits, loss and gradients handed back.

`step` runs the engine on a GPT's own parameters (fp32 or fp64, on the CPU): the logits, the loss and, asked for,
the gradient of the loss in every parameter, computed by the hand-written backward (no autograd). `NaiveGPT` is a
GPT whose forward is the engine's: its state dict, checkpoints and run folders are a GPT's, and `loss.backward()`
puts the engine's gradients into `.grad` (a loss computed by the engine is a torch tensor whose backward hands the
engine's gradients on, scaled by the incoming gradient, so gradient accumulation works as the torch path's does).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from gptlab.model import GPT, KVCache
from gptlab.reference import library

DTYPES = {torch.float32: "f32", torch.float64: "f64"}


def layer_names(i: int) -> dict[str, str]:
    """Layer struct field -> the GPT parameter it holds, for block i."""
    h = f"transformer.h.{i}."
    return {"ln_1_w": h + "ln_1.weight", "ln_1_b": h + "ln_1.bias", "c_attn_w": h + "attn.c_attn.weight",
            "c_attn_b": h + "attn.c_attn.bias", "attn_proj_w": h + "attn.c_proj.weight",
            "attn_proj_b": h + "attn.c_proj.bias", "ln_2_w": h + "ln_2.weight", "ln_2_b": h + "ln_2.bias",
            "c_fc_w": h + "mlp.c_fc.weight", "c_fc_b": h + "mlp.c_fc.bias", "mlp_proj_w": h + "mlp.c_proj.weight",
            "mlp_proj_b": h + "mlp.c_proj.bias"}


TOP_NAMES = {"wte": "transformer.wte.weight", "wpe": "transformer.wpe.weight", "ln_f_w": "transformer.ln_f.weight",
             "ln_f_b": "transformer.ln_f.bias"}


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def model_struct(model: GPT, tensors: dict[str, torch.Tensor]) -> tuple[library.Model, ctypes.Array]:
    """A Model struct over `tensors` (parameter name -> tensor: the weights, or gradients of the same shapes); a
    name missing from `tensors` (a bias the model has not) is NULL. Returns the struct and its layers' array, which
    must stay alive while the struct is used."""
    c = model.config
    layers = (library.Layer * c.n_layer)(*[
        library.Layer(**{field: _ptr(tensors.get(name)) for field, name in layer_names(i).items()})
        for i in range(c.n_layer)])
    struct = library.Model(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, vocab_size=c.vocab_size,
                          block_size=c.block_size, gelu_tanh=int(c.activation == "gelu_tanh"),
                          eps=c.layer_norm_eps, layers=layers,
                          **{field: _ptr(tensors.get(name)) for field, name in TOP_NAMES.items()})
    return struct, layers


@dataclass
class DropoutMasks:
    """The multipliers (0 or 1 / (1 - p)) of every dropout of one forward, drawn by the caller: after the
    embeddings (B, T, C); per block on the attention probabilities (B, H, T, T) and on the attention's and the
    MLP's outputs (B, T, C). A None is no dropout there."""

    emb: torch.Tensor | None
    attn: list[torch.Tensor | None]
    attn_resid: list[torch.Tensor | None]
    mlp_resid: list[torch.Tensor | None]

    @classmethod
    def draw(cls, model: GPT, B: int, T: int, p: float, dtype: torch.dtype) -> DropoutMasks:
        """Masks with each element kept with probability 1 - p (torch's generator draws them)."""
        c = model.config

        def mask(*shape: int) -> torch.Tensor:
            return (torch.rand(shape) >= p).to(dtype) / (1 - p)
        return cls(mask(B, T, c.n_embd), [mask(B, c.n_head, T, T) for _ in range(c.n_layer)],
                   [mask(B, T, c.n_embd) for _ in range(c.n_layer)], [mask(B, T, c.n_embd) for _ in range(c.n_layer)])


def _contiguous(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.detach().to(dtype).contiguous()


def step(model: GPT, idx: torch.Tensor, targets: torch.Tensor | None = None, masks: DropoutMasks | None = None,
         grads: bool = False, lib: ctypes.CDLL | None = None,
         ) -> tuple[torch.Tensor, float | None, dict[str, torch.Tensor] | None]:
    """The engine (`lib`: the naive one unless given, e.g. a rung of the fast one, reference.fast) on `model`'s
    parameters: logits (B, T, V), the mean cross-entropy against `targets` (-1 ignored; None without targets) and,
    with `grads`, the gradient of that loss in every parameter (name -> tensor; the tied LM head's is wte's).
    Parameters must be fp32 or fp64 (fp32 alone for the fast engine) on the CPU, all one dtype."""
    params = dict(model.named_parameters())
    dtype = params[TOP_NAMES["wte"]].dtype
    if dtype not in DTYPES or any(p.dtype != dtype or p.device.type != "cpu" for p in params.values()):
        raise ValueError("the reference engine takes fp32 or fp64 parameters on the CPU, all one dtype")
    if grads and targets is None:
        raise ValueError("gradients need targets")
    lib, suffix = lib or library.load_library(), DTYPES[dtype]
    if not hasattr(lib, f"gptlab_step_{suffix}"):
        raise ValueError(f"this engine computes in fp32 alone, not {dtype}")
    weights = {name: p.detach().contiguous() for name, p in params.items()}
    B, T = idx.shape
    idx = idx.to(torch.int64).contiguous()
    tgt = None if targets is None else targets.to(torch.int64).contiguous()
    logits = torch.empty(B, T, model.config.vocab_size, dtype=dtype)
    keep = [weights, idx, tgt, logits]
    struct, layers = model_struct(model, weights)
    grad_tensors = {name: torch.zeros_like(p) for name, p in weights.items()} if grads else None
    grad_struct = model_struct(model, grad_tensors) if grads else None
    batch = library.Batch(B=B, T=T, idx=idx.data_ptr(), targets=_ptr(tgt), logits=logits.data_ptr())
    if masks is not None:
        keep.append(masks := _as(masks, dtype))
        batch.emb_mask = _ptr(masks.emb)
        mask_structs = (library.Masks * model.config.n_layer)(*[
            library.Masks(_ptr(a), _ptr(r), _ptr(m)) for a, r, m in zip(masks.attn, masks.attn_resid, masks.mlp_resid)])
        batch.masks = mask_structs
    fn = getattr(lib, f"gptlab_step_{suffix}")
    rc = fn(ctypes.byref(struct), ctypes.byref(grad_struct[0]) if grad_struct else None, ctypes.byref(batch))
    del layers, keep
    if rc == 1:
        raise ValueError(f"the reference engine cannot take a batch of {B} x {T} with block size "
                         f"{model.config.block_size}")
    if rc == 2:
        raise ValueError(f"a token id outside the vocabulary of {model.config.vocab_size}")
    if rc == 3:
        raise ValueError(f"a target that is neither -1 (ignored) nor a token id of the vocabulary of "
                         f"{model.config.vocab_size}")
    return logits, (batch.loss if targets is not None else None), grad_tensors


def _as(masks: DropoutMasks, dtype: torch.dtype) -> DropoutMasks:
    return DropoutMasks(_contiguous(masks.emb, dtype), [_contiguous(m, dtype) for m in masks.attn],
                        [_contiguous(m, dtype) for m in masks.attn_resid],
                        [_contiguous(m, dtype) for m in masks.mlp_resid])


class _EngineLoss(torch.autograd.Function):
    """The engine's loss as a torch scalar: forward runs the engine (gradients included), backward hands them on
    scaled by the incoming gradient. The logits come out too, outside autograd."""

    @staticmethod
    def forward(ctx, model: GPT, idx: torch.Tensor, targets: torch.Tensor, masks: DropoutMasks | None,
                *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, loss, grads = step(model, idx, targets, masks, grads=True, lib=model.engine_library())
        ctx.grads = [grads[name] for name, _ in model.named_parameters()]
        ctx.mark_non_differentiable(logits)
        return torch.tensor(loss, dtype=params[0].dtype), logits

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_logits: torch.Tensor) -> tuple:
        grads, ctx.grads = ctx.grads, None  # handed on, not kept: autograd may take them as .grad without a copy
        if bool(grad_loss == 1):  # loss.backward() itself: the engine's gradients as they are
            return (None, None, None, None, *grads)
        return (None, None, None, None, *[g * grad_loss for g in grads])


class NaiveGPT(GPT):
    """A GPT computed by the naive engine: the same parameters and state dict, so its checkpoints are ordinary
    gptlab checkpoints. In training mode with dropout, each forward draws its masks with torch's generator and hands
    them to the engine.

    It keeps no keys or values: its "cache" (`new_kv_cache`) holds the token ids each row has seen (in the k tensor
    of a one-layer, one-head, one-channel KVCache, as fp32, exact for any vocabulary below 2**24), so the engine's
    prompts, samples, windows and continuous batching move them between rows as they move keys and values, and
    every forward over it recomputes each row's whole window from its tokens."""

    def engine_library(self) -> ctypes.CDLL:
        """The library that computes this model: the naive engine's (a fast rung's in reference.fast.FastGPT)."""
        return library.load_library()

    def new_kv_cache(self, batch_size: int, dtype: torch.dtype | None = None, max_len: int | None = None) -> KVCache:
        """A cache of token ids for `batch_size` rows of up to `max_len` positions (block_size); `dtype` is
        ignored: ids are kept in fp32."""
        return KVCache(1, batch_size, 1, max_len or self.config.block_size, 1, "cpu", torch.float32)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                last_only: bool = False, head: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if kv_cache is not None:
            return self._over_cache(idx, kv_cache, last_only, head), None
        B, T = idx.shape
        dtype = self.transformer.wte.weight.dtype
        masks = self.draw_masks(B, T)
        params = [param for _, param in self.named_parameters()]
        if targets is not None and torch.is_grad_enabled() and any(q.requires_grad for q in params):
            loss, logits = _EngineLoss.apply(self, idx, targets, masks, *params)
        else:
            logits, loss_value, _ = step(self, idx, targets, masks, lib=self.engine_library())
            loss = None if targets is None else torch.tensor(loss_value, dtype=dtype)
        return (logits[:, -1:] if last_only else logits), loss

    def draw_masks(self, B: int, T: int) -> DropoutMasks | None:
        """This forward's dropout masks: drawn by torch's generator in training mode with dropout, else None."""
        p = self.config.dropout
        if not (self.training and p > 0):
            return None
        return DropoutMasks.draw(self, B, T, p, self.transformer.wte.weight.dtype)

    def _over_cache(self, idx: torch.Tensor, cache: KVCache, last_only: bool, head: bool) -> torch.Tensor | None:
        """idx (B, T) continues each row at cache.pos: its ids are stored, and each row's logits for them come
        from the engine run over all of that row's ids (rows of one length in one call; none without the `head`:
        the ids only stored); pos advances by T."""
        if cache.k.shape[0] != 1 or cache.k.shape[2:] != (1, cache.max_len, 1):
            raise ValueError("the reference engine keeps token ids, not keys and values: use its own new_kv_cache")
        B, T = idx.shape
        ends = (cache.pos + T).tolist()
        if max(ends) > min(cache.max_len, self.config.block_size):
            raise ValueError("position beyond block_size: slide the window")
        for b, end in enumerate(ends):
            cache.k[0, b, 0, end - T:end, 0] = idx[b].float()
        if not head:
            cache.pos += T
            return None
        logits = torch.empty(B, T, self.config.vocab_size, dtype=self.transformer.wte.weight.dtype)
        for end in sorted(set(ends)):
            rows = torch.tensor([b for b, e in enumerate(ends) if e == end])
            ids = cache.k[0, rows, 0, :end, 0].long()
            logits[rows] = step(self, ids, lib=self.engine_library())[0][:, end - T:]
        cache.pos += T
        return logits[:, -1:] if last_only else logits
