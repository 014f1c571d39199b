"""The fast engine (reference/fast.py, reference/csrc/fast.cpp), every rung held against the naive engine it was
made from (reference.cpp, fp32): logits, loss and every gradient within TOLERANCE per tensor (max |a - b| / max |b|,
as `gptlab reference check` measures) on odd shapes, past each block edge of the attention, with and without
biases, dropout and ignored targets, in both GELU forms; its products against torch in float64 at sizes below, at
and one past every tile and lane edge; 20 training steps against the naive engine's; and the threaded rungs giving
the same bits run to run and thread count to thread count."""

import ctypes
import itertools
from pathlib import Path

import pytest
import torch

from helpers import FAST_TOLERANCE as TOLERANCE
from helpers import ODD, PAST_BLOCKS, STEP_LOSS_TOLERANCE, fast_batch as batch, relative, sharpened, trained_like
from gptlab import compiled
from gptlab.reference import fast, library
from gptlab.reference import naive_gpt as ng
from gptlab.reference.naive_adamw import NaiveAdamW, clip_grad_norm
from gptlab.optim import param_groups

CASES = {  # name -> (shape, model settings, batch, T, dropout p, a target ignored)
    "odd": (ODD, {}, 2, 7, 0.0, False),
    "odd, gelu_tanh, no biases, dropout, ignored targets": (ODD, dict(activation="gelu_tanh", bias=False), 2, 7, 0.2,
                                                              True),
    "past the attention's blocks": (PAST_BLOCKS, {}, 3, 70, 0.0, True),
    "past the attention's blocks, dropout": (PAST_BLOCKS, dict(activation="gelu_tanh"), 2, 65, 0.1, False),
    "one token": (ODD, {}, 1, 1, 0.0, False),
}


def worst(model, idx, tgt, masks, lib, expected) -> tuple[float, str]:
    """The largest relative difference of the rung's logits, loss and gradients from `expected` (the naive
    engine's), and which tensor it is."""
    logits, loss, grads = ng.step(model, idx, tgt, masks, grads=True, lib=lib)
    ref_logits, ref_loss, ref_grads = expected
    gaps = {"logits": relative(logits, ref_logits), "loss": abs(loss - ref_loss) / abs(ref_loss)}
    gaps.update({name: relative(grads[name], ref_grads[name]) for name in ref_grads})
    name = max(gaps, key=gaps.get)
    return gaps[name], name


@pytest.fixture(scope="module", params=fast.RUNGS)
def rung(request):
    lib = fast.fast_library(request.param)
    fast.use_threads(lib, 2)
    return request.param, lib


@pytest.mark.parametrize("case", CASES)
def test_every_rung_matches_the_naive_engine(rung, case):
    """Each of CASES: heads 7 wide (no lane whole), one token, and T = 65 and 70, past the fused attention's blocks
    of 64 keys and queries; biases or none, both GELU forms, dropout masks, an ignored target."""
    shape, settings, B, T, p, ignored = CASES[case]
    model = sharpened(trained_like({**shape, **settings}))
    idx, tgt = batch(shape["vocab_size"], B, T, ignored)
    masks = ng.DropoutMasks.draw(model, B, T, p, torch.float32) if p else None
    expected = ng.step(model, idx, tgt, masks, grads=True)  # the naive engine, fp32
    gap, name = worst(model, idx, tgt, masks, rung[1], expected)
    assert gap <= TOLERANCE, f"{rung[0]}: {name} differs by {gap:.2e}"



def test_a_head_deeper_than_the_k_tile_matches_the_naive_engine():
    """One head of KC + 1 channels: the fused attention's products over a head take gemm's blocked path (K past one
    tile) instead of the head's packed operands."""
    lib = fast.fast_library("fused")
    width = fast.tiles(lib)["kc"] + 1
    model = sharpened(trained_like(dict(n_layer=1, n_head=1, n_embd=width, vocab_size=11, block_size=8)))
    idx, tgt = batch(11, 2, 7, False)
    gap, name = worst(model, idx, tgt, None, lib, ng.step(model, idx, tgt, grads=True))
    assert gap <= TOLERANCE, f"fused: {name} differs by {gap:.2e}"

@pytest.fixture(scope="module")
def gpt2_step():
    """GPT-2 124M's shape (untied nothing: the LM head is wte), one short batch, and the naive engine's step."""
    model = trained_like(dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024,
                              activation="gelu_tanh"))
    idx, tgt = batch(50257, 1, 5, False)
    return model, idx, tgt, ng.step(model, idx, tgt, grads=True)


