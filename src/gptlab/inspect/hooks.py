"""Hook points on gptlab's own GPT, by TransformerLens's names: a cache of every activation, hooks that read or
replace an activation mid-forward, and the same during generation.

The model's forward (model.py) takes a `tap`; `Hooked` gives it one that runs the hooks attached to each name. With
no tap the forward is untouched (the fused attention kernel, no hook work), so a model is hooked by wrapping it, not
by copying it: `Hooked(model)` holds the very GPT that trains and samples. Shapes are TransformerLens's: the residual
stream (B, T, C), q / k / v / z with heads split (B, T, H, D), attention scores and patterns (B, H, T_query, T_key)
(scores -inf where a key is hidden), LayerNorm scales (B, T, 1). `blocks.{i}.hook_in` / `hook_out` (the newer
TransformerLens names) are the same points as `hook_resid_pre` / `hook_resid_post`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from gptlab.errors import GptlabError
from gptlab.model import GPT, is_gpt, layer_norm

BLOCK_HOOKS = ("hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k",
               "attn.hook_v", "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "hook_attn_out",
               "hook_resid_mid", "ln2.hook_scale", "ln2.hook_normalized", "mlp.hook_pre", "mlp.hook_post",
               "hook_mlp_out", "hook_resid_post")
ALIASES = {"hook_in": "hook_resid_pre", "hook_out": "hook_resid_post"}  # blocks.{i}.hook_in is hook_resid_pre
# the activations whose positions run along dim 2 (the query axis); every other one has them on dim 1
BY_QUERY = ("attn.hook_attn_scores", "attn.hook_pattern")

NamesFilter = str | Sequence[str] | Callable[[str], bool] | None
HookFn = Callable[[torch.Tensor, "HookPoint"], "torch.Tensor | None"]


class HookError(GptlabError):
    """A hook attached to a name that does not exist, one that raised, or one that returned the wrong shape."""


@dataclass(frozen=True)
class HookPoint:
    """What a hook function gets beside the activation: the point's name (and its layer)."""

    name: str

    def layer(self) -> int | None:
        """The block the point is in (None for the embeddings and the final LayerNorm)."""
        return int(self.name.split(".")[1]) if self.name.startswith("blocks.") else None


def hook_names(n_layer: int) -> list[str]:
    """Every hook point of a GPT of n_layer blocks, in the order the forward reaches them."""
    blocks = [f"blocks.{i}.{h}" for i in range(n_layer) for h in BLOCK_HOOKS]
    return ["hook_embed", "hook_pos_embed", *blocks, "ln_final.hook_scale", "ln_final.hook_normalized"]


def canonical(name: str) -> str:
    """`blocks.{i}.hook_in` / `hook_out` as the names the forward uses; any other name unchanged."""
    head, _, last = name.rpartition(".")
    return f"{head}.{ALIASES[last]}" if head.startswith("blocks.") and last in ALIASES else name


