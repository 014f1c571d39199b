"""heads.py: the head detectors on patterns built by hand (scores and chance levels worked out by hand), the patterns
they read against softmax(QK^T / sqrt(D)) computed from the weights, an induction circuit trained from scratch, and
`train --probe induction` writing every head's score into the run's metrics and its picture."""

import json
import math
from fractions import Fraction

import pytest
import torch
from helpers import run_bad, tree
from PIL import Image

from gptlab.cli import main
from gptlab.config import ModelConfig, TrainConfig
from gptlab.errors import GptlabError
from gptlab.heads import (HeadScores, chance_levels, head_scores, induction_metrics, induction_scores, patterns,
                          repeated_tokens, scores_from_patterns)
from gptlab.model import GPT, Bigram

# ---- hand-built patterns ---------------------------------------------------------------------------------------


def uniform(T: int) -> torch.Tensor:
    """The causal pattern that spreads each query's attention evenly: row i is 1 / (i + 1) on keys 0..i."""
    return torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]


def one_hot(T: int, key_of) -> torch.Tensor:
    """Each query i all on key key_of(i) (clamped to the keys it may see)."""
    p = torch.zeros(T, T)
    for i in range(T):
        p[i, min(max(key_of(i), 0), i)] = 1.0
    return p


def stacked(*heads: torch.Tensor, batch: int = 3) -> torch.Tensor:
    """(batch, H, T, T) from one (T, T) pattern per head."""
    return torch.stack(heads)[None].expand(batch, -1, -1, -1).clone()


def test_a_previous_token_head_scores_one_there_and_zero_elsewhere_a_uniform_head_scores_chance():
    half = 4  # T = 8
    previous = one_hot(8, lambda i: i - 1)
    scores = scores_from_patterns([stacked(previous, uniform(8))], half)
    assert scores.previous_token[0, 0] == 1.0
    assert scores.duplicate_token[0, 0] == 0.0 and scores.induction[0, 0] == 0.0
    # the uniform head, by hand: mean of 1/(i+1) over i = 1..7, and over i = 4..7
    prev_chance = sum(Fraction(1, i + 1) for i in range(1, 8)) / 7
    second_chance = (Fraction(1, 5) + Fraction(1, 6) + Fraction(1, 7) + Fraction(1, 8)) / 4
    assert prev_chance == Fraction(481, 1960) and second_chance == Fraction(533, 3360)
    assert scores.previous_token[0, 1].item() == pytest.approx(float(prev_chance), abs=1e-6)
    assert scores.duplicate_token[0, 1].item() == pytest.approx(float(second_chance), abs=1e-6)
    assert scores.induction[0, 1].item() == pytest.approx(float(second_chance), abs=1e-6)
    assert scores.chance() == pytest.approx({"previous_token": float(prev_chance),
                                             "duplicate_token": float(second_chance),
                                             "induction": float(second_chance)})
    assert chance_levels(half) == scores.chance()


def test_induction_and_duplicate_heads_score_one_on_their_own_diagonal_only():
    half = 5  # T = 10: the second half is queries 5..9
    induction = one_hot(10, lambda i: i - half + 1 if i >= half else 0)  # the token after the earlier copy
    duplicate = one_hot(10, lambda i: i - half if i >= half else i)  # the earlier copy itself
    scores = scores_from_patterns([stacked(induction, duplicate), stacked(uniform(10), uniform(10))], half)
    assert scores.induction[0].tolist() == [1.0, 0.0]
    assert scores.duplicate_token[0].tolist() == [0.0, 1.0]
    # the induction head's previous-token score: queries 1..9 of which none looks one back (i - 4 != i - 1 and key 0
    # from queries 1..4 is one back only for query 1)
    assert scores.previous_token[0, 0].item() == pytest.approx(1 / 9)
    assert scores.best("induction") == (0, 0, 1.0) and scores.best("duplicate_token") == (0, 1, 1.0)
    assert scores.induction.shape == (2, 2)  # [n_layer, n_head]


def test_with_half_two_the_token_after_the_earlier_copy_is_the_previous_token():
    """half 2: query i's induction key i - 1 is its previous token, so a previous-token head scores 1 on both."""
    scores = scores_from_patterns([stacked(one_hot(4, lambda i: i - 1))], 2)
    assert scores.previous_token.item() == 1.0 and scores.induction.item() == 1.0
    assert scores.duplicate_token.item() == 0.0


