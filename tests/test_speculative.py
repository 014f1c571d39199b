"""Prompt-lookup speculation (gptlab.inference.speculate, FusedDecoder.verify, RunningBatch): a step that checks
several tokens of a row gives each position the bits a one-token step gives it, so a row that speculates draws,
token by token, what it draws without speculating: the same tokens and the same logits, greedy or seeded, alone or
beside other rows, in fp32, bf16 and int8; what a row proposes (the last earlier occurrence of its longest n-gram)
and how its proposals adapt."""

import random

import pytest
import torch
from helpers import KERNEL_SHAPES, int8_model, tiny_config, trained_like

from gptlab.config import SampleConfig
from gptlab.engine import RunningBatch, generate_batch, one_thread
from gptlab.errors import GptlabError
from gptlab.inference.fused import FusedDecoder
from gptlab.inference.native import has_int8_vnni
from gptlab.inference.loading import prepare_for_inference
from gptlab.inference.speculate import DRAFT_MAX, DRAFT_START, NGRAM_MAX, NGRAM_MIN, OFF_AFTER, Lookup
from gptlab.model import GPT
from gptlab.runtime import bf16_supported


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


# ---- the verify step: each position's bits are a one-token step's ------------------------------------------------

def _prefilled(model, rows, cache_dtype):
    cache = model.new_kv_cache(rows, dtype=cache_dtype)
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (rows, 9)), kv_cache=cache)
    cache.pos -= torch.tensor([0, 3, 1][:rows])  # rows at different positions
    return cache


def _copy(cache):
    return cache.select_rows(torch.arange(len(cache.pos)))


@pytest.mark.device_path("fused decode (native)")
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8 fma", "int8 vnni"])
@pytest.mark.parametrize("shape", KERNEL_SHAPES[:2] + KERNEL_SHAPES[3:], ids=["n_embd60", "n_embd75", "n_embd192"])
def test_a_verify_step_gives_every_position_the_bits_of_one_token_steps(fused_kernel, kind, shape):
    """Rows of 1, 4 and 2 tokens (one cache row each, at consecutive positions) in one verify: each position's
    logits, keys and values are bit for bit those of one-token steps that fed the same tokens, all rows stepping
    together (the one-token step gives a row the same bits whatever rows are beside it)."""
    torch.manual_seed(0)
    if kind.startswith("int8"):
        model = int8_model(shape)
        if kind == "int8 vnni" and not has_int8_vnni(fused_kernel):
            pytest.skip("this CPU's build has no VNNI")
        fused = FusedDecoder(model, fused_kernel, vnni=kind == "int8 vnni")
    else:
        if kind == "bf16" and not bf16_supported(torch.device("cpu")):
            pytest.skip("no native bf16 on this CPU")
        model = trained_like(shape, torch.bfloat16 if kind == "bf16" else torch.float32)
        fused = FusedDecoder(model, fused_kernel)
    cache_dtype = torch.bfloat16 if kind != "fp32" else torch.float32
    before = _prefilled(model, 3, cache_dtype)
    tokens = [torch.randint(0, shape["vocab_size"], (n,)).tolist() for n in (1, 4, 2)]
    stepped, expected = _copy(before), {}
    for t in range(4):  # one-token steps: every row steps; a row past its tokens feeds token 0 (not compared)
        ids = torch.tensor([row[t] if t < len(row) else 0 for row in tokens])
        start = stepped.pos.clone()
        logits = fused.step(ids, stepped).clone()
        for r, row in enumerate(tokens):
            if t < len(row):
                expected[(r, t)] = (logits[r], int(start[r]))
    verified = _copy(before)
    ids = torch.tensor([tok for row in tokens for tok in row])
    pos = torch.tensor([int(before.pos[r]) + t for r, row in enumerate(tokens) for t in range(len(row))])
    slot = torch.tensor([r for r, row in enumerate(tokens) for _ in row])
    got = fused.verify(ids, pos, slot, verified)
    assert torch.equal(verified.pos, before.pos)  # the caller sets what it keeps
    i = 0
    for r, row in enumerate(tokens):
        for t in range(len(row)):
            logits, p = expected[(r, t)]
            assert torch.equal(got[i], logits), f"row {r}, token {t}"
            assert torch.equal(verified.k[:, r, :, p], stepped.k[:, r, :, p])
            assert torch.equal(verified.v[:, r, :, p], stepped.v[:, r, :, p])
            i += 1


