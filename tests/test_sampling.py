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
    from conftest import tiny_config
    from gptlab.engine import generate
    from gptlab.model import GPT

    model = GPT(tiny_config()).eval()
    prompt = [1, 2, 3]
    cfg = SampleConfig(max_new_tokens=30, temperature=0, presence_penalty=1000.0)
    out = [ids[0] for ids in generate(model, prompt, cfg)]
    assert len(set(prompt + out)) == len(prompt + out)  # with 50 ids, a huge presence penalty never repeats one
