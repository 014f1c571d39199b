import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from helpers import reference_probs, tiny_config
from gptlab.config import SampleConfig
from gptlab.engine import one_thread
from gptlab.sampling import apply_penalties, next_token, top_k_filter, top_p_filter


@pytest.fixture(autouse=True)
def _one_thread():
    """A few thousand rows of at most a few hundred logits gain nothing from a second thread, and lose much where
    other processes keep the cores busy."""
    with one_thread():
        yield


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 100)
    assert torch.equal(next_token(logits, SampleConfig(temperature=0)), logits.argmax(-1))


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0]])
    kept = top_k_filter(logits, 2).isfinite()[0].tolist()
    assert kept == [False, True, True, False, False, False]  # ties broken toward the lower id
    assert top_k_filter(logits, 4).isfinite().sum() == 4


def test_top_p_keeps_the_smallest_set_with_enough_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert top_p_filter(logits, 0.5).isfinite()[0].tolist() == [True, False, False, False]
    assert top_p_filter(logits, 0.8).isfinite()[0].tolist() == [True, True, False, False]
    assert top_p_filter(logits, 0.81).isfinite()[0].tolist() == [True, True, True, False]
    assert top_p_filter(logits, 1.0).isfinite().all()


def test_penalties_change_only_seen_tokens_as_documented():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    counts = torch.tensor([[1, 1, 0]])
    assert apply_penalties(logits, counts, repetition=2.0).tolist() == [[1.0, -4.0, 1.0]]
    assert apply_penalties(logits, torch.tensor([[2, 0, 0]]), frequency=0.5, presence=1.0).tolist() == \
        [[0.0, -2.0, 1.0]]


def test_sampling_frequencies_match_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log().expand(20000, -1)
    ids = next_token(logits, SampleConfig(temperature=1.0), torch.Generator().manual_seed(0))
    observed = torch.bincount(ids, minlength=4).float()
    expected = probs * 20000
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 11.34  # chi-square, 3 degrees of freedom, p = 0.01