@pytest.mark.device_path("fused decode (native)")
def test_a_verify_outside_the_cache_is_refused_and_changes_nothing(fused_kernel):
    model = trained_like(KERNEL_SHAPES[0])
    fused = FusedDecoder(model, fused_kernel)
    cache = _prefilled(model, 2, torch.float32)
    before = [t.clone() for t in (cache.k, cache.v, cache.pos)]
    for ids, pos, slot, message in (([1, 2], [9, 10], [0, 2], "row 2 of 2"), ([1, 2], [39, 40], [1, 1], "position 40"),
                                    ([1, 101], [3, 4], [0, 0], "token id 101")):
        with pytest.raises(ValueError, match=message):
            fused.verify(torch.tensor(ids), torch.tensor(pos), torch.tensor(slot), cache)
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.k, cache.v, cache.pos)))


# ---- the engine: the same tokens and logits with speculation as without ------------------------------------------

SHAPE = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=65, block_size=48)


def engine_model(precision):
    torch.manual_seed(0)
    model = GPT(tiny_config(**SHAPE)).eval()
    with torch.no_grad():
        for p in model.parameters():  # away from the init, so that context matters
            p.mul_(3.0) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    return prepare_for_inference(model, precision)


def repetitive_prompts(count, seed=0):
    """Prompts a row can propose from: a few random phrases (from a small alphabet) repeated with changes, of 3 to
    40 tokens; some prompts so long that the window slides while it generates."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(8) for _ in range(rng.randrange(2, 7))]
        prompt = []
        while len(prompt) < rng.randrange(3, 41):
            prompt += phrase if rng.random() < 0.8 else [rng.randrange(65)]
        prompts.append(prompt[:40])
    return prompts


def decode(model, prompts, cfg, width):
    """Each prompt's (token, logits) pairs, prompts joined `width` at a time into one RunningBatch, rows drawn until
    done; and the proposals made and kept."""
    out, made, kept = [], 0, 0
    for i in range(0, len(prompts), width):
        batch = RunningBatch(model)
        rows = [row for p in prompts[i:i + width] for row in batch.join(p, cfg)]
        got = {row: [] for row in rows}
        while batch.rows:
            for row, token, logits in batch.sample():
                got[row].append((token, logits.clone()))
            batch.advance()
        out += [got[row] for row in rows]
        made += sum(row.lookup.proposed for row in rows if row.lookup is not None)
        kept += sum(row.lookup.kept for row in rows if row.lookup is not None)
    return out, made, kept


@pytest.mark.device_path("fused decode (native)")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_two_hundred_prompts_give_the_same_tokens_and_logits_with_speculation_and_without(fused_kernel, precision):
    """200 prompts x greedy and seeded (top-k, top-p, a repetition penalty) x alone and 4 to a batch: every token and
    the logits it was drawn from are bit for bit those without speculation; proposals were made and kept."""
    if precision == "bf16" and not bf16_supported(torch.device("cpu")):
        pytest.skip("no native bf16 on this CPU")
    model = engine_model(precision)
    assert model.fused
    prompts = repetitive_prompts(200)
    settings = [dict(temperature=0), dict(temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.2, seed=7)]
    for i, extra in enumerate(settings):
        for width in (1, 4):
            some = prompts[i * 100 + (width // 4) * 50:][:50]  # 50 prompts each: 200 in all
            off, _, _ = decode(model, some, SampleConfig(max_new_tokens=24, **extra), width)
            on, made, kept = decode(model, some, SampleConfig(max_new_tokens=24, speculate="auto", **extra), width)
            for p, (a, b) in enumerate(zip(off, on)):
                assert [t for t, _ in a] == [t for t, _ in b], f"{extra}, width {width}, prompt {p}"
                assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b)), f"{extra}, width {width}, prompt {p}"
            assert made > 0 and kept > 0


@pytest.mark.device_path("fused decode (native)")
def test_generate_batch_yields_position_by_position_while_rows_run_ahead(fused_kernel):
    """generate_batch yields one token of every row per position even when a row drew several at once."""
    model = engine_model("fp32")
    prompts = [[1, 2, 3, 4] * 6, [9, 30, 41], [5, 6] * 10]
    for cfg in (SampleConfig(max_new_tokens=30, temperature=0), SampleConfig(max_new_tokens=30, seed=3)):
        off = list(generate_batch(model, prompts, cfg, num_samples=2))
        cfg.speculate = "auto"
        on = list(generate_batch(model, prompts, cfg, num_samples=2))
        assert on == off and len(on) == 30 and all(len(step) == 6 for step in on)


def test_a_model_on_the_torch_step_does_not_speculate():
    """Only the fused step's verify is exact: elsewhere "auto" proposes nothing (the same tokens, one at a time)."""
    model = GPT(tiny_config(**SHAPE)).eval()
    batch = RunningBatch(model)
    (row,) = batch.join([1, 2, 3, 1, 2, 3, 1, 2], SampleConfig(max_new_tokens=5, temperature=0, speculate="auto"))
    assert row.lookup is None
    with pytest.raises(GptlabError, match="speculate must be one of auto, off, not 'on'"):
        SampleConfig(speculate="on")