def test_the_mean_is_over_the_batch_and_the_queries():
    """Row 0 of the batch all on the induction key, row 1 all on key 0: the mean is one half."""
    half = 3
    p = torch.stack([one_hot(6, lambda i: i - half + 1), one_hot(6, lambda i: 0)])[:, None]  # (2, 1, 6, 6)
    assert scores_from_patterns([p], half).induction.item() == pytest.approx(0.5)


def test_patterns_of_the_wrong_length_a_short_probe_and_an_unknown_score_are_refused():
    with pytest.raises(GptlabError, match="no probe of half 4"):
        scores_from_patterns([stacked(uniform(7))], 4)
    with pytest.raises(GptlabError, match="half >= 2"):
        scores_from_patterns([stacked(uniform(2))], 1)
    with pytest.raises(GptlabError, match="unknown head score"):
        scores_from_patterns([stacked(uniform(4))], 2).best("copying")


# ---- the probe --------------------------------------------------------------------------------------------------

def test_the_probe_is_distinct_random_tokens_then_the_same_tokens_seeded():
    ids = repeated_tokens(50, 7, 4, seed=3)
    assert ids.shape == (4, 14) and ids.dtype == torch.long
    assert torch.equal(ids[:, :7], ids[:, 7:])
    assert torch.equal(ids, repeated_tokens(50, 7, 4, seed=3))
    assert not torch.equal(ids, repeated_tokens(50, 7, 4, seed=4))
    assert ids.min() >= 0 and ids.max() < 50
    distinct = repeated_tokens(10, 10, 3, seed=0)  # as many tokens as the vocabulary: each row a permutation of it
    assert all(sorted(row[:10].tolist()) == list(range(10)) for row in distinct)
    left = repeated_tokens(5, 200, 2, seed=0, exclude=[0, 3])  # fewer tokens than half: drawn with replacement
    assert set(left.unique().tolist()) == {1, 2, 4}
    with pytest.raises(GptlabError, match="all are excluded"):
        repeated_tokens(2, 3, 1, seed=0, exclude=[0, 1])
    with pytest.raises(GptlabError, match="half >= 2"):
        repeated_tokens(10, 1, 1, seed=0)


def hand_pattern(x: torch.Tensor, block: torch.nn.Module, n_head: int) -> torch.Tensor:
    """softmax(QK^T / sqrt(D)) under the causal mask, from block's ln_1 and c_attn weights, written out in float64."""
    ln, attn = block.ln_1, block.attn
    x = x.double()
    normed = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + ln.eps)
    normed = normed * ln.weight.double() + ln.bias.double()
    C = x.size(-1)
    W, b = attn.c_attn.weight.double(), attn.c_attn.bias.double()
    q, k = (normed @ W[i * C:(i + 1) * C].T + b[i * C:(i + 1) * C] for i in (0, 1))
    B, T, D = x.size(0), x.size(1), C // n_head
    q, k = (t.view(B, T, n_head, D).transpose(1, 2) for t in (q, k))
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
    return torch.softmax(scores, dim=-1)


def test_patterns_are_the_softmax_of_qk_worked_out_from_the_weights_in_eval_mode_and_the_mode_is_kept():
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=23, block_size=12, n_layer=2, n_head=3, n_embd=24, dropout=0.3)
    model = GPT(cfg)
    with torch.no_grad():  # weights far from their initial values, so that the patterns are far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.train()
    ids = torch.randint(23, (2, 11))
    got = patterns(model, ids)
    assert model.training  # the mode it had
    assert len(got) == 2 and got[0].shape == (2, 3, 11, 11) and got[0].dtype == torch.float32
    x0 = (model.transformer.wte.weight[ids] + model.transformer.wpe.weight[:11]).detach()
    assert torch.allclose(got[0].double(), hand_pattern(x0, model.transformer.h[0], 3), atol=1e-5)
    model.eval()
    with torch.no_grad():
        x1 = model.transformer.h[0](x0)  # the plain (untapped, fused-attention) forward of block 0
    assert torch.allclose(got[1].double(), hand_pattern(x1, model.transformer.h[1], 3), atol=1e-5)
    assert (got[0].std() > 0.05) and not torch.allclose(got[0], got[1])  # no near-uniform coincidence


