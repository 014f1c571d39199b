"""heads.py past its fixtures' edges (written from the survivors of its whole mutation run): the defaults a caller
leaves out (the probe's seed, its half capped at 32 tokens, the kind `best` ranks by), every argument passed on
(a vocabulary smaller than the model's, excluded tokens), a small vocabulary's probe seeded, patterns that are not
square, a model inside DistributedDataParallel, and the heads picture's colours whatever matplotlib's defaults say.
Expected values come from the probe built and scored step by step (repeated_tokens, patterns, scores_from_patterns)
or worked out by hand."""

import matplotlib
import pytest
import torch
import torch.distributed as dist
from helpers import perturbed
from torch.nn.parallel import DistributedDataParallel

from gptlab.config import ModelConfig
from gptlab.errors import GptlabError
from gptlab.heads import (HeadScores, check_probe, head_scores, induction_metrics, induction_scores, patterns,
                          repeated_tokens, scores_from_patterns)
from gptlab.inspect import heatmaps
from gptlab.model import GPT


@pytest.fixture(scope="module")
def model() -> GPT:
    """Weights off their init, so that two different probes give different scores; a context of 80 (half of it
    is 40, past the cap of 32) and 40 tokens to draw from."""
    torch.manual_seed(0)
    return perturbed(GPT(ModelConfig(vocab_size=40, block_size=80, n_layer=2, n_head=2, n_embd=16))).eval()


def step_by_step(model, vocab: int, half: int, seed: int, exclude=()) -> HeadScores:
    """The scores of the probe the docstrings describe: 8 rows of `half` tokens repeated, drawn with `seed`."""
    return scores_from_patterns(patterns(model, repeated_tokens(vocab, half, 8, seed, exclude)), half)


def same(a: HeadScores, b: HeadScores) -> bool:
    return a.half == b.half and all(torch.equal(getattr(a, k), getattr(b, k))
                                    for k in ("previous_token", "duplicate_token", "induction"))


def test_by_default_the_probe_is_seed_0_and_half_the_context_capped_at_32_tokens(model):
    got = head_scores(model)
    assert got.half == 32  # min(80 // 2, 32, 40 drawable)
    assert same(got, step_by_step(model, 40, 32, seed=0))
    assert not same(got, step_by_step(model, 40, 32, seed=1))  # the seed shows in the scores
    assert torch.equal(induction_scores(model), got.induction)
    metrics = induction_metrics(model)
    assert [metrics[f"induction/L{layer}H{head}"] for layer in range(2) for head in range(2)] == \
        got.induction.flatten().tolist()
    assert metrics["induction/chance"] == pytest.approx(sum(1 / (i + 1) for i in range(32, 64)) / 32)


def test_every_argument_reaches_the_probe_a_smaller_vocabulary_a_half_and_excluded_tokens(model):
    assert torch.equal(induction_scores(model, vocab_size=12, half=3, batch=8, seed=4),
                       step_by_step(model, 12, 3, seed=4).induction)
    excluded = head_scores(model, half=4, exclude=range(30))  # only tokens 30..39 left to draw
    assert same(excluded, step_by_step(model, 40, 4, seed=0, exclude=range(30)))
    assert not same(excluded, step_by_step(model, 40, 4, seed=0))


def test_a_probe_from_a_vocabulary_smaller_than_half_is_seeded_too():
    """Fewer tokens than `half`: drawn with replacement, by the same seeded generator as distinct draws."""
    ids = repeated_tokens(3, 5, 4, seed=7)
    assert ids.shape == (4, 10) and ids.dtype == torch.long and torch.equal(ids[:, :5], ids[:, 5:])
    assert torch.equal(ids, repeated_tokens(3, 5, 4, seed=7))
    assert not torch.equal(ids, repeated_tokens(3, 5, 4, seed=8))


def test_best_ranks_by_induction_unless_told_and_a_refusal_names_every_kind():
    T = 6  # half 3: head 0 all on the induction key (i - 2), head 1 all on the previous token
    induction, previous = torch.zeros(T, T), torch.zeros(T, T)
    for i in range(T):
        induction[i, max(i - 2, 0)] = 1.0
        previous[i, max(i - 1, 0)] = 1.0
    scores = scores_from_patterns([torch.stack([induction, previous])[None]], 3)
    assert scores.best() == (0, 0, 1.0) and scores.best("previous_token") == (0, 1, 1.0)
    with pytest.raises(GptlabError) as refused:
        scores.best("copying")
    assert str(refused.value) == ("unknown head score 'copying'; choose one of previous_token, duplicate_token, "
                                  "induction")


@pytest.mark.parametrize("shape", [(6, 7), (7, 6), (5, 6)])
def test_patterns_that_are_not_2_half_by_2_half_are_refused_naming_their_shape(shape):
    with pytest.raises(GptlabError) as refused:
        scores_from_patterns([torch.zeros(1, 1, *shape)], 3)
    assert str(refused.value) == f"patterns of {shape} positions are no probe of half 3 (2 * half positions, half >= 2)"


def test_a_probe_longer_than_the_context_is_refused_naming_both_lengths():
    small = GPT(ModelConfig(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(GptlabError) as refused:
        patterns(small, torch.zeros(1, 9, dtype=torch.long))
    assert str(refused.value) == "a probe of 9 tokens is longer than the context (8)"


def test_a_model_inside_distributed_data_parallel_is_scored_as_the_gpt_it_holds(model, tmp_path):
    """train's model under torchrun is DDP's wrapper: the scores read the GPT in its .module."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(model)
        assert same(head_scores(wrapped, half=5, seed=2), step_by_step(model, 40, 5, seed=2))
    finally:
        dist.destroy_process_group()


def test_the_heads_picture_is_viridis_whatever_matplotlibs_default_colour_map_and_its_maps_are_one_width(tmp_path,
                                                                                                        monkeypatch):
    figures, save = [], heatmaps.save_png
    monkeypatch.setattr(heatmaps, "save_png", lambda fig, out: figures.append(fig) or save(fig, out))
    scores = HeadScores(*(torch.rand(3, 2, generator=torch.Generator().manual_seed(s)) for s in range(3)), half=3)
    with matplotlib.rc_context({"image.cmap": "gray"}):  # a user's matplotlibrc may change the default
        heatmaps.heads_png(scores, tmp_path / "heads.png")
    (fig,) = figures
    *maps, bar = fig.axes
    assert [ax.images[0].get_cmap().name for ax in maps] == ["viridis"] * 3
    (solids,) = [c for c in bar.collections if type(c).__name__ == "QuadMesh"]  # the bar's colours: the maps'
    assert solids.get_cmap().name == "viridis" and solids.get_clim() == (0, 1)
    widths = [ax.get_position().width for ax in maps]
    assert widths == pytest.approx([widths[0]] * 3)  # the bar takes its room from the three maps alike


def test_only_a_probe_asked_for_needs_attention_heads():
    assert check_probe("none", "bigram") is None and check_probe("induction", "gpt") is None
    with pytest.raises(GptlabError) as refused:
        check_probe("induction", "bigram")
    assert str(refused.value) == "--probe induction reads attention heads, and arch bigram has none; drop --probe"