# ---- what a row proposes -----------------------------------------------------------------------------------------

def test_a_row_proposes_what_followed_the_last_earlier_occurrence_of_its_longest_ngram():
    lookup = Lookup([7, 1, 2, 3, 9, 9, 4, 1, 2, 3, 5, 6, 0, 2, 3])
    assert NGRAM_MAX == 3 and NGRAM_MIN == 2 and DRAFT_START == 4
    # (0, 2, 3) never occurred; (2, 3) last occurred before 5, 6, 0: the latest occurrence, DRAFT_START at most
    assert lookup.propose(10) == [5, 6, 0, 2]
    assert lookup.propose(2) == [5, 6]  # the caller's limit
    lookup.extend([8, 4, 1, 2, 3])  # (1, 2, 3) occurs twice before: the latest, then 5
    assert lookup.propose(10)[:1] == [5]
    lookup.extend([77])  # (3, 77) and 77 alone occurred nowhere (a single token is no n-gram to look up)
    assert lookup.propose(10) == []
    assert Lookup([4, 4, 4]).propose(10) == [4, 4, 4, 4]  # (4, 4) one token back: a period of one
    assert Lookup([5, 1, 2, 3, 1, 2]).propose(3) == [3, 1, 2]  # (1, 2) three tokens back: a period of three
    assert Lookup([1, 2]).propose(10) == []  # the newest n-gram itself is not an earlier occurrence


def test_proposals_grow_while_kept_shrink_when_refused_and_stop_after_off_after_refusals():
    lookup = Lookup()
    assert lookup.draft == DRAFT_START
    lookup.update(4, 4)
    assert lookup.draft == 8
    for _ in range(5):
        lookup.update(lookup.draft, lookup.draft)
    assert lookup.draft == DRAFT_MAX == 16
    lookup.update(16, 3)
    assert lookup.draft == 4  # one past what was kept
    lookup.update(4, 0)
    assert lookup.draft == 1 and lookup.refused == 1
    lookup.update(0, 0)  # nothing proposed: nothing learnt
    assert lookup.refused == 1 and (lookup.proposed, lookup.kept) == (4 + 8 + 4 * 16 + 16 + 4, 4 + 8 + 4 * 16 + 3)
    lookup.update(1, 1)
    assert lookup.refused == 0 and lookup.draft == 2
    assert OFF_AFTER == 8
    for i in range(OFF_AFTER):
        assert lookup.on, i
        lookup.update(1, 0)
    assert not lookup.on and Lookup([1, 2, 1, 2]).propose(5) == [1, 2, 1, 2]
    lookup.extend([1, 2, 1, 2])
    assert lookup.propose(5) == []  # a row that stopped proposing proposes nothing



# ---- predicted outputs, through the official openai client -------------------------------------------------------