def chi_square(ids: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(ids, minlength=len(probs)).float()
    keep = probs > 0
    assert observed[~keep].sum() == 0  # nothing drawn outside the kept set
    expected = probs[keep] * len(ids)
    return (((observed[keep] - expected) ** 2) / expected).sum().item()


def test_sampling_with_temperature_top_k_and_top_p_matches_the_renormalised_softmax():
    logits = torch.tensor([2.0, 1.5, 1.5, 1.0, 0.2, -1.0])
    n = 30000
    # temperature 0.7, top-k 4: ties at 1.5 both kept; ids 4 and 5 dropped
    cfg = SampleConfig(temperature=0.7, top_k=4)
    ids = next_token(logits.expand(n, -1), cfg, torch.Generator().manual_seed(1))
    probs = torch.softmax(logits / 0.7, -1) * torch.tensor([1.0, 1, 1, 1, 0, 0])
    assert chi_square(ids, probs / probs.sum()) < 11.34  # 3 degrees of freedom, p = 0.01
    # top-p 0.6 on the plain softmax (0.35, 0.21, 0.21, ...): the first three tokens are the smallest set
    cfg = SampleConfig(temperature=1.0, top_p=0.6)
    ids = next_token(logits.expand(n, -1), cfg, torch.Generator().manual_seed(2))
    probs = torch.softmax(logits, -1) * torch.tensor([1.0, 1, 1, 0, 0, 0])
    assert chi_square(ids, probs / probs.sum()) < 9.21  # 2 degrees of freedom, p = 0.01


def test_top_k_unset_keeps_every_token_and_penalties_apply_before_the_choice():
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    assert next_token(logits, SampleConfig(temperature=0)).item() == 0
    counts = torch.tensor([[1, 0, 0]])
    assert next_token(logits, SampleConfig(temperature=0, presence_penalty=1.5), counts=counts).item() == 1
    assert next_token(logits, SampleConfig(temperature=0, repetition_penalty=4.0), counts=counts).item() == 1
    assert next_token(logits, SampleConfig(temperature=0, frequency_penalty=0.5), counts=counts * 3).item() == 1
    ids = next_token(logits.expand(2000, -1), SampleConfig(temperature=5.0), torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {0, 1, 2}


def test_the_engine_counts_prompt_and_generated_tokens_for_penalties():
    from gptlab.engine import generate
    from gptlab.model import GPT

    model = GPT(tiny_config()).eval()
    cfg = SampleConfig(max_new_tokens=30, temperature=0, presence_penalty=1000.0)
    # the prompt holds the tokens the model goes on with after [1]: a penalty that missed the prompt repeats them
    prompt = [1] + [ids[0] for ids in generate(model, [1], cfg)][:4]
    out = [ids[0] for ids in generate(model, prompt, cfg)]
    assert len(set(prompt + out)) == len(prompt + out)  # with 50 ids, a huge presence penalty never repeats one


# ---- references in plain numpy: the documented order (penalties, temperature, top-k, top-p), ties to the lower id


def test_top_k_breaks_a_tie_among_a_hundred_logits_toward_the_lower_ids():
    logits = torch.zeros(1, 128)
    logits[0, 3::2] = 2.0  # 63 tokens tie for the top: top-k keeps the lowest ids among them
    logits[0, 100] = 5.0
    for k in (1, 10, 40, 64):
        kept = top_k_filter(logits, k).isfinite()[0].nonzero().flatten().tolist()
        assert kept == sorted([100] + list(range(3, 128, 2))[:k - 1])
    # drawn: only those, each about equally often
    ids = next_token(logits[:, :100].expand(4000, -1), SampleConfig(temperature=1.0, top_k=5),
                     torch.Generator().manual_seed(3))
    assert set(ids.tolist()) == {3, 5, 7, 9, 11}


def test_temperature_is_applied_before_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    # worked by hand: at temperature 2 the softmax of (1, 0.5, 0, -0.5) is (0.422, 0.256, 0.155, 0.094): top-p 0.6
    # keeps tokens 0 and 1 (0.422 < 0.6 before token 1; 0.678 before token 2). At temperature 1 it would keep only
    # token 0 (0.644 of the mass).
    expected = np.exp(np.array([1.0, 0.5]))
    expected = np.concatenate([expected / expected.sum(), [0.0, 0.0]])
    assert np.allclose(reference_probs(logits, [0] * 4, SampleConfig(temperature=2.0, top_p=0.6))[0], expected)
    ids = next_token(logits.expand(20000, -1), SampleConfig(temperature=2.0, top_p=0.6),
                     torch.Generator().manual_seed(4))
    assert chi_square(ids, torch.tensor(expected, dtype=torch.float32)) < 6.63  # 1 degree of freedom, p = 0.01


PENALTIES = dict(repetition_penalty=st.sampled_from([1.0, 0.5, 2.0, 4.0]),
                 frequency_penalty=st.sampled_from([0.0, 0.25, 1.5]), presence_penalty=st.sampled_from([0.0, 0.5, 2.0]))


@st.composite
def rows_and_settings(draw, max_vocab: int = 160):
    """One row of logits (quarters from a few levels: ties are common, and every penalty is exact in fp32), its
    counts (mostly 0) and settings. The values come from a drawn seed: lists of 160 drawn numbers are slow."""
    vocab = draw(st.integers(2, max_vocab))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    levels = rng.integers(-24, 25, size=draw(st.integers(1, 30))) / 4
    logits = rng.choice(levels, size=vocab)
    counts = rng.choice([0, 0, 0, 1, 2, 3], size=vocab)
    cfg = SampleConfig(temperature=draw(st.sampled_from([0.3, 0.5, 1.0, 1.7, 3.0])),
                       top_k=draw(st.one_of(st.none(), st.integers(1, vocab + 2))),
                       top_p=draw(st.sampled_from([1.0, 0.97, 0.8, 0.5, 0.2, 0.05])),
                       **{name: draw(s) for name, s in PENALTIES.items()})
    return torch.tensor(logits[None], dtype=torch.float32), torch.tensor(counts[None]), cfg


@settings(max_examples=80)
@given(rows_and_settings())
def test_top_k_keeps_the_k_largest_ties_toward_the_lower_id(case):
    logits, _, cfg = case
    k = cfg.top_k or 1
    kept = set(top_k_filter(logits, k).isfinite()[0].nonzero().flatten().tolist())
    assert kept == set(np.argsort(-logits[0].numpy(), kind="stable")[:k].tolist())


@settings(max_examples=80)
@given(rows_and_settings())
def test_draws_come_from_the_documented_distribution(case):
    """Penalties, then temperature, then top-k, then top-p: every draw inside the support that leaves, and every
    token with at least 2 % of the mass drawn at least once in 1000 draws (missed with odds below 1e-8); a wrong
    order of the steps moves the support."""
    logits, counts, cfg = case
    probs, margin = reference_probs(logits[0], counts[0], cfg)
    assume(margin > 1e-4)
    n = 1000
    ids = next_token(logits.expand(n, -1), cfg, torch.Generator().manual_seed(0), counts.expand(n, -1))
    drawn = set(ids.tolist())
    assert drawn <= set(np.flatnonzero(probs).tolist())
    assert set(np.flatnonzero(probs >= 0.02).tolist()) <= drawn


@settings(max_examples=40)
@given(rows_and_settings())
def test_greedy_takes_the_largest_penalised_logit(case):
    logits, counts, cfg = case
    greedy = SampleConfig(temperature=0, **{name: getattr(cfg, name) for name in PENALTIES})
    probs, _ = reference_probs(logits[0], counts[0], SampleConfig(temperature=1.0, top_k=1,
                                                                    **{n: getattr(cfg, n) for n in PENALTIES}))
    assert next_token(logits, greedy, counts=counts).item() == int(probs.argmax())


def test_filters_work_on_the_last_axis_of_any_shape():
    """top_k_filter and top_p_filter keep "each row": a (B, T, V) tensor is filtered as its B*T rows one by one
    (B != T != V, so a filter along another axis, or a bound read from another axis, shows)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7) * 2
    for filtered, one_row in ((top_k_filter(logits, 3), lambda row: top_k_filter(row, 3)),
                              (top_p_filter(logits, 0.7), lambda row: top_p_filter(row, 0.7))):
        rows = torch.stack([one_row(row[None])[0] for row in logits.reshape(-1, 7)]).reshape(2, 3, 7)
        assert torch.equal(filtered, rows)
        assert (filtered.isfinite().sum(-1) >= 1).all()
    assert (top_k_filter(logits, 3).isfinite().sum(-1) == 3).all()


def test_the_off_values_of_top_k_and_top_p_return_the_logits_unchanged():
    """k <= 0 means "no top-k" (as in transformers), and p = 1.0 keeps every token even where the mass before the
    last ones already reads 1.0 in float32 (probabilities below its precision)."""
    logits = torch.tensor([[30.0, 0.0, -1.0, 2.0]])  # softmax: 1.0 then ~1e-13: cumsum hits 1.0 after token 0
    for k in (0, -1, 4, 9):
        assert torch.equal(top_k_filter(logits, k), logits)
    assert torch.equal(top_p_filter(logits, 1.0), logits)
    assert top_p_filter(logits, 0.999).isfinite().sum() == 1  # and just below 1.0 the tiny ones go


def test_penalties_keep_the_logits_dtype():
    """bf16 and float64 logits come back in their own dtype, values as worked out by hand (counts are integers)."""
    counts = torch.tensor([[2, 0, 1]])
    for dtype in (torch.bfloat16, torch.float64):
        logits = torch.tensor([[1.0, 2.0, -3.0]], dtype=dtype)
        out = apply_penalties(logits, counts, frequency=0.5, presence=0.25)
        assert out.dtype == dtype
        assert out.tolist() == [[1.0 - 1.0 - 0.25, 2.0, -3.0 - 0.5 - 0.25]]


def test_sampling_runs_on_the_device_of_the_logits():
    """Every tensor next_token makes (the uniform draws included) is made on the logits' device: on PyTorch's
    shape-only 'meta' device a CPU tensor anywhere raises."""
    logits = torch.empty(3, 10, device="meta")
    ids = next_token(logits, SampleConfig(temperature=0.8, top_k=5, top_p=0.9))
    assert ids.device.type == "meta" and ids.shape == (3,)
