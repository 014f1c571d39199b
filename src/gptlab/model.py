"""The models: a bigram baseline and the GPT-2 decoder, with the KV cache they use at inference.

Module names follow GPT-2's checkpoints (transformer.wte, transformer.h.N.attn.c_attn, lm_head, ...), so real
GPT-2 weights map one to one. Letters follow the math: B batch, T time (sequence), C channels (n_embd),
H heads, D head_dim = C / H, V vocabulary. Its dropout and the chunked training loss are ops.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, TypeGuard

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from gptlab.config import ModelConfig
from gptlab.ops import Dropout, chunked_loss

# A hook point: (TransformerLens's name of an activation, the activation) -> the activation the forward goes on with.
# None (the default everywhere) costs nothing: no hook work, the fused attention kernel. With a tap, attention and the
# LayerNorms run written out, so that their scores, patterns and scales exist to be seen (inspect/hooks.py).
Tap = Callable[[str, torch.Tensor], torch.Tensor]


class KVCache:
    """Keys and values of the positions seen so far, preallocated for every layer.

    k and v are (n_layer, B, H, max_len, D). `pos` (B,) is how many positions of each row are filled: the next
    tokens of row b go to positions pos[b], pos[b] + 1, ... The model advances `pos` by T after each forward;
    a caller that fed rows of different lengths (right-padded) sets `pos` to the true lengths afterwards.
    The cache's dtype is the precision keys and values are stored in: a bf16 model may keep an fp32 cache.
    `attend` is the precision attention over the cache computes in: None for the cache's own, but fp32 on a CPU
    (where bf16 attention is slower without native bf16 products); whoever prepares the model may set it.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.step: CacheStep | None = None
        self.attend: torch.dtype | None = None

    def repeat_rows(self, n: int) -> KVCache:
        """A cache of n * B rows, each row copied n times in a row: N samples share one prefill."""
        return self.select_rows(torch.arange(len(self.pos), device=self.pos.device).repeat_interleave(n))

    def select_rows(self, rows: torch.Tensor) -> KVCache:
        """A new cache whose row i is a copy of this cache's row rows[i] (a row may be taken several times)."""
        out = KVCache.__new__(KVCache)
        out.k = self.k.index_select(1, rows)
        out.v = self.v.index_select(1, rows)
        out.pos = self.pos.index_select(0, rows)
        out.max_len, out.step, out.attend = self.max_len, None, self.attend
        return out

    def replace_rows(self, rows: torch.Tensor, other: KVCache) -> None:
        """Rows `rows` of this cache take the keys, values and positions of `other`'s rows 0, 1, ..."""
        n = int(other.pos.max()) if len(other.pos) else 0
        self.k[:, rows, :, :n] = other.k[:, :, :, :n]
        self.v[:, rows, :, :n] = other.v[:, :, :, :n]
        self.pos[rows] = other.pos

    def begin(self, T: int) -> CacheStep:
        """Plan a forward of T new positions per row: where they are written and which keys each query sees. The
        model calls this once per forward, so positions are read on the host once, not once per layer."""
        lo, hi = self.pos.aminmax()
        start, end = int(lo), int(hi) + T
        assert end <= self.max_len, f"KV cache overflow: {end} positions > {self.max_len}"
        uniform = start == end - T
        if uniform and start == 0:
            self.step = CacheStep(start, end, uniform, None, True)  # a fresh prefill: the square causal mask
        elif uniform and T == 1:
            self.step = CacheStep(start, end, uniform, None, False)  # one new token sees every stored position
        else:
            self.step = CacheStep(start, end, uniform, _attention_mask(self.pos, T, end), False)
        return self.step


class CacheStep(NamedTuple):
    """What one forward does with the cache: write positions [start, end) (row-wise from each row's pos unless
    uniform) and attend with `mask` (B, 1, T, end), or with the plain causal mask when `causal`, or to all keys."""

    start: int
    end: int
    uniform: bool
    mask: torch.Tensor | None
    causal: bool