@pytest.fixture(scope="module")
def predicting_server():
    """`gptlab serve` (speculate off: a prediction alone turns proposals on) of a char GPT with the chat markers, on
    the fused step."""
    from gptlab.serve.api import Limits
    from gptlab.serve.app import Served, make_app
    from gptlab.serve.server import start_server
    from gptlab.tokenizer import CharTokenizer, ChatTokenizer

    tokenizer = ChatTokenizer(CharTokenizer("abcdefghij ."))
    torch.manual_seed(0)
    model = GPT(tiny_config(**{**SHAPE, "vocab_size": tokenizer.vocab_size, "block_size": 96})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
        model.transformer.wte.weight[12:] = 0  # the markers' logits 0, below the likeliest letter's: answers go on
    prepared = prepare_for_inference(model, "fp32")
    if not prepared.fused:
        pytest.skip("no fused step: predictions are proposals of the fused step's speculation")
    running = start_server(make_app(Served("p", prepared, tokenizer, model.num_params(), lambda: model),
                                    Limits(max_tokens=60)))
    yield running
    running.stop()


@pytest.mark.device_path("fused decode (native)")
def test_a_predicted_output_gives_the_same_answer_and_counts_its_tokens_as_openai_does(predicting_server):
    """OpenAI's `prediction` in chat (the client's own parameter) and completions (its extra_body): the answer with
    the true answer predicted, with a wrong prediction and with none is the same text; usage's
    completion_tokens_details: the true prediction's tokens accepted, none rejected; the wrong one's rejected; no
    details without a prediction; a malformed prediction is a 400 naming it."""
    openai = pytest.importorskip("openai", reason="no openai client (pip install -e '.[test]')")
    client = openai.OpenAI(base_url=predicting_server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "abc abc"}]
    plain = client.chat.completions.create(model="p", messages=messages, seed=1, temperature=0.7, max_tokens=50)  # sampled: varied
    answer = plain.choices[0].message.content
    assert len(answer) > 10 and plain.usage.completion_tokens_details is None
    true = client.chat.completions.create(model="p", messages=messages, seed=1, temperature=0.7, max_tokens=50,
                                          prediction={"type": "content", "content": answer})
    assert true.choices[0].message.content == answer
    details = true.usage.completion_tokens_details
    assert details.rejected_prediction_tokens == 0 and details.accepted_prediction_tokens >= len(answer) // 2
    wrong = client.chat.completions.create(model="p", messages=messages, seed=1, temperature=0.7, max_tokens=50,
                                           prediction={"type": "content", "content": [{"type": "text",
                                                                                      "text": answer[::-1]}]})
    assert wrong.choices[0].message.content == answer
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0
    text = client.completions.create(model="p", prompt="abc abc abc", temperature=0, max_tokens=40).choices[0].text
    again = client.completions.create(model="p", prompt="abc abc abc", temperature=0, max_tokens=40,
                                      extra_body={"prediction": {"type": "content", "content": [
                                          {"type": "text", "text": text[:7]}, {"type": "text", "text": text[7:]}]}})
    assert again.choices[0].text == text  # the parts joined as they are: the true answer, none of it refused
    assert again.usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert again.usage.completion_tokens_details.rejected_prediction_tokens == 0
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="p", messages=messages, prediction={"type": "text", "content": "a"})
    assert caught.value.body["param"] == "prediction" and "prediction must be" in caught.value.body["message"]


# ---- the command line ------------------------------------------------------------------------------------------

@pytest.mark.device_path("fused decode (native)")
def test_sample_prints_the_same_text_with_speculate_auto_and_off(tmp_path, capsys, fused_kernel):
    """`gptlab sample --speculate auto` against `--speculate off` (the default): greedy and seeded, three samples,
    precisions fp32 and int8: the same text; `--speculate on` refused in one line."""
    from helpers import run_bad, run_ok, tiny_run

    run = tiny_run(tmp_path, 10, ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "64",
                                  "--batch-size", "4", "--eval-interval", "5", "--eval-batches", "2", "--quiet"])
    capsys.readouterr()
    for flags in (["--temperature", "0"], ["--seed", "5", "--num-samples", "3"]):
        for precision in ("fp32", "int8"):
            args = ["sample", "--run", str(run), "--prompt", "All:\nSpeak, speak.\n\nAll:", "--max-new-tokens", "50",
                    "--precision", precision, *flags]
            assert run_ok(capsys, *args, "--speculate", "auto") == run_ok(capsys, *args)
    assert "--speculate" in run_bad(capsys, "sample", "--run", str(run), "--speculate", "on")


# ---- a prediction's proposals, a row's counts, the batch's proposals ----------------------------------------------

def _left(ids):
    """A Prediction of `ids` whose output left it at once (its first token not ids[0]): it proposes by n-gram."""
    from gptlab.inference.speculate import Prediction

    prediction = Prediction(ids)
    prediction.follow(-1)
    assert prediction.at is None
    return prediction