def test_every_rung_matches_the_naive_engine_at_gpt2_small(rung, gpt2_step):
    model, idx, tgt, expected = gpt2_step
    gap, name = worst(model, idx, tgt, None, rung[1], expected)
    assert gap <= TOLERANCE, f"{rung[0]}: {name} differs by {gap:.2e}"


def _matmul(lib):
    fn = lib.gptlab_fast_matmul
    L, P = ctypes.c_long, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int] * 3 + [P, L, L, P, L, L, P, L, ctypes.c_int]
    fn.restype = None
    return fn


def edges(lib) -> list[tuple[int, int, int]]:
    """(M, N, K) below, at and one past the kernel's block (MR x NR), its lanes (NR / 2), the cache tiles (MC, KC)."""
    t = fast.tiles(lib)
    mr, nr, lanes, kc, mc = t["mr"], t["nr"], t["nr"] // 2, t["kc"], t["mc"]
    return [(1, 1, 1), (mr - 1, nr - 1, 3), (mr, nr, kc), (mr + 1, nr + 1, kc + 1), (2 * mr + 1, lanes + 1, kc - 1),
            (mc + 1, 2 * nr + lanes - 1, 5), (3, 3 * nr + 1, 2 * kc + 1)]


@pytest.mark.parametrize("layout", ["x W^T", "dy W", "dy^T x"])
def test_the_products_at_every_tile_and_lane_edge(rung, layout):
    """C = [C +] A B for each layout the engine uses, written into a wider C whose other columns must stay
    untouched, against torch in float64."""
    matmul = _matmul(rung[1])
    g = torch.Generator().manual_seed(1)
    for M, N, K in edges(rung[1]):
        for accumulate in (0, 1):
            a = torch.randn(M, K, generator=g) if layout != "dy^T x" else torch.randn(K, M, generator=g)
            b = torch.randn(N, K, generator=g) if layout == "x W^T" else torch.randn(K, N, generator=g)
            A = a if layout != "dy^T x" else a.t()
            Bm = b.t() if layout == "x W^T" else b
            c = torch.full((M, N + 3), float("nan"))
            c[:, :N] = torch.randn(M, N, generator=g)
            expected = A.double() @ Bm.double() + (c[:, :N].double() if accumulate else 0)
            matmul(M, N, K, a.data_ptr(), *A.stride(), b.data_ptr(), *Bm.stride(), c.data_ptr(), N + 3, accumulate)
            assert relative(c[:, :N], expected) <= TOLERANCE, (rung[0], layout, M, N, K, accumulate)
            assert c[:, N:].isnan().all(), f"{rung[0]} wrote past column {N} at {M} x {N} x {K}"


def _train(model, lib, steps: int) -> list[float]:
    """`steps` AdamW steps (clipped at 1.0) of `model` by `lib`'s engine on fixed batches, dropout on; the losses."""
    torch.manual_seed(3)
    opt = NaiveAdamW(param_groups(model.parameters(), 0.1), lr=3e-3, betas=(0.9, 0.99), library=lib)
    model.train()
    losses = []
    for step in range(steps):
        idx, tgt = batch(model.config.vocab_size, 4, 7, step % 5 == 0)  # one batch, learned by heart
        loss = model(idx, tgt)[1]
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0, lib)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_twenty_training_steps_follow_the_naive_engine():
    """AdamW and clipping over tensors below and above the engine's SPREAD (wte 9,600 floats, biases of 48), with
    dropout, one batch learned by heart."""
    start = trained_like(dict(n_layer=2, n_head=3, n_embd=48, vocab_size=200, block_size=8, dropout=0.1))
    naive = ng.NaiveGPT(start.config)
    naive.load_state_dict(start.state_dict())
    naive.draw_masks = lambda B, T: fast.draw_masks(naive, B, T, 0.1, fast.fast_library())  # the fast engine's masks
    expected = _train(naive, library.load_library(), 20)
    for name in fast.RUNGS:
        model = fast.fast_model(ng.GPT(start.config), name)
        model.load_state_dict(start.state_dict())
        losses = _train(model, fast.fast_library(name), 20)
        gap = max(abs(a - b) for a, b in zip(losses, expected))
        assert gap <= STEP_LOSS_TOLERANCE, f"{name}: step losses differ by {gap:.2e}"
    assert expected[-1] < expected[0] - 0.1  # it learned: the comparison is of a moving model