def _attention_mask(kv_pos: torch.Tensor, T: int, n_keys: int) -> torch.Tensor:
    """(B, 1, T, n_keys) boolean mask: query t of row b may see key j iff j <= pos[b] + t."""
    query_pos = kv_pos[:, None] + torch.arange(T, device=kv_pos.device)  # (B, T)
    keys = torch.arange(n_keys, device=kv_pos.device)
    return (keys[None, None, :] <= query_pos[:, :, None])[:, None]  # (B, 1, T, n_keys)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: softmax(QK^T / sqrt(D) + mask) V per head, heads concatenated, then W_O."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.path = config.attention
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # W_Q, W_K, W_V in one
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # W_O
        self.attn_dropout = Dropout(config.dropout)
        self.resid_dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                tap: Tap | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        if tap is not None:  # heads split, (B, T, H, D), as TransformerLens shows them
            q, k, v = (tap(f"attn.hook_{n}", t.reshape(B, T, self.n_head, self.head_dim)).reshape(B, T, C)
                       for n, t in zip("qkv", (q, k, v)))
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        mask, causal = None, True  # no cache: plain causal attention over these T positions
        if cache is not None:
            k, v, mask, causal = self._use_cache(cache, layer, k, v)
            dtype = cache.attend or (torch.float32 if k.device.type == "cpu" else k.dtype)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if tap is not None:
            y = self._naive(q, k, v, mask, causal, tap).to(x.dtype)
            y = tap("attn.hook_z", y.transpose(1, 2)).reshape(B, T, C)
        else:
            attend = self._naive if self._naive_is_faster(q) else self._sdpa
            y = attend(q, k, v, mask, causal).to(x.dtype)  # (B, H, T, D)
            y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y))

    def _use_cache(self, cache: KVCache, layer: int, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
        """Store this step's keys/values; return every key/value visible now, the mask, and whether the plain
        causal mask applies instead."""
        step = cache.step
        assert step is not None, "call cache.begin(T) before a forward with the cache"
        B, _, T, _ = k.shape
        k, v = k.to(cache.k.dtype), v.to(cache.v.dtype)
        if step.uniform:  # every row at the same position: plain slices
            cache.k[layer, :, :, step.start:step.end] = k
            cache.v[layer, :, :, step.start:step.end] = v
        else:
            index = (cache.pos[:, None] + torch.arange(T, device=k.device))[:, None, :, None]  # (B, 1, T, 1)
            index = index.expand(B, self.n_head, T, self.head_dim)
            cache.k[layer].scatter_(2, index, k)
            cache.v[layer].scatter_(2, index, v)
        k_all, v_all = cache.k[layer, :, :, :step.end], cache.v[layer, :, :, :step.end]  # (B, H, end, D)
        return k_all, v_all, step.mask, step.causal

    def _naive_is_faster(self, q: torch.Tensor) -> bool:
        """attention="auto" picks the fused kernel, except when training on a CPU under bf16 autocast (its fused
        backward is slower than the written-out path) or with dropout (its fused kernel has none there and falls
        back to a slower path): measured with `gptlab bench attention` (docs/benchmarks.md)."""
        if self.path != "auto":
            return self.path == "naive"
        if q.device.type != "cpu" or not torch.is_grad_enabled():
            return False
        bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        return bf16 or (self.training and self.dropout > 0)

    def _naive(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool, tap: Tap | None = None) -> torch.Tensor:
        """The equation written out, the reference every fast path is tested against."""
        T, S = q.size(-2), k.size(-2)
        att = (q * (1.0 / math.sqrt(self.head_dim))) @ k.transpose(-2, -1)  # (B, H, T, S); scaling q: fewer numbers
        if causal:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()  # key j visible iff j <= i
        if mask is not None:
            # + 0 where visible, + -inf where not: the same numbers as masked_fill, but its backward is free (add's
            # is the identity; the softmax's gradient is already 0 where hidden), one pass over att fewer each way
            att = att + torch.zeros(mask.shape, dtype=att.dtype, device=att.device).masked_fill_(~mask, float("-inf"))
        if tap is None:
            return self.attn_dropout(F.softmax(att, dim=-1)) @ v  # (B, H, T, D)
        att = tap("attn.hook_pattern", F.softmax(tap("attn.hook_attn_scores", att), dim=-1))
        return self.attn_dropout(att) @ v

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool) -> torch.Tensor:
        """torch's fused scaled_dot_product_attention: the same math, dispatched to a fast kernel."""
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)