def test_a_prediction_proposes_from_where_the_output_stands_in_it_and_after_it_left_from_its_ngrams():
    """A prediction proposes its tokens from where the output stands in it (its start at first), `count` at most; a
    token other than the next predicted one leaves it, and a predicted token does not bring it back: it proposes
    again only right after an occurrence of the n-gram the tokens end with (the longest first, NGRAM_MAX down to
    NGRAM_MIN, one of exactly the tokens there are, one ending just before its last token), at or after where the
    output last stood in it, never before."""
    from gptlab.inference.speculate import Prediction

    prediction = Prediction([5, 6, 7, 8, 9])
    assert prediction.propose([1, 2], 3) == [5, 6, 7] and prediction.propose([1, 2], 9) == [5, 6, 7, 8, 9]
    prediction.follow(5)
    assert prediction.propose([1, 2, 5], 3) == [6, 7, 8]
    prediction.follow(0)  # not 6: the output left it
    assert prediction.at is None and prediction.propose([1, 2, 5, 0], 3) == []  # (5, 0), (2, 5, 0) occur nowhere
    prediction.follow(6)
    assert prediction.at is None and prediction.propose([1, 2, 5, 0, 6], 3) == []
    assert _left([5, 6, 7, 8, 9]).propose([0, 6, 7], 3) == [8, 9]  # (0, 6, 7) occurs nowhere, (6, 7) does
    assert _left([5, 6, 7, 8, 9]).propose([0, 7, 8], 3) == [9]
    assert _left([5, 6, 7, 8, 9]).propose([6, 7], 3) == [8, 9]  # the row's two tokens are the n-gram
    assert _left([2, 3, 4, 1, 2, 3, 7, 8]).propose([0, 1, 2, 3], 2) == [7, 8]  # (1, 2, 3) before (2, 3)
    prediction = Prediction([1, 2, 3, 1, 2, 4])
    for token in (1, 2, 3):
        prediction.follow(token)
    prediction.follow(9)  # left where it stood after 3: (2, 3) is found there again
    assert prediction.propose([5, 1, 2, 3, 9, 2, 3], 3) == [1, 2, 4]
    prediction = Prediction([1, 2, 3, 1, 2, 4])
    for token in (1, 2, 3, 1, 9):  # left after 3, 1: (1, 2) is found after that, not at the start
        prediction.follow(token)
    assert prediction.propose([5, 1, 2, 3, 1, 9, 1, 2], 3) == [4]


def test_a_row_with_a_prediction_proposes_it_and_counts_its_tokens_kept_and_refused_over_the_row():
    """A Lookup with a prediction proposes the prediction's tokens (not its own n-grams') from where its output
    stands in the prediction, the output's tokens followed as they come (its first, drawn from the prompt's logits,
    included); of the proposals that came from the prediction, the tokens kept are `accepted` and the refused
    `rejected`, each summed over the row's checks."""
    from gptlab.inference.speculate import Prediction

    prediction = Prediction([5, 6, 7, 8, 9, 10])
    lookup = Lookup([1, 2, 1, 2], prediction=prediction)  # its own n-grams would propose 1, 2, ...
    lookup.extend([5])
    assert lookup.propose(3) == [6, 7, 8] and lookup.predicted
    lookup.update(3, 1)
    lookup.extend([6, 0])  # 6 kept, then 0 drawn, not 7: the output left the prediction
    assert (prediction.accepted, prediction.rejected) == (1, 2)
    assert lookup.propose(3) == [] and not lookup.predicted
    lookup.update(0, 0)
    lookup.extend([7])
    assert lookup.propose(3) == []
    lookup.extend([8])  # (7, 8) occurs in the prediction: it proposes again from there
    assert lookup.propose(3) == [9, 10] and lookup.predicted
    lookup.update(2, 0)
    assert (prediction.accepted, prediction.rejected) == (1, 4)


def test_rows_sharing_a_tally_add_up_what_each_proposed_and_kept():
    """A batch's Tally sums its rows' proposed and kept tokens over every check; each row counts its own."""
    from gptlab.inference.speculate import Tally

    tally = Tally()
    a, b = Lookup([1, 2, 1, 2], tally), Lookup([3, 3, 3], tally)
    a.update(4, 2)
    b.update(3, 3)
    a.update(2, 0)
    assert (tally.proposed, tally.kept) == (9, 5)
    assert (a.proposed, a.kept, b.proposed, b.kept) == (6, 2, 3, 3)


def test_a_new_row_proposes_up_to_its_limit_and_stops_after_exactly_off_after_refusals():
    """A limit of one proposes one token, of none nothing; a new row stops proposing after exactly OFF_AFTER
    refusals in a row, not before."""
    lookup = Lookup([4, 4, 4])
    assert lookup.propose(1) == [4] and lookup.propose(0) == []
    for i in range(OFF_AFTER):
        assert lookup.on, i
        proposal = lookup.propose(9)
        assert proposal == [4] * (DRAFT_START if i == 0 else 1), i  # one past none kept
        lookup.update(len(proposal), 0)
    assert not lookup.on and lookup.propose(9) == []