@pytest.mark.parametrize("name", ["threads", "fused"])
def test_the_threaded_rungs_give_the_same_bits_every_run_and_on_any_thread_count(name):
    """Each output is one thread's, in a fixed order: the same bits on 2 threads run after run and on 1 thread, at
    sizes whose elementwise passes (13,440 floats) are past SPREAD, so over the threads."""
    lib = fast.fast_library(name)
    model = trained_like({**PAST_BLOCKS, "n_layer": 2})
    idx, tgt = batch(300, 3, 70, True)
    results = []
    for threads in (2, 2, 1, 2):
        fast.use_threads(lib, threads)
        results.append(ng.step(model, idx, tgt, grads=True, lib=lib))
    fast.use_threads(lib)
    first_logits, first_loss, first_grads = results[0]
    for logits, loss, grads in results[1:]:
        assert torch.equal(logits, first_logits) and loss == first_loss
        assert all(torch.equal(grads[k], first_grads[k]) for k in grads)


def test_a_rung_is_named_and_reports_what_it_is():
    with pytest.raises(ValueError, match="no rung named 'warp': the rungs are loops, tiles, simd, threads, fused"):
        fast.rung_level("warp")
    lib = fast.fast_library("fused")
    fast.use_threads(lib, 2)
    assert lib.gptlab_fast_rung() == 5 and lib.gptlab_fast_threads() == 2
    build = compiled.build_for_cpu()
    vectors = {"x86-64-v3": "avx2", "plain": "generic"}.get(build.name, "avx512" if "v4" in build.name else "neon")
    assert fast.describe_rung(lib) == f"fused (rung 5 of 5), {build.name}, {vectors} vectors, 2 threads"
    below = fast.fast_library("simd")
    fast.use_threads(below, 2)
    assert below.gptlab_fast_threads() == 1  # below the threads rung every loop runs on the calling thread
    assert fast.describe_rung(below).endswith(", 1 thread")
    t = fast.tiles(lib)
    assert t["nr"] % 2 == 0 and t["kc"] % 16 == 0 and t["mc"] % t["mr"] == 0 and t["nc"] % t["nr"] == 0


def test_fp64_is_refused_in_one_line():
    model = trained_like(ODD, dtype=torch.float64)
    idx, tgt = batch(67, 1, 3, False)
    with pytest.raises(ValueError, match="this engine computes in fp32 alone, not torch.float64"):
        ng.step(model, idx, tgt, lib=fast.fast_library("fused"))


def test_the_engines_masks_keep_1_minus_p_at_1_over_1_minus_p_and_follow_torchs_seed():
    """The masks the fast engine draws: 0 or 1 / (1 - p) (torch's dropout's values), a fraction p of zeros
    (within 5 standard deviations over 2**20 draws), the same under the same torch.manual_seed and different
    tensor by tensor and seed by seed."""
    model = trained_like({**ODD, "dropout": 0.3})
    lib = fast.fast_library()
    torch.manual_seed(7)
    first = fast.draw_masks(model, 16, 8, 0.3, lib)
    torch.manual_seed(7)
    again = fast.draw_masks(model, 16, 8, 0.3, lib)
    other = fast.draw_masks(model, 16, 8, 0.3, lib)
    assert torch.equal(first.attn[1], again.attn[1]) and torch.equal(first.emb, again.emb)
    assert not torch.equal(first.attn[0], first.attn[1]) and not torch.equal(first.attn[0], other.attn[0])
    seen = {tuple(fast.draw_masks(model, 1, 2, 0.5, lib).emb.flatten().tolist()) for _ in range(60)}
    assert len(seen) == 60  # a new seed every forward (2 x 21 draws each: a repeat means a repeated seed)
    big = torch.empty(1 << 20)
    lib.gptlab_fast_masks(3, 0, 0.3, big.data_ptr(), big.numel())
    assert set(big.unique().tolist()) == {0.0, torch.tensor(1 / 0.7, dtype=torch.float32).item()}
    zeros, n = (big == 0).sum().item(), big.numel()
    assert abs(zeros - 0.3 * n) <= 5 * (n * 0.3 * 0.7) ** 0.5
    other = torch.empty(1 << 20)
    lib.gptlab_fast_masks(3, 1, 0.3, other.data_ptr(), other.numel())  # the next stream of the same seed
    for a, b in (((big == 0), (other == 0)), ((big[:-1] == 0), (big[1:] == 0))):  # streams, neighbours: independent
        both, n = (a & b).sum().item(), a.numel()
        assert abs(both - 0.09 * n) <= 5 * (n * 0.09 * 0.91) ** 0.5


