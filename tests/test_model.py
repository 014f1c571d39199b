import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_config
from gptlab.config import ModelConfig, build, get_preset
from gptlab.data.batches import load_dataset
from gptlab.model import GPT, Bigram, KVCache, _attention_mask, build_model

SHAPES = [  # (n_layer, n_head, n_embd, block_size, batch, T)
    (1, 1, 8, 8, 1, 8),
    (2, 2, 32, 16, 3, 11),
    (2, 3, 48, 32, 2, 32),
    (1, 5, 40, 20, 4, 1),
]


def paths_pair(**overrides):
    naive = GPT(tiny_config(attention="naive", **overrides)).eval()
    sdpa = GPT(tiny_config(attention="sdpa", **overrides)).eval()
    sdpa.load_state_dict(naive.state_dict())
    return naive, sdpa


@pytest.mark.parametrize("n_layer, n_head, n_embd, block_size, B, T", SHAPES)
def test_naive_and_sdpa_attention_agree(n_layer, n_head, n_embd, block_size, B, T):
    naive, sdpa = paths_pair(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size)
    idx = torch.randint(0, 50, (B, T))
    a, b = naive(idx)[0], sdpa(idx)[0]
    assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_written_out_attention_masks_by_adding_minus_infinity_exactly_as_masked_fill_would(dtype, causal):
    """The mask is added as a bias (0 / -inf) rather than filled in: the same output and the same gradients of
    q, k and v, bit for bit, in fp32 and bf16, on odd shapes, with the causal mask and with a cache's ragged one."""
    torch.manual_seed(0)
    attn = GPT(tiny_config(n_head=3, n_embd=48, attention="naive")).transformer.h[0].attn
    B, H, T, S, D = 3, 3, 7, 7 if causal else 11, 16
    q, k, v = (torch.randn(B, H, n, D, dtype=dtype, requires_grad=True) for n in (T, S, S))
    mask = None if causal else _attention_mask(torch.tensor([4, 0, 2]), T, S)  # rows cached to ragged lengths
    g = torch.randn(B, H, T, D, dtype=dtype)

    def written_with_masked_fill():
        att = (q * (1.0 / math.sqrt(D))) @ k.transpose(-2, -1)
        visible = torch.ones(T, S, dtype=torch.bool).tril() if causal else mask
        return F.softmax(att.masked_fill(~visible, float("-inf")), dim=-1) @ v

    outs, grads = [], []
    for attend in (lambda: attn._naive(q, k, v, mask, causal), written_with_masked_fill):
        y = attend()
        outs.append(y)
        grads.append(torch.autograd.grad(y, (q, k, v), g))
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_causality_changing_token_t_leaves_earlier_logits_unchanged(attention):
    model = GPT(tiny_config(attention=attention)).eval()
    idx = torch.randint(0, 50, (2, 16))
    for t in (0, 5, 15):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 50
        before, after = model(idx)[0], model(changed)[0]
        assert torch.equal(before[:, :t], after[:, :t])
        assert not torch.allclose(before[:, t:], after[:, t:])


def test_auto_attention_uses_the_written_out_path_only_for_cpu_training_in_bf16_or_with_dropout():
    model = GPT(tiny_config(attention="auto"))
    attn = model.transformer.h[0].attn
    q = torch.zeros(1, 1, 1, 1)
    assert not attn._naive_is_faster(q)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attn._naive_is_faster(q)
        with torch.no_grad():
            assert not attn._naive_is_faster(q)
    attn = GPT(tiny_config(attention="auto", dropout=0.1)).transformer.h[0].attn
    assert attn._naive_is_faster(q)
    assert not attn.eval()._naive_is_faster(q)


def test_gpt_overfits_one_batch():
    model = GPT(tiny_config(n_layer=1, n_embd=64, n_head=4))
    x = torch.randint(0, 50, (4, 16))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


