"""The naive C++ engine (gptlab.reference) held to outside references: each piece's backward to torch autograd in
float64, every parameter's gradient to central differences, the whole model in fp32 to gptlab's torch model and to a
Hugging Face GPT-2, and 20 optimizer steps (clipping, accumulation, the schedule, AdamW) to the torch path's.

The norm of every comparison: max |a - b| / max |b| over a tensor (b the reference)."""

import ctypes
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import HF_SHAPES, hf_folder, perturbed
from gptlab.config import ModelConfig, TrainConfig
from gptlab.data.batches import Dataset
from gptlab.hf.gpt2_folders import load_hf_model
from gptlab.model import GPT, MLP, Block
from gptlab.optim import make_optimizer
from gptlab.reference import library
from gptlab.reference import naive_gpt as rm
from gptlab.reference.naive_training import naive_model, naive_optimizer
from gptlab.training.step import StepContext, train_step

pytestmark = pytest.mark.usefixtures("reference_engine")
f64 = torch.float64
PIECE_TOLERANCE = 1e-10  # check 1: float64 on both sides
# check 2: central differences in double, step h, of fourth order: (-L(+2h) + 8 L(+h) - 8 L(-h) + L(-2h)) / 12h.
# The plain (L(+h) - L(-h)) / 2h is limited by the loss's rounding (about 1e-15): at h = 1e-5 it reached 6e-7 of
# the 1e-6 allowed on the smallest gradients, where this stencil at h = 1e-3 stays near 2e-8
FD_TOLERANCE, FD_STEP = 1e-6, 1e-3
FP32_TOLERANCE = 1e-5  # check 3: the whole model in fp32
STEPS_F64_TOLERANCE, STEPS_F32_TOLERANCE = 1e-10, 1e-4  # check 4: 20 optimizer steps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max()).item()


def P(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def randn(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, dtype=f64, generator=torch.Generator().manual_seed(seed)) * scale


# ---- check 1: each piece's backward against torch autograd in float64 ----

@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_forward_and_backward_match_autograd(reference_engine, bias):
    N, C, eps = 6, 13, 1e-5
    x, dy = randn(N, C, scale=2.0, seed=1) + 0.7, randn(N, C, seed=2)
    w, b = 1 + randn(C, scale=0.3, seed=3), (randn(C, scale=0.3, seed=4) if bias else None)
    y, dx, dw, db = torch.empty(N, C, dtype=f64), torch.empty(N, C, dtype=f64), torch.zeros(C, dtype=f64), \
        torch.zeros(C, dtype=f64)
    reference_engine.gptlab_layernorm_f64(P(x), P(w), P(b), N, C, eps, P(y), P(dy), P(dx), P(dw), P(db if bias else None))
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    bt = b.clone().requires_grad_() if bias else None
    yt = F.layer_norm(xt, (C,), wt, bt, eps)
    yt.backward(dy)
    assert rel(y, yt) <= PIECE_TOLERANCE
    assert rel(dx, xt.grad) <= PIECE_TOLERANCE and rel(dw, wt.grad) <= PIECE_TOLERANCE
    if bias:
        assert rel(db, bt.grad) <= PIECE_TOLERANCE


def torch_attention(qkv: torch.Tensor, H: int, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), -inf above the diagonal) (times the dropout multipliers) v, heads side by side."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, dim=2))
    if mask is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        s = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        y = (F.softmax(s, dim=-1) * mask) @ v
    return y.transpose(1, 2).reshape(B, T, C)


