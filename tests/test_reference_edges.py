"""The naive engine's edges (issue 42, behaviour 4), each held to a value from outside the code: `reference check`'s
relative difference on gaps worked out by hand; the engine's own dropout masks at p = 0.25 (0 or 1 / (1 - p), a
fraction p of zeros within a binomial tolerance, torch's loss and gradients under them); LayerNorm's epsilon at
1e-2, where it matters, with no biases, the tanh GELU and heads 7 wide, against torch autograd; and `bench
reference`'s clock, made to tick once per reading, so that each function's total is its number of calls, counted
here from the equations."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import perturbed
from gptlab.config import ModelConfig, TrainConfig
from gptlab.model import GPT
from gptlab.reference import library
from gptlab.reference import naive_gpt as rm
from gptlab.reference.check import compare_engines, difference
from gptlab.reference.naive_adamw import clip_grad_norm
from gptlab.reference.naive_training import naive_model, naive_optimizer

pytestmark = pytest.mark.usefixtures("reference_engine")
f64 = torch.float64
P = 0.25  # dropout: not the default 0, and not 0.5, where 1 / p = 1 / (1 - p) would hide which one scales
KEPT = 4 / 3  # 1 / (1 - P), by hand
TOLERANCE = 1e-10  # float64 on both sides
SIGMAS = 5  # a statistic within 5 standard deviations of its expectation (a seeded draw: the same every run)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max()).item()


def batch(V: int, B: int, T: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)


# ---- `reference check`: max |a - b| / max |b|, a the engine's, b torch's ----------------------------------------

def test_the_relative_difference_is_the_largest_gap_over_the_references_largest_magnitude():
    """By hand: engine (1, 2, -4) beside torch (1, 3, -2): gaps 0, 1, 2 and max |b| = 3, so 2 / 3 (not 2 / 4,
    over the engine's largest, nor 1, the largest gap over its own element). A float64 gap of 2**-40 is kept whole
    (no rounding to float32 on the way); a zero reference gives 0 without a gap and inf with one."""
    d = difference("t", torch.tensor([1.0, 2.0, -4.0]), torch.tensor([1.0, 3.0, -2.0]))
    assert (d.tensor, d.max_abs, d.max_rel) == ("t", 2.0, 2 / 3)
    tiny = difference("t", torch.tensor([1 + 2**-40, 3.0], dtype=f64), torch.tensor([1.0, 3.0], dtype=f64))
    assert (tiny.max_abs, tiny.max_rel) == (2**-40, 2**-40 / 3)
    zeros = torch.zeros(3)
    assert difference("z", zeros, zeros).max_rel == 0.0
    assert difference("z", torch.tensor([0.0, 1e-30, 0.0]), zeros).max_rel == float("inf")


def test_reference_check_reports_the_known_gaps_of_an_engine_made_to_differ(monkeypatch):
    """An engine made to differ from torch by known amounts (0.5 on the logit largest in magnitude, away from zero;
    0.25 on the loss; 1e-3 on one element of wte's gradient), on a model left in training mode with dropout P:
    check compares without dropout, so every other row is within float64's noise, and those three are the amounts,
    over torch's largest magnitude (the model itself, run here in eval mode, gives it)."""
    torch.manual_seed(0)
    model = perturbed(GPT(ModelConfig(n_layer=2, n_embd=21, n_head=3, vocab_size=29, block_size=9,
                                      dropout=P))).train()
    x, y = batch(29, 2, 9)
    plain = copy.deepcopy(model).double().eval()
    want_logits, want_loss = plain(x, y)
    want_loss.backward()
    want_logits, wte_grad = want_logits.detach(), plain.transformer.wte.weight.grad
    top = want_logits.abs().argmax()
    real_step = rm.step

    def made_to_differ(*args, **kwargs):
        logits, loss, grads = real_step(*args, **kwargs)
        logits.view(-1)[top] += 0.5 * torch.sign(want_logits.view(-1)[top])
        grads["transformer.wte.weight"][3, 4] += 1e-3
        return logits, loss + 0.25, grads
    monkeypatch.setattr(rm, "step", made_to_differ)
    rows = {r.tensor: r for r in compare_engines(model, x, y, "fp64")}
    expected = {"logits": (0.5, want_logits.abs().max().item()), "loss": (0.25, want_loss.abs().item()),
                "grad transformer.wte.weight": (1e-3, wte_grad.abs().max().item())}
    for name, (gap, scale) in expected.items():
        assert rows[name].max_abs == pytest.approx(gap, rel=1e-9), name
        assert rows[name].max_rel == pytest.approx(gap / scale, rel=1e-9), name
    assert len(rows) == 2 + len(list(model.parameters()))
    assert all(r.max_rel <= TOLERANCE for name, r in rows.items() if name not in expected)


def test_check_compares_in_fp32_by_default_and_leaves_the_model_as_it_was():
    """compare_engines without a precision runs the engine and torch in fp32 (gaps of fp32's rounding, not
    float64's), on a copy: the caller's model keeps its frozen parameter frozen and the gradient it held."""
    torch.manual_seed(0)
    model = perturbed(GPT(ModelConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=23, block_size=8)))
    model.transformer.wpe.weight.requires_grad_(False)
    held = torch.full_like(model.lm_head.weight, 0.5)
    model.lm_head.weight.grad = held.clone()
    x, y = batch(23, 2, 8)
    rows = {r.tensor: r for r in compare_engines(model, x, y)}
    assert 1e-9 < rows["logits"].max_rel <= 1e-5
    assert not model.transformer.wpe.weight.requires_grad and model.transformer.wte.weight.requires_grad
    assert torch.equal(model.lm_head.weight.grad, held) and model.transformer.ln_f.weight.grad is None


def test_clipping_no_gradients_returns_torchs_zero_norm():
    """Parameters without gradients (all frozen): a 0-dim zero norm, what torch.nn.utils.clip_grad_norm_ returns."""
    params = [torch.zeros(3, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
    got, torchs = clip_grad_norm(params, 1.0), torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert got.shape == torchs.shape == () and got.item() == torchs.item() == 0.0


@pytest.mark.parametrize("max_norm", [0.5, float("inf")])
def test_clipping_one_gradient_or_at_an_infinite_limit_is_torchs(max_norm):
    """One tensor's gradient of norm 5 (3-4-0 by hand): clipped to 0.5 as torch clips it, or left whole at an
    infinite max_norm; the norm returned is 5 either way."""
    mine, torchs = (torch.zeros(3, dtype=f64, requires_grad=True) for _ in range(2))
    for p in (mine, torchs):
        p.grad = torch.tensor([3.0, 4.0, 0.0], dtype=f64)
    norm, want = clip_grad_norm([mine], max_norm), torch.nn.utils.clip_grad_norm_([torchs], max_norm)
    assert norm.item() == pytest.approx(5.0, rel=1e-15) and want.item() == pytest.approx(5.0, rel=1e-15)
    torch.testing.assert_close(mine.grad, torchs.grad, rtol=1e-15, atol=0)
    assert mine.grad.norm().item() == pytest.approx(min(max_norm, 5.0), rel=1e-5)


def test_clipping_at_zero_is_none_and_gradients_of_two_dtypes_are_refused():
    """max_norm 0 (the training setting for no clipping; torch's own function would zero them): the gradients stay
    3-4-0 and the norm is 5; gradients of fp32 and fp64 together: one line."""
    p = torch.zeros(3, dtype=f64, requires_grad=True)
    p.grad = torch.tensor([3.0, 4.0, 0.0], dtype=f64)
    assert clip_grad_norm([p], 0.0).item() == pytest.approx(5.0, rel=1e-15)
    assert p.grad.tolist() == [3.0, 4.0, 0.0]
    q = torch.zeros(2, requires_grad=True)
    q.grad = torch.ones(2)
    with pytest.raises(ValueError, match="the reference engine clips gradients of one dtype"):
        clip_grad_norm([p, q], 1.0)


def test_the_reference_cache_stays_on_the_cpu_whatever_the_default_device():
    """The engine reads its cache of ids from CPU memory: a NaiveGPT's new_kv_cache is made there even under
    another default device (meta here, the one any machine has)."""
    naive = naive_model(GPT(ModelConfig(n_layer=1, n_embd=8, n_head=2, vocab_size=13, block_size=8)))
    with torch.device("meta"):
        cache = naive.new_kv_cache(2)
    assert {cache.k.device.type, cache.v.device.type, cache.pos.device.type} == {"cpu"}
    assert cache.k.dtype == torch.float32 and cache.k.shape == (1, 2, 1, 8, 1)


# ---- dropout: the engine's own masks ------------------------------------------------------------------------------

DROP_SHAPE = dict(n_layer=2, n_embd=24, n_head=3, vocab_size=31, block_size=32, dropout=P)


def test_the_engines_masks_are_zero_or_one_over_one_minus_p_as_torchs_dropout_is():
    model = GPT(ModelConfig(**DROP_SHAPE))
    masks = rm.DropoutMasks.draw(model, 2, 8, P, f64)
    values = torch.cat([m.flatten() for m in (masks.emb, *masks.attn, *masks.attn_resid, *masks.mlp_resid)])
    assert sorted(values.unique().tolist()) == [0.0, KEPT]
    torchs = F.dropout(torch.ones(4096, dtype=f64), P, training=True)  # the peer's multipliers at the same p
    assert sorted(torchs.unique().tolist()) == [0.0, KEPT]


def test_the_engines_own_masks_drop_a_fraction_p_and_keep_the_mean_multiplier_one():
    """A NaiveGPT's masks in training mode, each of the four kinds (after the embeddings; per block on the attention
    probabilities and on the attention's and the MLP's outputs) on its own: the fraction of zeros within SIGMAS
    standard deviations of a binomial fraction, sqrt(p (1 - p) / n), of P; the mean multiplier within SIGMAS of 1
    (each is 0 or 1 / (1 - p): variance p / (1 - p)); the kept ones all 1 / (1 - p). In eval mode, no masks."""
    torch.manual_seed(11)
    naive = naive_model(GPT(ModelConfig(**DROP_SHAPE)).double()).train()
    B, T = 8, 32
    masks = naive.draw_masks(B, T)
    kinds = {"emb": [masks.emb], "attn": masks.attn, "attn_resid": masks.attn_resid, "mlp_resid": masks.mlp_resid}
    assert [m.shape for m in masks.attn] == [(B, 3, T, T)] * 2 and masks.emb.shape == (B, T, 24)
    for kind, drawn in kinds.items():
        values = torch.cat([m.flatten() for m in drawn])
        n = values.numel()
        zeros = (values == 0).double().mean().item()
        assert abs(zeros - P) <= SIGMAS * (P * (1 - P) / n) ** 0.5, (kind, zeros)
        assert abs(values.mean().item() - 1) <= SIGMAS * (P / (1 - P) / n) ** 0.5, kind
        assert torch.all(values[values != 0] == KEPT), kind
        assert {m.dtype for m in drawn} == {f64}, kind  # the model's dtype: 1 / (1 - p) to float64's precision
    assert naive.eval().draw_masks(B, T) is None


def recording_twins(monkeypatch, seed: int) -> tuple[GPT, GPT, list]:
    """(a trained-looking float64 GPT in training mode with dropout P, its NaiveGPT copy, the list the copy's
    forwards append the masks they draw to)."""
    torch.manual_seed(seed)
    plain = perturbed(GPT(ModelConfig(**{**DROP_SHAPE, "block_size": 9}))).double().train()
    naive = naive_model(copy.deepcopy(plain)).train()
    drawn, draw = [], naive.draw_masks
    monkeypatch.setattr(naive, "draw_masks", lambda B, T: drawn.append(draw(B, T)) or drawn[-1])
    return plain, naive, drawn


def replayed_in_torch(monkeypatch, masks: rm.DropoutMasks) -> list:
    """torch's Dropout made to multiply by `masks` in the order torch's forward applies them; the queue left."""
    from gptlab import model as model_module

    queue = [masks.emb] + [m for layer in zip(masks.attn, masks.attn_resid, masks.mlp_resid) for m in layer]
    monkeypatch.setattr(model_module.Dropout, "forward", lambda self, t: t * queue.pop(0))
    return queue


def test_a_naive_gpt_training_on_its_own_masks_gives_torchs_loss_and_gradients_under_them(monkeypatch):
    """The masks NaiveGPT draws for itself (not torch's replayed): recorded, then handed to torch's dropout in the
    order torch's forward applies them; the loss and every gradient agree in float64."""
    plain, naive, drawn = recording_twins(monkeypatch, 12)
    x, y = batch(31, 3, 9)
    loss = naive(x, y)[1]
    loss.backward()
    (masks,) = drawn
    queue = replayed_in_torch(monkeypatch, masks)
    expected = plain(x, y)[1]
    expected.backward()
    assert not queue and (masks.emb == 0).any()
    assert abs(loss.item() - expected.item()) <= TOLERANCE * expected.item()
    for (name, p), q in zip(plain.named_parameters(), naive.parameters()):
        assert rel(q.grad, p.grad) <= TOLERANCE, name


def test_a_naive_gpt_forward_without_gradients_applies_its_masks_and_keeps_the_last_position(monkeypatch):
    """In training mode without gradients (no targets), the engine still applies the masks the model drew: its
    last-position logits (last_only) equal torch's forward under those masks, in float64."""
    plain, naive, drawn = recording_twins(monkeypatch, 13)
    x, _ = batch(31, 3, 9)
    with torch.no_grad():
        logits = naive(x, last_only=True)[0]
    (masks,) = drawn
    queue = replayed_in_torch(monkeypatch, masks)
    expected = plain(x)[0][:, -1:].detach()  # with gradients: torch's attention applies its Dropout module then
    assert not queue and logits.shape == (3, 1, 31)
    assert rel(logits, expected) <= TOLERANCE


# ---- LayerNorm's epsilon and the other shape settings, off their defaults -----------------------------------------

EPS = 1e-2  # LayerNorm's epsilon: 1e-5 by default, here as large as the variance of the rows it normalises


def test_layernorm_at_a_non_default_epsilon_matches_autograd(reference_engine):
    """Rows of variance about 1e-2: epsilon 1e-2 halves their scale, so an engine that reads 1e-5 is far off."""
    N, C = 6, 13
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(N, C, dtype=f64, generator=gen) * 0.1 + 0.7, torch.randn(N, C, dtype=f64, generator=gen)
    w, b = 1 + 0.3 * torch.randn(C, dtype=f64, generator=gen), 0.3 * torch.randn(C, dtype=f64, generator=gen)
    y, dx, dw, db = (torch.zeros(N, C, dtype=f64), torch.zeros(N, C, dtype=f64), torch.zeros(C, dtype=f64),
                     torch.zeros(C, dtype=f64))
    reference_engine.gptlab_layernorm_f64(*[t.data_ptr() for t in (x, w, b)], N, C, EPS,
                                          *[t.data_ptr() for t in (y, dy, dx, dw, db)])
    xt, wt, bt = (t.clone().requires_grad_() for t in (x, w, b))
    yt = F.layer_norm(xt, (C,), wt, bt, EPS)
    yt.backward(dy)
    assert rel(y, yt) <= TOLERANCE and rel(dx, xt.grad) <= TOLERANCE
    assert rel(dw, wt.grad) <= TOLERANCE and rel(db, bt.grad) <= TOLERANCE
    assert rel(F.layer_norm(x, (C,), w, b, 1e-5), yt) > 0.1  # the epsilon matters here


def test_the_whole_model_at_epsilon_1e_2_without_biases_with_tanh_gelu_and_7_wide_heads_matches_torch():
    """layer_norm_eps 1e-2, bias False, activation gelu_tanh, 5 heads of 7 (n_embd 35), vocabulary 29: the logits,
    the loss and every gradient against the torch model and autograd in float64, on perturbed weights; the same
    model at the default epsilon gives logits far from these (the setting is felt)."""
    cfg = ModelConfig(n_layer=2, n_embd=35, n_head=5, vocab_size=29, block_size=11, bias=False,
                      activation="gelu_tanh", layer_norm_eps=EPS, dropout=0.0)
    torch.manual_seed(13)
    model = perturbed(GPT(cfg)).double()
    x, y = batch(29, 3, 11)
    logits, loss, grads = rm.step(model, x, y, grads=True)
    want_logits, want_loss = model(x, y)
    want_loss.backward()
    assert rel(logits, want_logits) <= TOLERANCE and abs(loss - want_loss.item()) <= TOLERANCE * want_loss.item()
    for name, p in model.named_parameters():
        assert rel(grads[name], p.grad) <= TOLERANCE, name
    assert not any(name.endswith("bias") for name in grads) and len(grads) == 2 + 2 * 6 + 1
    default_eps = GPT(ModelConfig(**{**vars(cfg), "layer_norm_eps": 1e-5})).double()
    default_eps.load_state_dict(model.state_dict())
    assert rel(default_eps(x)[0], want_logits) > 1e-2


# ---- `bench reference`'s clock: each function's time its own -----------------------------------------------------

@contextlib.contextmanager
def ticking(lib):
    """The engine's clock made to tick once per reading (library.tick_clock) for the block, the steady clock after."""
    library.tick_clock(lib, True)
    library.reset_profile(lib)
    try:
        yield
    finally:
        library.tick_clock(lib, False)
        library.reset_profile(lib)


def calls(L: int, tensors: int, backward: bool, optimizer: bool) -> dict[str, float]:
    """The calls of each function in one step of an L-block GPT, counted from the equations (reference.cpp's
    comments): per block two LayerNorms, four Linears (c_attn, attention's c_proj, c_fc, the MLP's c_proj), one
    attention, one GELU, two dropouts; around them the embedding and its dropout, ln_f, the tied head and the loss;
    the backward mirrors each; the optimizer clips once and runs AdamW on each of the `tensors` parameters."""
    forward = {"embedding_forward": 1, "dropout": 1 + 2 * L, "layernorm_forward": 2 * L + 1,
               "linear_forward": 4 * L + 1, "attention_forward": L, "gelu_forward": L, "cross_entropy_forward": 1}
    back = {"embedding_backward": 1, "layernorm_backward": 2 * L + 1, "linear_backward": 4 * L + 1,
            "attention_backward": L, "gelu_backward": L, "cross_entropy_backward": 1}
    out = {name: 0.0 for name in [*forward, *back, "clip_grad_norm", "adamw"]}
    out.update(forward)
    if backward:
        out.update(back, dropout=2 * (1 + 2 * L))
    if optimizer:
        out.update(clip_grad_norm=1, adamw=tensors)
    return {k: float(v) for k, v in out.items()}


def test_each_function_of_the_engine_is_clocked_on_its_own_once_a_call(reference_engine):
    """On the ticking clock a function's total is its calls, exactly, only if no timed function runs inside another
    (the outer would count the inner's ticks too) and each is clocked under its own name: a forward without
    targets, a forward and backward, then the optimizer's clipping and AdamW."""
    torch.manual_seed(14)
    model = perturbed(GPT(ModelConfig(n_layer=3, n_embd=12, n_head=3, vocab_size=13, block_size=7, dropout=0.0)))
    x, y = batch(13, 2, 7)
    tensors = len(list(model.parameters()))
    with ticking(reference_engine):
        rm.step(model, x)
        forward_only = calls(3, tensors, backward=False, optimizer=False)
        assert library.profile(reference_engine) == {**forward_only, "cross_entropy_forward": 0.0}
        library.reset_profile(reference_engine)
        _, _, grads = rm.step(model, x, y, grads=True)
        assert library.profile(reference_engine) == calls(3, tensors, backward=True, optimizer=False)
        library.reset_profile(reference_engine)
        for name, p in model.named_parameters():
            p.grad = grads[name]
        clip_grad_norm(model.parameters(), 0.1)
        naive_optimizer(naive_model(model), TrainConfig(weight_decay=0.1)).step()
        assert library.profile(reference_engine) == {name: float(name in ("clip_grad_norm", "adamw")) * n for name, n
                                                    in calls(3, tensors, True, True).items()}


def test_bench_reference_gives_each_function_its_calls_per_timed_step_on_the_ticking_clock(reference_engine):
    """time_shape itself (a warm-up step, then two timed ones): per timed step, each function's calls as counted
    from the equations, the warm-up's left out, no function missing and none under another's name."""
    from gptlab.bench import reference

    (shape,) = reference.reference_shapes(["char-quick"], tiny=True)
    tensors = len(list(GPT(shape.model).parameters()))
    with ticking(reference_engine):
        result = reference.time_shape(shape, steps=2, warmup=1, peak=None)
    assert result["naive_by_function"] == calls(shape.model.n_layer, tensors, backward=True, optimizer=True)


def test_generation_over_the_cache_runs_on_the_models_own_library_and_refuses_a_cache_of_keys():
    """NaiveGPT's steps over its cache of ids go to engine_library(): a fast rung's for a FastGPT (its clock, ticking,
    counts the products), not the naive engine's; a cache shaped for keys and values (more layers, or heads wider
    than one id) is refused in one line."""
    from gptlab.model import KVCache
    from gptlab.reference import fast

    torch.manual_seed(0)
    model = fast.fast_model(GPT(ModelConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8,
                                            dropout=0.0))).eval()
    lib = fast.fast_library()
    library.reset_profile(lib)
    library.tick_clock(lib, True)  # each reading of the rung's clock one tick: a function's total is its calls
    try:
        model(torch.tensor([[1, 2, 3]]), kv_cache=model.new_kv_cache(1))
    finally:
        library.tick_clock(lib, False)
    assert library.profile(lib)["linear_forward"] > 0
    for cache in (KVCache(2, 1, 1, 8, 1, "cpu"), KVCache(1, 1, 1, 8, 4, "cpu")):
        with pytest.raises(ValueError, match="keeps token ids, not keys and values"):
            model(torch.tensor([[1]]), kv_cache=cache)


def test_training_and_plain_forwards_run_on_the_models_own_library():
    """A FastGPT's training step (the loss with gradients) and its forward without gradients both go to its rung's
    library (its clock, ticking, counts the calls), not the naive engine's."""
    from gptlab.reference import fast

    torch.manual_seed(0)
    model = fast.fast_model(GPT(ModelConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8,
                                            dropout=0.0)))
    lib, naive_lib = fast.fast_library(), library.load_library()
    x, y = batch(13, 2, 8)
    for run in (lambda: model.train()(x, y)[1].backward(), lambda: model.eval()(x)):
        library.reset_profile(lib)
        library.reset_profile(naive_lib)
        library.tick_clock(lib, True)
        library.tick_clock(naive_lib, True)
        try:
            with torch.enable_grad():
                run()
        finally:
            library.tick_clock(lib, False)
            library.tick_clock(naive_lib, False)
        assert library.profile(lib)["linear_forward"] > 0
        assert library.profile(naive_lib)["linear_forward"] == 0
