"""`gptlab bench hooks` and `gptlab bench patching`: gptlab's hook points and patching beside TransformerLens, in
one run, on one model.

hooks: every hook tensor's worst difference from a `HookedTransformer` of the same weights (no weight processing),
then the forward's time with no hook (the fused attention), through `Hooked` with none attached, with every
activation cached, and TransformerLens's run_with_cache, timed in alternation (round by round, so a drift of the
machine's speed reaches each the same way): medians with their spread (lowest, highest).
patching: the layer x position sweep of the residual stream and the layer x position x head sweep of the heads'
outputs, gptlab's (batched, each patched run from its layer on) beside TransformerLens's get_act_patch_* (a whole
forward per cell), the results checked equal before any time is reported; attribution patching beside both.
"""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from collections.abc import Callable

import torch

from gptlab.bench.timing import LoadWatch, median
from gptlab.config import ModelConfig
from gptlab.inspect.hooks import Hooked, hook_names
from gptlab.inspect.lens import hooked_transformer
from gptlab.inspect.patching import activation_patch, attribution_patch, logit_diff
from gptlab.machine import cpu_model
from gptlab.model import GPT

MODELS = {"gpt2-124M": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257),
          "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=256, vocab_size=512)}
TL_SWEEPS = {"resid_pre": "get_act_patch_resid_pre", "head_out_by_pos": "get_act_patch_attn_head_out_by_pos"}


def lens_bench_model(name: str, run: str | None = None) -> tuple[GPT, str]:
    """A run's model, or one of MODELS with random weights moved off their init (LayerNorms and biases too)."""
    if run:
        from gptlab.checkpoint import load_run

        return load_run(run).model.float().eval(), run
    torch.manual_seed(0)
    model = GPT(ModelConfig(dropout=0.0, **MODELS[name]))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval(), f"{name} shape, random weights"


def parity(model: GPT, lens, ids: torch.Tensor) -> list[tuple[str, float]]:
    """(hook name, worst |difference| relative to the tensor's largest finite |value|) for every hook point."""
    with torch.no_grad():
        _, theirs = lens.run_with_cache(ids)
        _, ours = Hooked(model).run_with_cache(ids)
    rows = []
    for name in hook_names(model.config.n_layer):
        a, b = theirs[name], ours[name]
        finite = torch.isfinite(a)
        same_inf = bool(torch.equal(finite, torch.isfinite(b)))
        diff = float((a[finite] - b[finite]).abs().max() / a[finite].abs().max().clamp_min(1e-30))
        rows.append((name, diff if same_inf else float("inf")))
    return rows


def alternate(fns: dict[str, Callable[[], object]], rounds: int, warmup: bool = True,
              kept: dict[str, object] | None = None) -> dict[str, list[float]]:
    """Each fn timed once a round, in turn, for `rounds` rounds (after one warm-up call each with `warmup`); each
    fn's last result goes into `kept` when given."""
    for fn in fns.values() if warmup else ():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            result = fn()
            times[name].append(time.perf_counter() - start)
            if kept is not None:
                kept[name] = result
    return times


def spread(values: list[float], unit: float = 1e3) -> str:
    return f"{median(values) * unit:9.2f} ({min(values) * unit:.2f} .. {max(values) * unit:.2f})"


def run_hooks(model_name: str = "gpt2-124M", run: str | None = None, tokens: int = 64, rounds: int = 15) -> None:
    watch = LoadWatch()
    model, what = lens_bench_model(model_name, run)
    lens = hooked_transformer(model)
    ids = torch.randint(0, model.config.vocab_size, (1, min(tokens, model.config.block_size)),
                        generator=torch.Generator().manual_seed(1))
    print(f"gptlab bench hooks: {what}; {ids.size(1)} tokens; {cpu_model()}, {torch.get_num_threads()} threads")
    rows = parity(model, lens, ids)
    print(f"\n{'hook (every block: the worst of its layers)':<44} worst difference from TransformerLens")
    worst: dict[str, float] = {}
    for name, diff in rows:
        key = name.split(".", 2)[2] if name.startswith("blocks.") else name
        worst[key] = max(worst.get(key, 0.0), diff)
    for key, diff in worst.items():
        print(f"  {key:<42} {diff:.2e}")
    hooked = Hooked(model)
    with torch.no_grad():
        times = alternate({"plain forward (no tap)": lambda: model(ids),
                           "Hooked, no hook attached": lambda: hooked(ids),
                           "run_with_cache, every hook": lambda: hooked.run_with_cache(ids),
                           "TransformerLens run_with_cache": lambda: lens.run_with_cache(ids)}, rounds)
    base = median(times["plain forward (no tap)"])
    print(f"\n{'forward, timed in alternation':<34} {'median ms (lowest .. highest)':>34}  vs plain")
    for name, values in times.items():
        print(f"  {name:<32} {spread(values):>34}  {median(values) / base:6.2f}x")
    print(watch.stop().report())


def _tl_sweep(lens, kind: str, clean: torch.Tensor, corrupt: torch.Tensor, metric) -> torch.Tensor:
    from transformer_lens import patching

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        warnings.simplefilter("ignore")
        _, cache = lens.run_with_cache(clean)
        return getattr(patching, TL_SWEEPS[kind])(lens, corrupt, cache, metric)


def run_patching(model_name: str = "gpt2-124M", run: str | None = None, tokens: int = 12, rounds: int = 3) -> None:
    """Each sweep: gptlab's and TransformerLens's results compared, then timed in alternation."""
    watch = LoadWatch()
    model, what = lens_bench_model(model_name, run)
    lens = hooked_transformer(model)
    g = torch.Generator().manual_seed(2)
    clean = torch.randint(0, model.config.vocab_size, (1, tokens), generator=g)
    corrupt = clean.clone()
    corrupt[0, tokens // 3] = (clean[0, tokens // 3] + 1) % model.config.vocab_size  # one token changed
    answer, wrong = int(clean[0, -1]), int(corrupt[0, tokens // 3])
    metric = logit_diff(answer, wrong)
    c = model.config
    print(f"gptlab bench patching: {what}; a prompt pair of {tokens} tokens (one token changed); {cpu_model()}, "
          f"{torch.get_num_threads()} threads")
    print(f"\n{'sweep':<18} {'cells':>6} {'worst diff':>10} {'gptlab s (low .. high)':>26} "
          f"{'TransformerLens s (low .. high)':>32} {'speed-up':>8} {'attribution s':>14}")
    for kind in TL_SWEEPS:  # TransformerLens's first sweep warms it up: no call of its own (minutes at 124M)
        activation_patch(model, clean, corrupt, metric, kind)
        kept: dict[str, object] = {}
        times = alternate({"ours": lambda: activation_patch(model, clean, corrupt, metric, kind).values,
                           "theirs": lambda: _tl_sweep(lens, kind, clean, corrupt, metric),
                           "attribution": lambda: attribution_patch(model, clean, corrupt, metric, kind)}, rounds,
                          warmup=False, kept=kept)
        ours, theirs = kept["ours"], kept["theirs"]
        diff = float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))
        cells = ours.numel()
        print(f"{kind:<18} {cells:>6} {diff:>10.1e} {spread(times['ours'], 1):>26} "
              f"{spread(times['theirs'], 1):>32} {median(times['theirs']) / median(times['ours']):7.1f}x "
              f"{median(times['attribution']):>14.3f}")
    print(f"(model: {c.n_layer} layers, {c.n_head} heads; TransformerLens runs one whole forward per cell, gptlab "
          "batches the cells of a layer and runs each from that layer on)")
    print(watch.stop().report())