@pytest.mark.parametrize("dropout", [False, True])
def test_attention_forward_and_backward_match_autograd(reference_engine, dropout):
    B, T, C, H = 2, 9, 15, 3
    qkv, dy = randn(B, T, 3 * C, seed=5), randn(B, T, C, seed=6)
    mask = ((torch.rand(B, H, T, T, generator=torch.Generator().manual_seed(7)) > 0.3).to(f64) / 0.7
            if dropout else None)
    y, dqkv = torch.empty(B, T, C, dtype=f64), torch.empty(B, T, 3 * C, dtype=f64)
    reference_engine.gptlab_attention_f64(P(qkv), P(mask), B, T, C, H, P(y), P(dy), P(dqkv))
    qt = qkv.clone().requires_grad_()
    yt = torch_attention(qt, H, mask)
    yt.backward(dy)
    assert rel(y, yt) <= PIECE_TOLERANCE and rel(dqkv, qt.grad) <= PIECE_TOLERANCE


def test_attention_never_looks_ahead(reference_engine):
    """Changing the last position's q, k and v changes no earlier output (the causal mask), and the gradient
    flowing from the first position's output reaches only the first position."""
    B, T, C, H = 1, 6, 12, 3
    qkv = randn(B, T, 3 * C, seed=8)
    later = qkv.clone()
    later[:, -1] += 5.0
    y1, y2 = torch.empty(B, T, C, dtype=f64), torch.empty(B, T, C, dtype=f64)
    reference_engine.gptlab_attention_f64(P(qkv), None, B, T, C, H, P(y1), None, None)
    reference_engine.gptlab_attention_f64(P(later), None, B, T, C, H, P(y2), None, None)
    assert torch.equal(y1[:, :-1], y2[:, :-1]) and not torch.equal(y1[:, -1], y2[:, -1])
    dy, dqkv = torch.zeros(B, T, C, dtype=f64), torch.empty(B, T, 3 * C, dtype=f64)
    dy[:, 0] = 1.0
    reference_engine.gptlab_attention_f64(P(qkv), None, B, T, C, H, P(y1), P(dy), P(dqkv))
    assert dqkv[:, 1:].abs().max() == 0 and dqkv[:, 0].abs().max() > 0


@pytest.mark.parametrize("form", ["none", "tanh"])
def test_gelu_and_its_derivative_match_autograd(reference_engine, form):
    x = torch.linspace(-7, 7, 301, dtype=f64)
    dy = randn(301, seed=9)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    reference_engine.gptlab_gelu_f64(P(x), 301, int(form == "tanh"), P(y), P(dy), P(dx))
    xt = x.clone().requires_grad_()
    yt = F.gelu(xt, approximate=form)
    yt.backward(dy)
    assert rel(y, yt) <= PIECE_TOLERANCE and rel(dx, xt.grad) <= PIECE_TOLERANCE


@pytest.mark.parametrize("activation,bias", [("gelu", True), ("gelu_tanh", False)])
def test_mlp_forward_and_backward_match_autograd(reference_engine, activation, bias):
    N, C = 7, 10
    mlp = perturbed(MLP(ModelConfig(n_embd=C, n_head=2, bias=bias, activation=activation, dropout=0.0))).double()
    x, dy = randn(N, C, seed=10), randn(N, C, seed=11)
    fc_w, fc_b, pr_w, pr_b = mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias
    grads = [torch.zeros_like(t) if t is not None else None for t in (fc_w, fc_b, pr_w, pr_b)]
    y, dx = torch.empty(N, C, dtype=f64), torch.empty(N, C, dtype=f64)
    reference_engine.gptlab_mlp_f64(P(x), P(fc_w), P(fc_b), P(pr_w), P(pr_b), N, C, int(activation == "gelu_tanh"),
                                    P(y), P(dy), P(dx), *[P(g) for g in grads])
    xt = x.clone().requires_grad_()
    yt = mlp(xt)
    yt.backward(dy)
    assert rel(y, yt) <= PIECE_TOLERANCE and rel(dx, xt.grad) <= PIECE_TOLERANCE
    for g, t in zip(grads, (fc_w, fc_b, pr_w, pr_b)):
        if t is not None:
            assert rel(g, t.grad) <= PIECE_TOLERANCE


