"""Activation patching, attribution patching and direct logit attribution on gptlab's GPT, with TransformerLens's
meanings and result shapes.

Activation patching ("denoising", as `transformer_lens.patching`): run the corrupted tokens, put the clean run's
activation in at one point (a layer's residual stream, attention or MLP output at one position; one head's output at
every position or at one), and read a metric off the patched logits. Each patch is one row of a batch: the corrupted
run is cached once, and each layer's rows start from its cached residual stream (`hooks.run_from`), so the blocks
before the patched one are never run again; at most PATCH_ROWS rows go through the model at once. Attribution
patching is its first-order estimate from one corrupted forward and backward: (clean - corrupted) activation times
the metric's gradient there, summed over the features. Direct logit attribution splits the last residual stream into
what wrote it (embeddings, each head, each attention bias, each MLP) and reads each part's share of a logit
difference through the frozen final LayerNorm. Letters as in model.py: T positions, C channels, H heads, D head_dim,
V vocabulary, L layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from gptlab.errors import GptlabError
from gptlab.inspect.hooks import ActivationCache, Hooked, run_from
from gptlab.model import GPT, is_gpt

PATCH_ROWS = 64  # patched runs batched into one forward of the blocks from the patched layer on
# kind -> (the hook point in each block, the axes after the layer): TransformerLens's get_act_patch_* by name
PATCH_KINDS = {
    "resid_pre": ("hook_resid_pre", ("pos",)),  # get_act_patch_resid_pre
    "attn_out": ("hook_attn_out", ("pos",)),  # get_act_patch_attn_out
    "mlp_out": ("hook_mlp_out", ("pos",)),  # get_act_patch_mlp_out
    "head_out": ("attn.hook_z", ("head",)),  # get_act_patch_attn_head_out_all_pos
    "head_out_by_pos": ("attn.hook_z", ("pos", "head")),  # get_act_patch_attn_head_out_by_pos
}


class Metric:
    """A metric of logits (B, T, V) -> (B,), one value per row. `per_row` False: `fn` takes one row's logits
    (1, T, V) and returns a scalar tensor (TransformerLens's patching metric), and is applied row by row; True: `fn`
    takes the whole batch at once. `tokens` are the ids it reads, checked against the model's vocabulary."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], per_row: bool = False,
                 tokens: tuple[int, ...] = ()):
        self.fn, self.per_row, self.tokens = fn, per_row, tokens

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.per_row:
            return self.fn(logits)
        values = [self.fn(logits[i:i + 1]) for i in range(logits.size(0))]
        for v in values:
            if not isinstance(v, torch.Tensor) or v.numel() != 1:
                raise GptlabError(f"a metric returns one number as a tensor for logits (1, T, V), this one returned "
                                  f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
        return torch.stack([v.reshape(()) for v in values])


def logit_diff(answer: int, wrong: int) -> Metric:
    """The metric logits[:, -1, answer] - logits[:, -1, wrong], per row: how much more the model predicts
    `answer` than `wrong` after the last token."""
    return Metric(lambda logits: logits[:, -1, answer] - logits[:, -1, wrong], per_row=True, tokens=(answer, wrong))


@dataclass(frozen=True)
class PatchResult:
    """One sweep: `values` shaped as TransformerLens's (layer, pos) / (layer, head) / (layer, pos, head), `axes`
    their names, `ticks` a label per index of each axis. `method` "activation": each value is the metric of the
    corrupted run with that one activation patched in from the clean run; "attribution": each value estimates how
    much that patch changes the metric. `clean` / `corrupt` are the metric of the two runs unpatched."""

    kind: str
    method: str
    values: torch.Tensor
    axes: tuple[str, ...]
    ticks: tuple[tuple[str, ...], ...]
    clean: float
    corrupt: float

    @property
    def effect(self) -> torch.Tensor:
        """How much each patch changes the corrupted run's metric (attribution patching's values are that)."""
        return self.values - self.corrupt if self.method == "activation" else self.values

    def cells(self) -> list[tuple[tuple[str, ...], float]]:
        """Every value with its labels, in index order: a table's rows."""
        index = torch.cartesian_prod(*(torch.arange(n) for n in self.values.shape)).reshape(-1, self.values.dim())
        return [(tuple(self.ticks[a][int(i)] for a, i in enumerate(row)), float(self.values[tuple(row)]))
                for row in index]

    def heatmap(self) -> tuple[torch.Tensor, list[str], list[str]]:
        """(matrix, row labels, column labels): (layer, pos) and (layer, head) as they are, (layer, pos, head) with
        a row per layer and head (L0H0, L0H1, ...) and a column per position."""
        if self.values.dim() == 2:
            return self.values, list(self.ticks[0]), list(self.ticks[1])
        rows = [f"{layer}H{h}" for layer in self.ticks[0] for h in range(len(self.ticks[2]))]
        return self.values.transpose(1, 2).reshape(len(rows), -1), rows, list(self.ticks[1])


@dataclass(frozen=True)
class LogitParts:
    """Direct logit attribution at one position: `values[i]` is what the part `labels[i]` adds to the logit
    difference through the final LayerNorm with its scale frozen; the parts sum to `logit_diff`, the model's."""

    labels: tuple[str, ...]
    values: torch.Tensor
    logit_diff: float

    def items(self) -> list[tuple[str, float]]:
        return [(label, float(v)) for label, v in zip(self.labels, self.values)]

    def heads(self, n_layer: int, n_head: int) -> torch.Tensor:
        """The heads' parts as (layer, head), for a heat map."""
        return torch.stack([self.values[self.labels.index(f"L{i}H{h}")] for i in range(n_layer)
                            for h in range(n_head)]).reshape(n_layer, n_head)


def _hooked(model: GPT | Hooked) -> Hooked:
    """A Hooked on the plain model: hooks attached to the one given do not run (the sweeps patch the model alone)."""
    if isinstance(model, Hooked):
        return Hooked(model.model)
    if not is_gpt(model):
        raise GptlabError("patching needs a GPT (blocks, attention, a residual stream): this run is a bigram table")
    return Hooked(model)


@contextmanager
def _eval(model: GPT) -> Iterator[None]:
    """The model in eval mode (no dropout) for the block, its mode restored afterwards."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def _ids(model: GPT, ids: torch.Tensor, what: str) -> torch.Tensor:
    """`ids` (T,) or (1, T) as (1, T) on the model's device, checked against its context and vocabulary."""
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.size(0) != 1 or ids.size(1) == 0:
        raise GptlabError(f"the {what} tokens are one prompt, (T,) or (1, T) ids; got shape {tuple(ids.shape)}")
    c = model.config
    if ids.size(1) > c.block_size:
        raise GptlabError(f"the {what} prompt has {ids.size(1)} tokens, more than the context of {c.block_size}")
    if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
        raise GptlabError(f"the {what} prompt holds an id outside the vocabulary [0, {c.vocab_size})")
    return ids.to(model.transformer.wte.weight.device)


def _check_token(model: GPT, token: int, what: str) -> None:
    if not 0 <= int(token) < model.config.vocab_size:
        raise GptlabError(f"the {what} id {token} is outside the vocabulary [0, {model.config.vocab_size})")


def _setup(model: GPT | Hooked, clean: torch.Tensor, corrupt: torch.Tensor, metric: Callable,
           kind: str) -> tuple[Hooked, torch.Tensor, torch.Tensor, Metric]:
    """Everything a sweep checks before it runs: the model, both prompts of one length, the metric, the kind."""
    hooked = _hooked(model)
    if kind not in PATCH_KINDS:
        raise GptlabError(f"no patching sweep {kind!r}: the sweeps are {', '.join(PATCH_KINDS)}")
    clean, corrupt = _ids(hooked.model, clean, "clean"), _ids(hooked.model, corrupt, "corrupted")
    if clean.shape != corrupt.shape:
        raise GptlabError(f"the clean prompt has {clean.size(1)} tokens and the corrupted one {corrupt.size(1)}: "
                          "patching compares them position by position, so give two prompts of one length")
    metric = metric if isinstance(metric, Metric) else Metric(metric)
    for token in metric.tokens:
        _check_token(hooked.model, token, "metric's token")
    return hooked, clean, corrupt, metric


def _result(hooked: Hooked, kind: str, method: str, values: torch.Tensor, T: int, clean: float,
            corrupt: float) -> PatchResult:
    """The sweep's values with their axes, labelled L0, L1, ... / 0, 1, ... / H0, H1, ..."""
    axes = ("layer", *PATCH_KINDS[kind][1])
    names = {"layer": lambda i: f"L{i}", "pos": str, "head": lambda h: f"H{h}"}
    ticks = tuple(tuple(names[a](i) for i in range(n)) for a, n in zip(axes, _shape(hooked, kind, T)))
    return PatchResult(kind, method, values, axes, ticks, clean, corrupt)


def _shape(hooked: Hooked, kind: str, T: int) -> tuple[int, ...]:
    """The sweep's result shape: (L, T), (L, H) or (L, T, H)."""
    sizes = {"layer": hooked.model.config.n_layer, "pos": T, "head": hooked.model.config.n_head}
    return tuple(sizes[a] for a in ("layer", *PATCH_KINDS[kind][1]))


def _masks(kind: str, T: int, H: int) -> torch.Tensor:
    """One boolean mask per patch, over the activation's (T,) or (T, H) indices: True where the clean value goes."""
    axes = PATCH_KINDS[kind][1]
    if axes == ("pos",):
        return torch.eye(T, dtype=torch.bool)
    if axes == ("head",):
        return torch.eye(H, dtype=torch.bool)[:, None, :].expand(H, T, H)
    return torch.eye(T * H, dtype=torch.bool).reshape(T * H, T, H)


def _patched_rows(hooked: Hooked, layer: int, name: str, masks: torch.Tensor, clean: torch.Tensor,
                  corrupt_cache: ActivationCache, metric: Metric) -> torch.Tensor:
    """The metric of one patched corrupted run per mask, each mask's clean values in at `name` of `layer`: the
    blocks from `layer` on, run on the corrupted residual stream entering it, PATCH_ROWS rows at a time."""
    model, point = hooked.model, f"blocks.{layer}.{name}"
    start = corrupt_cache[f"blocks.{layer}.hook_resid_pre"]  # (1, T, C)
    out = []
    for lo in range(0, masks.size(0), PATCH_ROWS):
        where = masks[lo:lo + PATCH_ROWS, ..., None].to(start.device)  # (rows, T, 1) or (rows, T, H, 1)

        def tap(hook: str, t: torch.Tensor, where: torch.Tensor = where) -> torch.Tensor:
            return torch.where(where, clean, t) if hook == point else t
        if name == "hook_resid_pre":
            logits = run_from(model, layer, torch.where(where, clean, start))
        else:
            logits = run_from(model, layer, start.expand(where.size(0), -1, -1), tap)
        out.append(metric(logits))
    return torch.cat(out)


def activation_patch(model: GPT | Hooked, clean: torch.Tensor, corrupt: torch.Tensor, metric: Callable,
                     kind: str = "resid_pre") -> PatchResult:
    """Activation patching of every activation of sweep `kind` (a PATCH_KINDS key): the corrupted prompt run with
    that one activation taken from the clean prompt's run, the metric read off its logits, as TransformerLens's
    get_act_patch_* give it. `metric`: logit_diff(...), a Metric, or metric(logits (1, T, V)) -> scalar tensor."""
    hooked, clean, corrupt, metric = _setup(model, clean, corrupt, metric, kind)
    name, (T, cfg) = PATCH_KINDS[kind][0], (clean.size(1), hooked.model.config)
    wanted = lambda n: n.endswith((f".{name}", ".hook_resid_pre"))
    with torch.no_grad(), _eval(hooked.model):
        clean_logits, clean_cache = hooked.run_with_cache(clean, wanted)
        corrupt_logits, corrupt_cache = hooked.run_with_cache(corrupt, wanted)
        masks = _masks(kind, T, cfg.n_head)
        layers = [_patched_rows(hooked, layer, name, masks, clean_cache[f"blocks.{layer}.{name}"], corrupt_cache,
                                metric) for layer in range(cfg.n_layer)]
        values = torch.stack(layers).reshape(_shape(hooked, kind, T))
        before = float(metric(clean_logits)[0]), float(metric(corrupt_logits)[0])
    return _result(hooked, kind, "activation", values, T, *before)


def attribution_patch(model: GPT | Hooked, clean: torch.Tensor, corrupt: torch.Tensor, metric: Callable,
                      kind: str = "resid_pre") -> PatchResult:
    """Attribution patching of sweep `kind`: for each activation activation_patch would patch, (clean - corrupted)
    times the gradient of the metric at the corrupted run, summed over the features (and, for a head's output at
    every position, over the positions): the first-order estimate of how much that patch changes the metric, from
    one forward and backward of the corrupted prompt. Exact where the metric is linear in the activation."""
    hooked, clean, corrupt, metric = _setup(model, clean, corrupt, metric, kind)
    name, T = PATCH_KINDS[kind][0], clean.size(1)
    points = [f"blocks.{layer}.{name}" for layer in range(hooked.model.config.n_layer)]
    with torch.no_grad(), _eval(hooked.model):
        clean_logits, clean_cache = hooked.run_with_cache(clean, points)
    kept: dict[str, torch.Tensor] = {}

    def keep(t: torch.Tensor, hook) -> torch.Tensor:
        if hook.name in points:
            kept[hook.name] = t if t.requires_grad else t.detach().requires_grad_(True)
            return kept[hook.name]
        return t
    with torch.enable_grad(), _eval(hooked.model):
        corrupt_value = metric(hooked(corrupt, extra=keep)).sum()
        grads = torch.autograd.grad(corrupt_value, [kept[p] for p in points])
    with torch.no_grad():
        sums = (1, -1) if kind == "head_out" else (-1,)  # a head at every position: positions summed too
        values = torch.stack([((clean_cache[p] - kept[p]) * g).sum(sums)[0] for p, g in zip(points, grads)])
        clean_value = float(metric(clean_logits)[0])
    return _result(hooked, kind, "attribution", values, T, clean_value, float(corrupt_value.detach()))


def direct_logit_attribution(model: GPT | Hooked, ids: torch.Tensor, answer: int, wrong: int,
                             pos: int = -1) -> LogitParts:
    """What each writer of the last residual stream at `pos` adds to logit[answer] - logit[wrong] there: the token
    and position embeddings, each head (its z times its rows of W_O, without the bias), each attention output bias,
    each MLP, each centred, divided by the final LayerNorm's scale at `pos` (frozen), times its weight, dotted with
    W_U[answer] - W_U[wrong]; and the final LayerNorm's bias. The parts sum to the model's logit difference."""
    hooked = _hooked(model)
    gpt, c = hooked.model, hooked.model.config
    ids = _ids(gpt, ids, "attributed")
    for token, what in ((answer, "answer"), (wrong, "wrong answer")):
        _check_token(gpt, token, what)
    if not -ids.size(1) <= pos < ids.size(1):
        raise GptlabError(f"position {pos} is outside the prompt of {ids.size(1)} tokens")
    with torch.no_grad(), _eval(gpt):
        logits, cache = hooked.run_with_cache(ids)
        labels, parts = ["embed", "pos_embed"], [cache["hook_embed"][0, pos], cache["hook_pos_embed"][0, pos]]
        for i, block in enumerate(gpt.transformer.h):
            w_o = block.attn.c_proj.weight  # (C, C): head h reads its inputs h*D:(h+1)*D
            z = cache[f"blocks.{i}.attn.hook_z"][0, pos]  # (H, D)
            for h in range(c.n_head):
                labels.append(f"L{i}H{h}")
                parts.append(z[h] @ w_o[:, h * c.head_dim:(h + 1) * c.head_dim].T)
            if block.attn.c_proj.bias is not None:
                labels.append(f"L{i} attn bias")
                parts.append(block.attn.c_proj.bias)
            labels.append(f"L{i} mlp")
            parts.append(cache[f"blocks.{i}.hook_mlp_out"][0, pos])
        ln_f, w_u = gpt.transformer.ln_f, gpt.lm_head.weight
        direction = w_u[answer] - w_u[wrong]  # (C,)
        stacked = torch.stack(parts)  # (parts, C)
        centred = stacked - stacked.mean(-1, keepdim=True)
        values = (centred / cache["ln_final.hook_scale"][0, pos]) * ln_f.weight @ direction
        if ln_f.bias is not None:
            labels.append("ln_final bias")
            values = torch.cat([values, (ln_f.bias @ direction)[None]])
        diff = float(logits[0, pos, answer] - logits[0, pos, wrong])
    return LogitParts(tuple(labels), values, diff)