def test_dropout_is_active_in_training_and_off_in_eval():
    model = GPT(tiny_config(dropout=0.5))
    idx = torch.randint(0, 50, (2, 16))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_cpu_dropout_keeps_1_minus_p_of_the_elements_and_scales_them_like_torch(p):
    from gptlab.ops import Dropout

    x = torch.ones(64, 1000, 33, dtype=torch.bfloat16, requires_grad=True)  # odd size: words cut mid-way
    torch.manual_seed(3)
    y = Dropout(p)(x)
    kept = y != 0
    lanes = kept.flatten()[:kept.numel() // 4 * 4].view(-1, 4).float().mean(0)  # the 4 slices of each word
    assert (lanes - (1 - p)).abs().max() < 5e-3  # 528k elements each: sd < 7e-4
    assert (y[kept] == torch.tensor(1 / (1 - p), dtype=torch.bfloat16)).all()
    y.float().sum().backward()
    assert torch.equal(x.grad, y.detach())  # d(x * mask * scale)/dx = mask * scale
    torch.manual_seed(3)
    assert torch.equal(Dropout(p)(x), y)  # torch.manual_seed decides the mask
    assert torch.equal(Dropout(p).eval()(x), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_dropout_draws_the_mask_it_always_has(dtype):
    """The mask and scaling, bit for bit, as first written (16-bit slices of 64-bit words from torch's generator,
    kept where >= p * 65536 - 32768, times 1 / (1 - p) in x's dtype): faster conversions must not change them."""
    from gptlab.ops import Dropout

    p, x = 0.2, torch.randn(64, 1000, 33).to(dtype)  # odd size: words cut mid-way
    torch.manual_seed(5)
    y = Dropout(p)(x)
    torch.manual_seed(5)
    words = torch.randint(-2**63, 2**63 - 1, ((x.numel() + 3) // 4,), dtype=torch.int64)
    keep = words.view(torch.int16)[:x.numel()].view(x.shape) >= round(p * 65536) - 32768
    assert torch.equal(y, x * keep.to(dtype).mul_(1.0 / (1.0 - p)))


def test_lm_head_is_tied_and_residual_projections_are_scaled():
    model = GPT(tiny_config(n_layer=8, n_embd=256, n_head=4))
    assert model.lm_head.weight is model.transformer.wte.weight
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / (2 * 8) ** 0.5) < 0.001
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.001


def test_gpt2_preset_has_124m_parameters_and_reports_flops():
    model = GPT(build(ModelConfig, get_preset("gpt2").model, {}))
    assert model.num_params() == 124_439_808
    non_embedding = model.num_params(non_embedding=True)
    assert non_embedding == 124_439_808 - 50257 * 768 - 1024 * 768
    expected = 6 * (non_embedding + 50257 * 768) + 12 * 12 * 768 * 1024
    assert model.flops_per_token() == expected


def test_biases_are_optional():
    model = GPT(tiny_config(bias=False))
    assert not any(name.endswith(".bias") for name, _ in model.named_parameters())


def test_loss_ignores_minus_one_targets_and_starts_near_uniform():
    model = GPT(tiny_config())
    x = torch.randint(0, 50, (2, 16))
    _, loss = model(x, torch.full_like(x, -1).index_fill_(1, torch.tensor([3]), 7))
    assert loss.isfinite()
    _, loss = model(x, torch.randint(0, 50, (2, 16)))
    assert abs(loss.item() - np.log(50)) < 0.2  # small init: close to the uniform distribution


def test_trained_bigram_matches_the_corpus_bigram_frequencies(char_data):
    tokens = torch.from_numpy(load_dataset(char_data).train.astype(np.int64))
    V = int(tokens.max()) + 1
    model = Bigram(tiny_config(arch="bigram", vocab_size=V))
    opt = torch.optim.Adam(model.parameters(), lr=0.3)
    x, y = tokens[:-1][None], tokens[1:][None]
    for _ in range(300):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    counts = torch.zeros(V, V).index_put_((x[0], y[0]), torch.ones(x.size(1)), accumulate=True)
    frequent = counts.sum(1) >= 100
    empirical = counts[frequent] / counts[frequent].sum(1, keepdim=True)
    learned = torch.softmax(model.logits_table.weight[frequent], dim=-1)
    assert (learned - empirical).abs().max().item() < 0.01


def test_build_model_picks_the_architecture():
    assert isinstance(build_model(tiny_config(arch="bigram")), Bigram)
    assert isinstance(build_model(tiny_config()), GPT)


# ---- the KV cache at the model's interface (issue 4) -------------------------------------------------------------

@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_cached_forward_equals_the_full_forward_for_ragged_rows(attention):
    model = GPT(tiny_config(attention=attention)).eval()
    lengths = [3, 7, 1]
    idx = torch.randint(0, 50, (3, 12))
    full = model(idx)[0]
    cache = model.new_kv_cache(3)
    with torch.no_grad():
        model(idx[:, :max(lengths)], kv_cache=cache)  # right-padded prefill: rows past their length are ignored
        cache.pos.copy_(torch.tensor(lengths))
        for step in range(4):  # then each row continues from its own position, one token at a time
            x = torch.stack([idx[b, n + step] for b, n in enumerate(lengths)])[:, None]
            logits = model(x, kv_cache=cache)[0][:, 0]
            for b, n in enumerate(lengths):
                assert (logits[b] - full[b, n + step]).abs().max().item() <= 1e-5
    assert cache.pos.tolist() == [n + 4 for n in lengths]


def numbered_cache(batch: int = 3, max_len: int = 6) -> KVCache:
    """A cache of 2 layers, 2 heads, D 1 whose every entry says where it is: k = 1000 l + 100 b + 10 h + t, v = -k."""
    cache = KVCache(2, batch, 2, max_len, 1, dtype=torch.float64)
    l, b, h, t = torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in (2, batch, 2, max_len)), indexing="ij")
    cache.k.copy_((1000 * l + 100 * b + 10 * h + t)[..., None])
    cache.v.copy_(-cache.k)
    cache.pos.copy_(torch.tensor([4, 2, 5][:batch]))
    return cache


def test_selected_rows_are_copies_of_the_rows_asked_for_in_their_order_with_the_cache_settings():
    cache = numbered_cache()
    cache.attend = torch.bfloat16
    cache.begin(1)
    picked = cache.select_rows(torch.tensor([2, 0, 2]))
    assert picked.k[0, :, 0, 0, 0].tolist() == [200.0, 0.0, 200.0] and picked.k[1, 1, 1, 3, 0] == 1013.0
    assert torch.equal(picked.v, -picked.k) and picked.pos.tolist() == [5, 4, 5] and picked.k.dtype == torch.float64
    assert picked.max_len == 6 and picked.attend == torch.bfloat16 and picked.step is None
    picked.k.zero_(), picked.pos.zero_()
    assert cache.k[0, 2, 0, 0, 0] == 200.0 and cache.pos.tolist() == [4, 2, 5]  # copies, not views
    repeated = cache.repeat_rows(2)
    assert repeated.pos.tolist() == [4, 4, 2, 2, 5, 5] and repeated.k[1, :, 1, 2, 0].tolist() == \
        [1012.0, 1012.0, 1112.0, 1112.0, 1212.0, 1212.0]
    assert cache.repeat_rows(1).pos.tolist() == [4, 2, 5]


def test_replaced_rows_take_the_other_caches_filled_positions_and_keep_the_rest():
    cache, other = numbered_cache(), numbered_cache(batch=2)
    other.k.add_(0.5), other.v.sub_(0.5)
    other.pos.copy_(torch.tensor([1, 3]))  # 3 positions filled in the longest row
    cache.replace_rows(torch.tensor([2, 0]), other)
    assert cache.pos.tolist() == [3, 2, 1]
    assert cache.k[0, 2, 0, :, 0].tolist() == [0.5, 1.5, 2.5, 203.0, 204.0, 205.0]  # other's row 0, then its own
    assert cache.k[1, 0, 1, :, 0].tolist() == [1110.5, 1111.5, 1112.5, 1013.0, 1014.0, 1015.0]  # other's row 1
    assert cache.v[1, 0, 1, 2, 0] == -1112.5 and cache.k[0, 1, 0, 0, 0] == 100.0  # row 1 untouched
    before = cache.k.clone()
    cache.replace_rows(torch.tensor([], dtype=torch.long), numbered_cache(batch=0))  # no rows: nothing changes
    assert torch.equal(cache.k, before) and cache.pos.tolist() == [3, 2, 1]


def test_a_step_plans_the_square_mask_a_one_token_step_no_mask_and_ragged_rows_their_own_mask():
    cache = KVCache(1, 2, 1, 6, 1)
    assert cache.begin(4) == (0, 4, True, None, True)  # a fresh prefill: the plain causal mask
    cache.pos.fill_(4)
    assert cache.begin(1) == (4, 5, True, None, False)  # one token sees every stored position
    step = cache.begin(2)  # two tokens after four: each sees up to itself
    assert (step.start, step.end, step.uniform, step.causal) == (4, 6, True, False)
    assert step.mask[:, 0].int().tolist() == [[[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]] * 2
    cache.pos.copy_(torch.tensor([1, 3]))
    step = cache.begin(1)  # ragged rows: row 0 sees keys 0..1, row 1 keys 0..3 of the 4 planned
    assert (step.start, step.end, step.uniform, step.causal) == (1, 4, False, False) and step is cache.step
    assert step.mask[:, 0, 0].int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    cache.pos.copy_(torch.tensor([0, 5]))
    step = cache.begin(1)  # row 0 empty: starts at 0 yet is no prefill; the last position fits
    assert (step.start, step.end, step.uniform, step.causal) == (0, 6, False, False)
    assert step.mask[:, 0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    with pytest.raises(AssertionError, match="KV cache overflow: 7 positions > 6"):
        cache.begin(2)