def test_asking_a_row_for_no_tokens_changes_nothing():
    """propose(0) (a row at its last token, or at the end of its cache) is [] and leaves the row as it was: its
    later proposals are those of a twin never asked, a prediction's too."""
    from gptlab.inference.speculate import Prediction

    rows = []
    for asked in (False, True):
        lookup = Lookup([7, 7], prediction=Prediction([1, 2, 3, 9, 1, 2, 3, 4, 5]))
        lookup.extend([9, 1, 2])  # 9 is not 1: the output left the prediction; (9, 1, 2) occurs in it
        if asked:
            assert lookup.propose(0) == []
        lookup.extend([3])
        rows.append((lookup.propose(3), lookup.prediction.at, lookup.prediction.floor))
    assert rows[0] == rows[1] and rows[0][0] == [9, 1, 2]


def test_a_batch_proposes_within_each_rows_tokens_left_and_its_cache_and_sets_the_cache_to_rows_filled():
    """`propose` (a step of the batch): each speculating row proposes at most row.left - 1 tokens (the token drawn
    after them is its last) at positions up to the cache's last (max_len - 1); the cache's positions are set to each
    row's `filled`; it answers whether any row proposes."""
    from types import SimpleNamespace

    from gptlab.inference.speculate import propose
    from gptlab.model import KVCache

    def row(left, filled, lookup=True):
        return SimpleNamespace(lookup=Lookup([4, 4, 4]) if lookup else None, left=left, filled=filled, drafts=[])

    cache = KVCache(1, 4, 1, 12, 2)
    rows = [row(2, 3), row(3, 3), row(20, 8), row(20, 5, lookup=False)]  # limits 1, 2, 12 - 1 - 8 = 3; none
    def draft(row, limit):
        return row.lookup.propose(limit) if row.lookup is not None else []

    assert propose(rows, cache, draft)
    assert [r.drafts for r in rows] == [[4], [4, 4], [4, 4, 4], []]
    assert cache.pos.tolist() == [3, 3, 8, 5]
    rows = [row(1, 4), row(20, 11)]  # a last token is drawn alone; a row at the cache's last position proposes none
    assert not propose(rows, KVCache(1, 2, 1, 12, 2), draft) and [r.drafts for r in rows] == [[], []]


@pytest.mark.device_path("fused decode (native)")
def test_after_a_verify_each_row_holds_the_logits_of_its_own_proposals(fused_kernel):
    """Two rows, each with its true output predicted: after the step that checked their proposals, each row's
    `logits` are those after its newest token and its `draft_logits` one row per proposed token (len(drafts), V),
    its own, not the next row's: bit for bit the logits the tokens after them are drawn from without speculation."""
    model = engine_model("fp32")
    cfg = SampleConfig(max_new_tokens=8, temperature=0)
    prompts = [[1, 2, 3, 4, 5], [9, 30, 41]]
    plain, _, _ = decode(model, prompts, cfg, 2)
    batch = RunningBatch(model)
    rows = [row for p, out in zip(prompts, plain) for row in batch.join(p, cfg, prediction=[t for t, _ in out])]
    assert [token for _, token, _ in batch.sample()] == [out[0][0] for out in plain]
    batch.advance()
    for row, out in zip(rows, plain):
        assert row.drafts == [t for t, _ in out[1:1 + DRAFT_START]]
        assert row.draft_logits.shape == (DRAFT_START, SHAPE["vocab_size"])
        assert torch.equal(row.logits, out[1][1])
        assert all(torch.equal(row.draft_logits[j:j + 1], out[2 + j][1]) for j in range(DRAFT_START))


@pytest.mark.device_path("fused decode (native)")
def test_a_batch_tallies_what_all_its_rows_proposed_and_kept(fused_kernel):
    """RunningBatch.tally (what /metrics reads) is the sum over its rows, those that left included."""
    model = engine_model("fp32")
    batch = RunningBatch(model)
    cfg = SampleConfig(max_new_tokens=20, temperature=0, speculate="auto")
    rows = [row for p in repetitive_prompts(6) for row in batch.join(p, cfg)]
    while batch.rows:
        batch.sample()
        batch.advance()
    assert batch.tally.proposed == sum(r.lookup.proposed for r in rows) > 0
    assert batch.tally.kept == sum(r.lookup.kept for r in rows) > 0