def test_a_model_without_attention_or_a_probe_longer_than_the_context_is_refused():
    with pytest.raises(GptlabError, match="Bigram has no attention"):
        head_scores(Bigram(ModelConfig(arch="bigram", vocab_size=10, block_size=8)))
    model = GPT(ModelConfig(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(GptlabError, match="longer than the context"):
        head_scores(model, half=5)
    assert head_scores(model).half == 4  # by default half the context
    small = GPT(ModelConfig(vocab_size=3, block_size=32, n_layer=1, n_head=1, n_embd=8))
    assert head_scores(small).half == 3 and head_scores(small, exclude=[0]).half == 2  # no token twice in a half


# ---- an induction circuit, trained from scratch ------------------------------------------------------------------

def successor_walks(vocab: int, T: int, batch: int, jump: float, generator: torch.Generator):
    """(x, y) rows in which each row follows its own random successor map (a permutation of the vocabulary), except
    that with probability `jump` the next token is drawn at random instead: the same pairs come back at random
    distances, so that only looking up what followed the current token earlier predicts the next one (segments
    repeated at fixed offsets let the model learn the offsets instead)."""
    successor = torch.rand(batch, vocab, generator=generator).argsort(dim=1)
    x = torch.empty(batch, T + 1, dtype=torch.long)
    x[:, 0] = torch.randint(vocab, (batch,), generator=generator)
    for i in range(1, T + 1):
        follows = successor.gather(1, x[:, i - 1:i])[:, 0]
        x[:, i] = torch.where(torch.rand(batch, generator=generator) < jump,
                              torch.randint(vocab, (batch,), generator=generator), follows)
    return x[:, :-1], x[:, 1:]


def probe_losses(model: GPT, half: int) -> tuple[float, float]:
    """The model's mean loss on the first and on the second half of the probe's rows (the tokens after the first)."""
    ids = repeated_tokens(model.config.vocab_size, half, 64, seed=7)
    with torch.no_grad():
        logits, _ = model(ids)
    nats = -torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return nats[:, :half - 1].mean().item(), nats[:, half:].mean().item()


def test_a_trained_two_layer_gpt_grows_an_induction_head_in_its_second_layer_on_a_previous_token_head():
    """A 2-layer GPT trained with AdamW on rows where the pairs repeat: at init every head sits at chance; after
    500 steps a second-layer head attends from each repeated token to the one after its earlier copy, a first-layer
    head attends to the previous token (what the second one's keys are made of), and the second half of the probe,
    the repeat, is predicted far better than the first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small steps faster on one thread than on two that wait for each other
    try:
        torch.manual_seed(0)
        model = GPT(ModelConfig(vocab_size=8, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
        half = 8  # the probe: 8 distinct tokens, then the same 8
        before = head_scores(model, half=half, seed=1)
        chance = before.chance()
        assert chance["induction"] == pytest.approx(sum(1 / (i + 1) for i in range(8, 16)) / 8)
        for kind in ("previous_token", "duplicate_token", "induction"):
            scores = getattr(before, kind)
            assert scores.max() < 0.2 and (scores - chance[kind]).abs().max() < 0.05, kind
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.0)
        generator = torch.Generator().manual_seed(0)
        model.train()
        for _ in range(500):
            x, y = successor_walks(8, 32, 128, 0.2, generator)
            _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        after = head_scores(model, half=half, seed=1)
        layer, _, score = after.best("induction")
        assert layer == 1 and score > 0.5, after.induction
        assert after.induction[0].max() < 0.2  # the first layer has no induction head: it cannot (one layer)
        assert after.previous_token[0].max() > 0.5, after.previous_token
        model.eval()
        first, second = probe_losses(model, half)
        assert second < 0.5 * first, (first, second)
    finally:
        torch.set_num_threads(threads)


# ---- train --probe induction -------------------------------------------------------------------------------------

def segments_text(seed: int, n: int = 400) -> str:
    """Random letter segments (3 to 8 letters), each written twice: text in which induction pays."""
    g = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = []
    for _ in range(n):
        seg = "".join(letters[i] for i in torch.randint(26, (int(torch.randint(3, 9, (1,), generator=g)),),
                                                         generator=g))
        out.append(seg + seg + " ")
    return "".join(out)


PROBE_RUN = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
             "--eval-interval", "3", "--eval-batches", "1", "--log-interval", "3", "--precision", "fp32",
             "--max-steps", "6", "--quiet"]


@pytest.fixture(scope="module")
def segments_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("segments")
    (root / "text.txt").write_text(segments_text(0), encoding="utf-8")
    assert main(["prepare", str(root / "text.txt"), "--out", str(root / "data"), "--quiet"]) == 0
    return root / "data"


def eval_rows(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "eval"]


def test_train_probe_induction_writes_every_heads_score_at_each_evaluation_and_draws_them(tmp_path, segments_data):
    from gptlab.checkpoint import load_run

    run = tmp_path / "probed"
    assert main(["train", "--data", str(segments_data), "--run", str(run), *PROBE_RUN, "--probe", "induction"]) == 0
    evals = eval_rows(run)
    assert [r["step"] for r in evals] == [3, 6]
    heads = {f"induction/L{layer}H{head}" for layer in range(2) for head in range(2)}
    for row in evals:
        assert heads <= set(row) and all(0.0 <= row[k] <= 1.0 for k in heads)
        assert set(row) - heads - {"kind", "step", "train_loss", "val_loss", "elapsed_s", "train_s"} == \
            {"induction/chance"}
        block = 16  # the probe: 8 tokens repeated, its chance level by hand
        assert row["induction/chance"] == pytest.approx(sum(1 / (i + 1) for i in range(8, block)) / 8)
    # the last row is the final model's: its scores on the same probe (the run's seed), in a fresh process's view
    model = load_run(run, which="step").model
    scores = induction_scores(model, seed=TrainConfig().seed)
    assert [evals[-1][f"induction/L{l}H{h}"] for l in range(2) for h in range(2)] == \
        pytest.approx(scores.flatten().tolist(), abs=1e-6)
    with Image.open(run / "loss.png") as picture:  # the loss beside a second panel: 13 x 4.5 inches at 120 dpi
        assert picture.size == (1560, 540)


def test_without_the_probe_no_scores_are_written_and_the_picture_is_the_loss_alone(tmp_path, segments_data):
    """The default, --probe none: the evaluation rows and loss.png as before the probe existed."""
    run = tmp_path / "plain"
    assert main(["train", "--data", str(segments_data), "--run", str(run), *PROBE_RUN]) == 0
    assert all(not any(k.startswith("induction/") for k in row) for row in eval_rows(run))
    with Image.open(run / "loss.png") as picture:
        assert picture.size == (960, 540)


def test_an_unknown_probe_or_one_a_model_cannot_take_is_refused_in_one_line_changing_nothing(tmp_path, capsys,
                                                                                               segments_data):
    before = tree(tmp_path)
    line = run_bad(capsys, "train", "--data", str(segments_data), "--run", str(tmp_path / "r"), "--probe", "copying")
    assert "--probe" in line and "induction" in line
    line = run_bad(capsys, "train", "--data", str(segments_data), "--run", str(tmp_path / "r"), "--arch", "bigram",
                   "--probe", "induction", "--max-steps", "2", "--quiet")
    assert "arch bigram has none" in line
    line = run_bad(capsys, "train", "--data", str(segments_data), "--run", str(tmp_path / "r"), "--engine",
                   "reference", "--probe", "induction", "--max-steps", "2", "--quiet")
    assert "reference engine does not implement probe induction" in line
    assert tree(tmp_path) == before
    with pytest.raises(GptlabError, match="probe must be one of none, induction"):
        TrainConfig(probe="copying")


def test_induction_metrics_name_every_head_once():
    model = GPT(ModelConfig(vocab_size=20, block_size=10, n_layer=3, n_head=2, n_embd=8))
    row = induction_metrics(model, seed=5)
    assert sorted(row) == sorted([f"induction/L{l}H{h}" for l in range(3) for h in range(2)] + ["induction/chance"])
    assert isinstance(head_scores(model), HeadScores)
