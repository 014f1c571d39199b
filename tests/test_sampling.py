import torch

from gptlab.config import SampleConfig
from gptlab.sampling import apply_penalties, next_token, top_k_filter, top_p_filter


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