def test_cross_entropy_and_its_gradient_match_autograd(reference_engine):
    N, V = 9, 67
    logits = randn(N, V, scale=3.0, seed=12)
    targets = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(13))
    targets[[2, 5]] = -1  # ignored rows: left out of the mean, no gradient
    dlogits = torch.empty_like(logits)
    loss = reference_engine.gptlab_cross_entropy_f64(P(logits), P(targets), N, V, P(dlogits))
    lt = logits.clone().requires_grad_()
    expected = F.cross_entropy(lt, targets, ignore_index=-1)
    expected.backward()
    assert abs(loss - expected.item()) <= PIECE_TOLERANCE * abs(expected.item())
    assert rel(dlogits, lt.grad) <= PIECE_TOLERANCE and dlogits[[2, 5]].abs().max() == 0


def layer_struct(block: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> library.Layer:
    """A Layer struct over one Block's tensors (or gradients), named as the block names its parameters."""
    names = {field: name.removeprefix("transformer.h.0.") for field, name in rm.layer_names(0).items()}
    return library.Layer(**{field: tensors[name].data_ptr() if name in tensors else None for field, name in names.items()})


@pytest.mark.parametrize("bias,activation", [(True, "gelu"), (False, "gelu_tanh")])
def test_one_block_matches_autograd(reference_engine, bias, activation):
    B, T, C, H = 2, 7, 12, 3
    cfg = ModelConfig(n_embd=C, n_head=H, bias=bias, activation=activation, dropout=0.0, block_size=T, vocab_size=5)
    block = perturbed(Block(cfg)).double()
    x, dy = randn(B, T, C, seed=14), randn(B, T, C, seed=15)
    params = {n: p.detach() for n, p in block.named_parameters()}
    grads = {n: torch.zeros_like(p) for n, p in params.items()}
    model = library.Model(n_layer=1, n_head=H, n_embd=C, vocab_size=5, block_size=T,
                         gelu_tanh=int(activation == "gelu_tanh"), eps=cfg.layer_norm_eps)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    w, g = layer_struct(block, params), layer_struct(block, grads)
    reference_engine.gptlab_block_f64(ctypes.byref(model), ctypes.byref(w), ctypes.byref(g), None, B, T, P(x), P(y),
                                      P(dy), P(dx))
    xt = x.clone().requires_grad_()
    yt = block(xt)
    yt.backward(dy)
    assert rel(y, yt) <= PIECE_TOLERANCE and rel(dx, xt.grad) <= PIECE_TOLERANCE
    for name, p in block.named_parameters():
        assert rel(grads[name], p.grad) <= PIECE_TOLERANCE, name


# ---- check 2: every parameter's gradient against central differences, in double ----

FD_SHAPE = dict(n_layer=2, n_embd=12, n_head=3, block_size=7, vocab_size=13, bias=True, dropout=0.0)


def test_every_gradient_matches_central_differences(reference_engine):
    """Biases on, dropout masks given (fixed, so the loss is a function of the weights alone). Every element of
    each tensor, or 200 drawn from the larger ones; |fd - an| / max(|fd|, |an|, 1e-3 max|g| of the tensor)."""
    torch.manual_seed(0)
    model = perturbed(GPT(ModelConfig(**FD_SHAPE))).double()
    B, T = 2, 7
    idx = torch.randint(0, 13, (B, T))
    targets = torch.randint(0, 13, (B, T))
    masks = rm.DropoutMasks.draw(model, B, T, 0.2, f64)
    _, _, grads = rm.step(model, idx, targets, masks, grads=True)
    pick = torch.Generator().manual_seed(1)
    worst = 0.0
    for name, p in model.named_parameters():
        flat, g = p.data.view(-1), grads[name].view(-1)
        chosen = range(flat.numel()) if flat.numel() <= 200 else torch.randperm(flat.numel(), generator=pick)[:200]
        floor = 1e-3 * g.abs().max().item()
        for i in chosen:
            i = int(i)
            keep, losses = flat[i].item(), []
            for k in (2, 1, -1, -2):
                flat[i] = keep + k * FD_STEP
                losses.append(rm.step(model, idx, targets, masks)[1])
            flat[i] = keep
            fd = (-losses[0] + 8 * losses[1] - 8 * losses[2] + losses[3]) / (12 * FD_STEP)
            an = g[i].item()
            error = abs(fd - an) / max(abs(fd), abs(an), floor)
            worst = max(worst, error)
            assert error < FD_TOLERANCE, (name, i, fd, an)
    assert worst > 0  # the differences were computed, not skipped


# ---- check 3: the whole model in fp32 against gptlab's torch model and a Hugging Face GPT-2 ----

def engine_vs_torch(model: GPT, B: int, T: int) -> dict[str, float]:
    """The relative difference of the logits, the loss and every gradient: the engine against `model`'s forward
    and autograd, in the model's dtype, on one seeded batch."""
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    idx, targets = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    logits, loss, grads = rm.step(model, idx, targets, grads=True)
    model.zero_grad()
    expected_logits, expected_loss = model(idx, targets)
    expected_loss.backward()
    out = {"logits": rel(logits, expected_logits), "loss": abs(loss - expected_loss.item()) / abs(expected_loss.item())}
    out.update({name: rel(grads[name], p.grad) for name, p in model.named_parameters()})
    return out


ODD_SHAPES = {
    "21 wide, 3 heads, vocabulary 67, biases, exact GELU": dict(n_layer=2, n_embd=21, n_head=3, vocab_size=67,
                                                                block_size=16, bias=True, activation="gelu"),
    "no biases, tanh GELU, 5 heads": dict(n_layer=3, n_embd=35, n_head=5, vocab_size=67, block_size=16, bias=False,
                                          activation="gelu_tanh"),
}


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_the_whole_model_in_fp32_matches_the_torch_model(shape):
    """Weights moved off their init (vectors by 0.3, everything by 0.1), then a few torch AdamW steps."""
    torch.manual_seed(4)
    model = perturbed(GPT(ModelConfig(dropout=0.0, **ODD_SHAPES[shape])))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(3):
        idx = torch.randint(0, 67, (3, 16))
        model(idx, torch.roll(idx, -1, 1))[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    errors = engine_vs_torch(model, 3, 11)
    assert max(errors.values()) <= FP32_TOLERANCE, errors


def test_an_imported_hugging_face_gpt2_in_fp32_matches_the_torch_model(tmp_path):
    model = perturbed(load_hf_model(hf_folder(tmp_path / "hf", **HF_SHAPES["5-heads-60-wide"]))).train()
    model.config.dropout = 0.0
    errors = engine_vs_torch(model, 2, 13)
    assert max(errors.values()) <= FP32_TOLERANCE, errors


def test_the_naive_gpt_trains_and_scores_as_a_gpt(tmp_path):
    """NaiveGPT's loss.backward() leaves the engine's gradients, scaled by the incoming gradient (gradient
    accumulation), in .grad; without targets it gives the logits alone, and over its cache of token ids the same
    logits; it refuses a cache of keys and values."""
    torch.manual_seed(5)
    model = perturbed(GPT(ModelConfig(**FD_SHAPE))).double()
    idx, targets = torch.randint(0, 13, (2, 7)), torch.randint(0, 13, (2, 7))
    _, _, grads = rm.step(model, idx, targets, grads=True)
    naive = naive_model(model)
    (naive(idx, targets)[1] * 0.25).backward()
    (naive(idx, targets)[1] * 0.5).backward()
    for name, p in naive.named_parameters():
        assert rel(p.grad, 0.75 * grads[name]) <= 1e-14, name
    logits, loss = naive(idx)
    assert loss is None and logits.shape == (2, 7, 13)
    cache = naive.new_kv_cache(2)  # token ids, not keys and values: each call recomputes the rows' windows
    first, rest = naive(idx[:, :4], kv_cache=cache)[0], naive(idx[:, 4:], kv_cache=cache, last_only=True)[0]
    assert rel(first, logits[:, :4]) <= 1e-14 and rel(rest, logits[:, -1:]) <= 1e-14 and cache.pos.tolist() == [7, 7]
    with pytest.raises(ValueError, match="not keys and values"):
        naive(idx, kv_cache=GPT.new_kv_cache(naive, 2))


# ---- check 4: 20 optimizer steps beside the torch path ----

def dataset(vocab: int) -> Dataset:
    tokens = np.random.default_rng(0).integers(0, vocab, 4000).astype(np.uint16)
    return Dataset(path=None, train=tokens[:3000], val=tokens[3000:], tokenizer=None, meta={})


def capture_dropout(monkeypatch) -> list[torch.Tensor]:
    """torch's dropout made to record its multipliers, in the order the forward applies them."""
    from gptlab import model as model_module

    drawn: list[torch.Tensor] = []

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        mask = (torch.rand(x.shape) >= self.p).to(x.dtype) / (1 - self.p)
        drawn.append(mask)
        return x * mask
    monkeypatch.setattr(model_module.Dropout, "forward", forward)
    return drawn


def replay(drawn: list[torch.Tensor], n_layer: int):
    """The engine's mask source: each forward takes the next forward's masks torch drew (embeddings, then per
    block the attention probabilities, the attention's output, the MLP's output)."""
    def draw_masks(B, T):
        emb, rest = drawn.pop(0), [drawn.pop(0) for _ in range(3 * n_layer)]
        return rm.DropoutMasks(emb, rest[0::3], rest[1::3], rest[2::3])
    return draw_masks


@pytest.mark.parametrize("dtype,dropout", [(torch.float64, 0.0), (torch.float64, 0.2), (torch.float32, 0.0),
                                           (torch.float32, 0.2)])
def test_twenty_steps_match_the_torch_path(monkeypatch, dtype, dropout):
    """train_step itself on both sides (two micro-steps, clipping that bites, warm-up then cosine decay, weight
    decay on the matrices): the same losses and weights. With dropout, the masks torch draws are handed to the
    engine."""
    shape = dict(n_layer=2, n_embd=21, n_head=3, vocab_size=37, block_size=12, bias=True, dropout=dropout)
    cfg = TrainConfig(batch_size=3, grad_accum=2, max_steps=20, lr=3e-2, min_lr=3e-3, warmup_steps=4,
                      weight_decay=0.1, grad_clip=0.5, precision="fp32", device="cpu")
    ctx = StepContext(dataset(37), cfg, 12, torch.device("cpu"), "fp32")
    torch.manual_seed(6)
    plain = perturbed(GPT(ModelConfig(**shape))).to(dtype).train()
    naive = naive_model(perturbed(GPT(ModelConfig(**shape))).to(dtype).train())
    naive.load_state_dict(plain.state_dict())
    drawn = capture_dropout(monkeypatch)
    if dropout:
        naive.draw_masks = replay(drawn, 2)
    optimizers = make_optimizer(plain, cfg), naive_optimizer(naive, cfg)
    clipped = 0
    for step in range(20):
        expected, norm = train_step(plain, optimizers[0], ctx, step)
        loss, naive_norm = train_step(naive, optimizers[1], ctx, step)
        clipped += norm.item() > cfg.grad_clip
        tolerance = STEPS_F64_TOLERANCE if dtype == torch.float64 else STEPS_F32_TOLERANCE
        assert abs(loss.item() - expected.item()) <= tolerance * abs(expected.item()), step
        assert abs(naive_norm.item() - norm.item()) <= tolerance * norm.item(), step
    assert not drawn and clipped > 0
    if dtype == torch.float64:
        for (name, p), q in zip(plain.named_parameters(), naive.parameters()):
            assert rel(q, p) <= STEPS_F64_TOLERANCE, name


def test_the_engines_optimizer_decays_exactly_the_tensors_the_torch_path_decays():
    model = naive_model(GPT(ModelConfig(**FD_SHAPE)))
    optimizer = naive_optimizer(model, TrainConfig(weight_decay=0.1))
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert names == {n for n, p in model.named_parameters() if n.endswith("weight") and "ln_" not in n}
    assert "transformer.wte.weight" in names and "transformer.h.0.ln_1.weight" not in names


def test_in_eval_mode_the_naive_gpt_has_no_dropout_and_keeps_its_dtype():
    """A model with dropout 0.2 in eval mode: the torch model's logits (no masks drawn), and an fp64 model's loss
    as fp64, the engine's own value."""
    torch.manual_seed(7)
    plain = perturbed(GPT(ModelConfig(**{**FD_SHAPE, "dropout": 0.2}))).double().eval()
    naive = naive_model(perturbed(GPT(ModelConfig(**{**FD_SHAPE, "dropout": 0.2}))).double()).eval()
    naive.load_state_dict(plain.state_dict())
    idx, targets = torch.randint(0, 13, (2, 7)), torch.randint(0, 13, (2, 7))
    with torch.no_grad():
        logits, loss = naive(idx, targets)
        expected_logits, expected_loss = plain(idx, targets)
    assert rel(logits, expected_logits) <= PIECE_TOLERANCE
    assert loss.dtype == torch.float64 and loss.item() == rm.step(naive, idx, targets)[1]
    assert abs(loss.item() - expected_loss.item()) <= PIECE_TOLERANCE


def test_ids_and_targets_outside_the_vocabulary_are_refused():
    """The engine checks what it indexes with: a token id outside the vocabulary, a target neither an id nor -1
    (torch's cross-entropy ignores -1 alone); a -1 target is scored as ignored."""
    model = GPT(ModelConfig(**FD_SHAPE))
    idx, targets = torch.randint(0, 13, (2, 7)), torch.randint(0, 13, (2, 7))
    with pytest.raises(ValueError, match="a token id outside the vocabulary of 13"):
        rm.step(model, torch.where(idx == idx[0, 0], 13, idx), targets)
    for bad in (13, -2):
        wrong = targets.clone()
        wrong[1, 3] = bad
        with pytest.raises(ValueError, match="a target that is neither -1 .ignored. nor a token id of the vocabulary "
                                             "of 13"):
            rm.step(model, idx, wrong)
    ignored = targets.clone()
    ignored[1, 3] = -1
    logits, loss, _ = rm.step(model, idx, ignored)
    assert abs(loss - F.cross_entropy(logits.view(-1, 13), ignored.view(-1), ignore_index=-1).item()) <= 1e-6


def test_masks_of_another_dtype_are_converted_and_a_model_that_is_not_a_gpt_is_refused(reference_engine):
    """Dropout masks drawn in fp32 for a float64 model give the float64 masks' results (the engine reads them in
    the model's scalar type); a Bigram is not a GPT the engine can compute."""
    from gptlab.model import Bigram

    torch.manual_seed(4)
    model = perturbed(GPT(ModelConfig(**FD_SHAPE))).double()
    idx, targets = torch.randint(0, 13, (2, 7)), torch.randint(0, 13, (2, 7))
    masks = rm.DropoutMasks.draw(model, 2, 7, 0.3, torch.float32)
    as_f64 = rm.DropoutMasks(masks.emb.double(), [m.double() for m in masks.attn],
                             [m.double() for m in masks.attn_resid], [m.double() for m in masks.mlp_resid])
    logits, loss, _ = rm.step(model, idx, targets, masks)
    expected_logits, expected_loss, _ = rm.step(model, idx, targets, as_f64)
    assert torch.equal(logits, expected_logits) and loss == expected_loss
    with pytest.raises(TypeError, match="the reference engine computes a GPT, not a Bigram"):
        naive_model(Bigram(ModelConfig(vocab_size=13, block_size=7, arch="bigram")))