def test_a_fast_model_draws_its_masks_into_one_buffer_it_keeps():
    """FastGPT.draw_masks: the masks fast.draw_masks draws under the same seed, laid end to end in one buffer the
    model keeps and draws into again (grown for a larger batch); a buffer too small for the shapes is refused."""
    model = fast.fast_model(trained_like({**ODD, "dropout": 0.2})).train()
    lib = fast.fast_library()
    torch.manual_seed(4)
    kept = model.draw_masks(3, 5)
    torch.manual_seed(4)
    fresh = fast.draw_masks(model, 3, 5, 0.2, lib)
    flat = lambda m: [m.emb, *m.attn, *m.attn_resid, *m.mlp_resid]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(flat(kept), flat(fresh), strict=True))
    start = kept.emb.data_ptr()
    assert [t.data_ptr() - start for t in flat(kept)] == list(itertools.accumulate(
        [0] + [4 * t.numel() for t in flat(kept)][:-1]))  # end to end, in the order drawn
    assert fast.mask_floats(model, 3, 5) == sum(t.numel() for t in flat(kept)) == 3 * 5 * 21 * 5 + 2 * 3 * 3 * 25
    again = model.draw_masks(3, 5)
    assert again.emb.data_ptr() == start and not torch.equal(again.attn[0], fresh.attn[0])  # drawn anew, in place
    assert model.draw_masks(2, 4).emb.data_ptr() == start  # smaller: the same buffer
    grown = model.draw_masks(4, 6)
    assert all(t.shape[0] == 4 and t.shape[-1] in (6, 21) for t in flat(grown))
    with pytest.raises(ValueError, match="cannot hold the masks of 3 x 5"):
        fast.draw_masks(model, 3, 5, 0.2, lib, into=torch.empty(fast.mask_floats(model, 3, 5) - 1))


def test_a_fast_model_draws_no_masks_without_dropout_or_in_eval_mode_and_computes_gpts_alone():
    model = fast.fast_model(trained_like({**ODD, "dropout": 0.0}))
    model.train()
    assert model.draw_masks(2, 3) is None  # dropout 0: no masks, even in training mode
    model.config.dropout = 0.2
    assert model.draw_masks(2, 3) is not None
    model.eval()
    assert model.draw_masks(2, 3) is None
    with pytest.raises(TypeError, match="the fast engine computes a GPT, not a Linear"):
        fast.fast_model(torch.nn.Linear(2, 2))


def test_the_fast_optimizer_is_the_rungs_adamw_at_the_runs_settings():
    from gptlab.config import TrainConfig

    cfg = TrainConfig(lr=3e-3, beta1=0.8, beta2=0.9, weight_decay=0.25)
    model = trained_like(ODD)
    opt = fast.fast_optimizer(model, cfg, "simd")
    assert opt.library is fast.fast_library("simd")
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in opt.param_groups] == [
        (3e-3, (0.8, 0.9), 0.25), (3e-3, (0.8, 0.9), 0.0)]
    lib = fast.fast_library("simd")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    library.tick_clock(lib, True)  # each reading of the rung's clock one tick: a function's total is its calls
    library.reset_profile(lib)
    try:
        opt.step()
        assert library.profile(lib)["adamw"] == len(list(model.parameters()))  # the rung's AdamW, once a tensor
    finally:
        library.tick_clock(lib, False)


def test_a_rung_is_built_for_the_build_it_names_and_again_when_the_vector_layer_changes(monkeypatch, tmp_path):
    """build_fast's compile request (compiled.build_shared, recorded; the loops rung's library stands in for what it
    would build): the named build, as a name or a Build, in the library's name and flags with the rung's level; the
    vector layer's text in the build's key, so an edit of simd.h builds the rung again."""
    seen, built = [], fast.fast_library("loops")._name

    def build_shared(source, flags, folder, prefix, key=""):
        seen.append((tuple(flags), prefix, key, folder))
        return Path(built)
    monkeypatch.setattr(compiled, "build_shared", build_shared)
    lib = fast.build_fast("loops", "plain", folder=tmp_path)
    fast.build_fast("loops", compiled.BUILDS["plain"], folder=tmp_path)
    (tmp_path / "simd.h").write_text(fast.VECTORS.read_text() + "// another vector layer\n")
    monkeypatch.setattr(fast, "VECTORS", tmp_path / "simd.h")
    fast.build_fast("loops", "plain", folder=tmp_path)
    assert lib.gptlab_build == "plain" and fast.describe_rung(lib).startswith("loops (rung 1 of 5), plain, ")
    assert [s[1] for s in seen] == ["fast-loops-plain"] * 3 and all(s[3] == tmp_path for s in seen)
    assert seen[0][0] == seen[1][0] == (*fast.FAST_FLAGS, "-DGPTLAB_RUNG=1")
    assert seen[0][2] == seen[1][2] != seen[2][2]