class MLP(nn.Module):
    """Position-wise feed-forward network: C -> 4C -> GELU -> C."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor, tap: Tap | None = None) -> torch.Tensor:
        if tap is None:
            return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))
        return self.dropout(self.c_proj(tap("mlp.hook_post", self.gelu(tap("mlp.hook_pre", self.c_fc(x))))))


def layer_norm(ln: nn.LayerNorm, x: torch.Tensor, tap: Tap | None, name: str) -> torch.Tensor:
    """ln(x); with a tap, written out: the scale sqrt(var + eps) at NAME.hook_scale, (x - mean) / scale at
    NAME.hook_normalized (before the weight and bias, as TransformerLens's unfolded LayerNorm)."""
    if tap is None:
        return ln(x)
    x = x - x.mean(-1, keepdim=True)
    x = tap(f"{name}.hook_normalized", x / tap(f"{name}.hook_scale", (x.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt()))
    return x * ln.weight + ln.bias if ln.bias is not None else x * ln.weight


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                tap: Tap | None = None) -> torch.Tensor:
        if tap is None:
            x = x + self.attn(self.ln_1(x), cache, layer)
            return x + self.mlp(self.ln_2(x))
        at = lambda name, t: tap(f"blocks.{layer}.{name}", t)  # this block's names
        x = at("hook_resid_pre", x)
        attn = self.attn(layer_norm(self.ln_1, x, at, "ln1"), cache, layer, at)
        x = at("hook_resid_mid", x + at("hook_attn_out", attn))
        return at("hook_resid_post", x + at("hook_mlp_out", self.mlp(layer_norm(self.ln_2, x, at, "ln2"), at)))


def _loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
    if targets is None:
        return None
    if logits.dtype != torch.float64:  # in at least fp32 (bf16 logits are upcast; an fp64 model keeps fp64)
        logits = logits.float()
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


class GPT(nn.Module):
    """GPT-2: token + position embeddings, n_layer blocks, final LayerNorm, LM head tied to the token embedding."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.vocab_size > 0, "resolve vocab_size from the tokenizer before building a model"
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=Dropout(config.dropout),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        # activation checkpointing, set by training: keep only each block's input in a training forward and
        # recompute the block in backward (the random state is restored first, so dropout draws the same masks)
        self.checkpoint_blocks = False
        # the training loss over chunks of this many positions, never all the logits at once (0: at once), set by
        # training: a training forward with targets then returns no logits
        self.loss_chunk = 0
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections: keep the residual stream's variance flat
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                last_only: bool = False, head: bool = True,
                tap: Tap | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx (B, T) token ids -> logits (B, T, V) (or (B, 1, V) with last_only) and the mean cross-entropy
        against targets (B, T) when given (-1 targets are ignored); with loss_chunk set, a forward that records
        gradients returns the loss alone (logits None). With a cache, idx continues each row at kv_cache.pos, and
        pos advances by T; head=False (with a cache) only fills the cache: no logits, (None, None). `tap` sees (and
        may replace) every activation by its TransformerLens name."""
        B, T = idx.shape
        if kv_cache is None:
            assert T <= self.config.block_size, f"sequence of {T} tokens > block_size {self.config.block_size}"
            pos = torch.arange(T, device=idx.device)  # (T,)
        else:
            step = kv_cache.begin(T)
            assert step.end <= self.config.block_size, "position beyond block_size: slide the window"
            pos = kv_cache.pos[:, None] + torch.arange(T, device=idx.device)  # (B, T)
        tok, where = self.transformer.wte(idx), self.transformer.wpe(pos)  # (B, T, C), (T, C) or (B, T, C)
        if tap is not None:
            tok, where = tap("hook_embed", tok), tap("hook_pos_embed", where.expand(B, T, -1))
        x = self.transformer.drop(tok + where)  # (B, T, C)
        recompute = self.checkpoint_blocks and self.training and torch.is_grad_enabled() and kv_cache is None
        for layer, block in enumerate(self.transformer.h):
            if recompute:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, preserve_rng_state=True)
            else:
                x = block(x, kv_cache, layer, tap)
        if kv_cache is not None:
            kv_cache.pos += T
            if not head:
                return None, None
        x = layer_norm(self.transformer.ln_f, x, tap, "ln_final")
        if last_only:
            x = x[:, -1:]
        if self.loss_chunk and targets is not None and torch.is_grad_enabled() and not last_only:
            weight = self.lm_head.tied_weight() if hasattr(self.lm_head, "tied_weight") else self.lm_head.weight
            return None, chunked_loss(x, weight, targets, self.loss_chunk)  # (a LoRA head has rows of its own)
        logits = self.lm_head(x)  # (B, T, V)
        return logits, _loss(logits, targets)

    def new_kv_cache(self, batch_size: int, dtype: torch.dtype | None = None,
                     max_len: int | None = None) -> KVCache:
        """An empty cache for `batch_size` rows, on the model's device, in the model's dtype by default."""
        c, weight = self.config, self.transformer.wte.weight
        return KVCache(c.n_layer, batch_size, c.n_head, max_len or c.block_size, c.head_dim,
                       weight.device, dtype or weight.dtype)

    def crop_block_size(self, block_size: int) -> None:
        """Shorten the context (keeps the first block_size position embeddings), e.g. to fine-tune faster."""
        assert 0 < block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size].detach().clone())

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, the tied LM head counted once; non_embedding leaves out wte and wpe."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel() + self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None, training: bool = True) -> float:
        """Model FLOPs per token: 2 per multiply-add of every matrix (blocks and LM head) plus attention's
        QK^T and AV over a context of seq_len (default block_size); x3 for forward + backward when training."""
        c = self.config
        T = seq_len or c.block_size
        matmul_params = self.num_params(non_embedding=True) + c.vocab_size * c.n_embd
        forward = 2 * matmul_params + 4 * c.n_layer * c.n_embd * T
        return 3 * forward if training else forward