class ActivationCache(dict):
    """Activations by hook name. Also read as TransformerLens reads its cache: `cache["pattern", 0]` is
    `cache["blocks.0.attn.hook_pattern"]`, `cache["resid_pre", 1]`, `cache["scale"]` (the final LayerNorm's)."""

    def __getitem__(self, key: str | tuple) -> torch.Tensor:
        if isinstance(key, str) and not super().__contains__(canonical(key)) and "." not in key:
            key = (key.removeprefix("hook_"),)  # "scale", "embed": a short name outside the blocks
        if isinstance(key, tuple):
            short, *layer = key
            matches = [n for n in self if n.endswith(f"hook_{short}")
                       and (n.startswith(f"blocks.{layer[0]}.") if layer else not n.startswith("blocks."))]
            if len(matches) != 1:
                raise KeyError(f"{key!r} names {len(matches)} cached activations, not one")
            key = matches[0]
        return super().__getitem__(canonical(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(canonical(key) if isinstance(key, str) else key)


def name_filter(names: NamesFilter, known: Sequence[str]) -> Callable[[str], bool]:
    """A filter from a name, a list of names or a callable (None: every name); a name no point has is refused."""
    if names is None:
        return lambda name: True
    if callable(names):
        return names
    wanted = {canonical(n) for n in ([names] if isinstance(names, str) else names)}
    for n in wanted - set(known):
        close = difflib.get_close_matches(n, known, n=1)
        hint = f"did you mean {close[0]}?" if close else "names look like blocks.0.attn.hook_pattern"
        raise HookError(f"no hook point named {n!r} in this model: {hint} (Hooked.hook_names() lists them)")
    return wanted.__contains__


def _apply(fn: HookFn, point: HookPoint, t: torch.Tensor) -> torch.Tensor:
    """One hook run on one activation: its replacement checked, its failure named."""
    label = getattr(fn, "__name__", type(fn).__name__)
    try:
        out = fn(t, point)
    except HookError:
        raise
    except Exception as e:
        raise HookError(f"the hook {label} on {point.name} raised {type(e).__name__}: {e}") from e
    if out is None:
        return t
    if not isinstance(out, torch.Tensor) or out.shape != t.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise HookError(f"the hook {label} on {point.name} returned {shape}, expected a tensor of shape "
                        f"{tuple(t.shape)}: return the activation edited in place of it, or None to keep it")
    return out


class Hooked:
    """A GPT with TransformerLens's API: `run_with_cache`, `run_with_hooks`, `add_hook` / `reset_hooks`, and
    `generate_with_cache`. It wraps the model (no copy); the model runs in eval mode (no dropout) while hooked."""

    def __init__(self, model: GPT):
        if not is_gpt(model):
            raise GptlabError("hooks need a GPT (blocks, attention, a residual stream): this run is a bigram table")
        self.model = model
        self.names = hook_names(model.config.n_layer)
        self._hooks: list[tuple[Callable[[str], bool], HookFn]] = []

    def hook_names(self) -> list[str]:
        return list(self.names)

    def add_hook(self, name: NamesFilter, fn: HookFn) -> None:
        """Attach fn(activation, hook) -> replacement or None to the points `name` picks; kept until reset_hooks."""
        self._hooks.append((name_filter(name, self.names), fn))

    def reset_hooks(self) -> None:
        self._hooks.clear()

    @contextmanager
    def hooks(self, fwd_hooks: Sequence[tuple[NamesFilter, HookFn]] = ()) -> Iterator[Hooked]:
        """These hooks attached for the block's duration, removed afterwards whatever happens."""
        before = len(self._hooks)
        try:
            for name, fn in fwd_hooks:
                self.add_hook(name, fn)
            yield self
        finally:
            del self._hooks[before:]

    def tap(self, extra: HookFn | None = None) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """The model's tap: every attached hook whose filter takes the name, in the order attached, then `extra`."""
        def tap(name: str, t: torch.Tensor) -> torch.Tensor:
            point = HookPoint(name)
            for wanted, fn in self._hooks:
                if wanted(name):
                    t = _apply(fn, point, t)
            return t if extra is None else _apply(extra, point, t)
        return tap

    def forward(self, ids: torch.Tensor, extra: HookFn | None = None, **kwargs) -> torch.Tensor:
        """Logits (B, T, V) of ids (B, T) with the attached hooks (and `extra`) running; no hooks, no tap."""
        was = self.model.training
        self.model.eval()
        try:
            tap = self.tap(extra) if self._hooks or extra is not None else None
            return self.model(ids, tap=tap, **kwargs)[0]
        finally:
            self.model.train(was)

    __call__ = forward

    def run_with_hooks(self, ids: torch.Tensor, fwd_hooks: Sequence[tuple[NamesFilter, HookFn]] = (),
                       **kwargs) -> torch.Tensor:
        """Logits with `fwd_hooks` [(name, list of names or filter, fn), ...] attached for this run only."""
        with self.hooks(fwd_hooks):
            return self.forward(ids, **kwargs)

    def run_with_cache(self, ids: torch.Tensor, names_filter: NamesFilter = None,
                       **kwargs) -> tuple[torch.Tensor, ActivationCache]:
        """(logits, cache): every activation `names_filter` picks (all by default), detached, after the hooks."""
        wanted, cache = name_filter(names_filter, self.names), ActivationCache()

        def keep(t: torch.Tensor, hook: HookPoint) -> None:
            if wanted(hook.name):
                cache[hook.name] = t.detach()
        logits = self.forward(ids, extra=keep, **kwargs)
        return logits, cache

    def generate_with_cache(self, ids: torch.Tensor, max_new_tokens: int, names_filter: NamesFilter = None,
                            temperature: float = 0.0, seed: int = 0) -> tuple[torch.Tensor, ActivationCache]:
        """Generate through the KV cache (greedy, or sampled at `temperature`) with the hooks running, keeping
        every step's activations: the cache returned holds them for the whole sequence but its last token, each
        equal to what a forward of that sequence at once computes (a step's scores padded with -inf and its
        pattern with 0 over the keys it could not see yet)."""
        B, T0 = ids.shape
        if T0 + max_new_tokens > self.model.config.block_size:
            raise GptlabError(f"{T0} prompt tokens + {max_new_tokens} new ones exceed the context of "
                              f"{self.model.config.block_size}: ask for fewer tokens")
        steps, kv = [], self.model.new_kv_cache(B)
        generator = torch.Generator(device=ids.device).manual_seed(seed)
        out, step_ids = ids, ids
        for _ in range(max_new_tokens):
            logits, cache = self.run_with_cache(step_ids, names_filter, kv_cache=kv)
            steps.append(cache)
            last = logits[:, -1].float()
            if temperature > 0:
                nxt = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=generator)
            else:
                nxt = last.argmax(-1, keepdim=True)
            out, step_ids = torch.cat([out, nxt], 1), nxt
        return out, _joined(steps, out.size(1) - 1)


def _joined(steps: list[ActivationCache], length: int) -> ActivationCache:
    """Each step's activations joined along the positions; attention rows padded to `length` keys."""
    joined = ActivationCache()
    for name in steps[0] if steps else ():
        parts = [s[name] for s in steps]
        if name.endswith(BY_QUERY):
            fill = float("-inf") if name.endswith("scores") else 0.0
            parts = [torch.nn.functional.pad(p, (0, length - p.size(-1)), value=fill) for p in parts]
            joined[name] = torch.cat(parts, 2)
        else:
            joined[name] = torch.cat(parts, 1)
    return joined


def run_from(model: GPT, layer: int, resid: torch.Tensor, tap: Callable[[str, torch.Tensor], torch.Tensor] | None
             = None) -> torch.Tensor:
    """Logits from the residual stream entering block `layer` (B, T, C): the blocks from there on, the final
    LayerNorm and the LM head; what activation patching runs instead of the whole model."""
    x = resid
    for i in range(layer, model.config.n_layer):
        x = model.transformer.h[i](x, None, i, tap)
    return model.lm_head(layer_norm(model.transformer.ln_f, x, tap, "ln_final"))