class Bigram(nn.Module):
    """The baseline: the next token's logits depend on the current token only, read from a V x V table."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.vocab_size > 0, "resolve vocab_size from the tokenizer before building a model"
        self.config = config
        self.logits_table = nn.Embedding(config.vocab_size, config.vocab_size)
        nn.init.zeros_(self.logits_table.weight)  # start from the uniform distribution

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                last_only: bool = False, head: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if kv_cache is not None:  # nothing to remember: the last token is all the context there is
            kv_cache.pos += idx.size(1)
            if not head:
                return None, None
        logits = self.logits_table(idx[:, -1:] if last_only else idx)  # (B, T, V)
        return logits, _loss(logits, targets)

    def new_kv_cache(self, batch_size: int, dtype: torch.dtype | None = None, max_len: int | None = None) -> KVCache:
        device = self.logits_table.weight.device
        return KVCache(0, batch_size, 1, max_len or self.config.block_size, 1, device, torch.float32)

    def num_params(self, non_embedding: bool = False) -> int:
        return self.logits_table.weight.numel()

    def flops_per_token(self, seq_len: int | None = None, training: bool = True) -> float:
        return 0.0  # a table look-up: no matrix products


def is_gpt(model: object) -> TypeGuard[GPT]:
    """Whether `model` is a GPT (a NaiveGPT, computed by the reference engine, is one), not the bigram table: the one
    way gptlab asks whether a model has blocks, attention, a residual stream and a tied LM head."""
    return isinstance(model, GPT)


def build_model(config: ModelConfig) -> GPT | Bigram:
    """The model described by `config` (arch "gpt" or "bigram"), freshly initialised."""
    return Bigram(config) if config.arch == "bigram" else GPT(config)
