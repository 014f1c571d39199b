"""Benchmark tasks (gptlab/tasks): each continuation's log-likelihood against the model's plain forward over the
harness's window, the pair encoding and HellaSwag's preprocessing against lm-evaluation-harness's own functions, the
measures on numbers worked out by hand, few-shot drawing, bad task files, and `gptlab eval --task` end to end."""

import json
import math
import random
import re
import time
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import perturbed

from gptlab.cli import main
from gptlab.config import ModelConfig
from gptlab.errors import GptlabError
from gptlab.model import GPT
from gptlab.tasks.items import LANGUAGE_MODELLING, MULTIPLE_CHOICE, SCHEMA, Item, read_task
from gptlab.tasks.measure import bootstrap, evaluate_items, fewshot_prefix, judge
from gptlab.tasks.score import Scored, encode_pair, score_pairs
from gptlab.tokenizer import CharTokenizer, GPT2Tokenizer

TASKS = Path(__file__).parent / "data" / "tasks"
FIXTURES = {"hellaswag": MULTIPLE_CHOICE, "choices": MULTIPLE_CHOICE, "schema": SCHEMA, "lambada": LANGUAGE_MODELLING}


def fixture_text() -> str:
    """Every string of the fixture files (a char vocabulary that covers them, with the few-shot delimiter), HellaSwag
    records as llm.c reads them too."""
    out = []
    for name in FIXTURES:
        for item in read_task(TASKS / f"{name}.jsonl"):
            out += [*item.contexts, *item.continuations, *([item.llmc[0], *item.llmc[1]] if item.llmc else [])]
    return "\n\n".join(out) + " :."


@lru_cache
def moved_model(vocab_size: int, block_size: int = 48) -> GPT:
    """A GPT with every parameter moved off its init: far from uniform predictions, so a wrong position or token
    changes the sums."""
    torch.manual_seed(vocab_size + block_size)
    return perturbed(GPT(ModelConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=3, n_embd=24,
                                     dropout=0.0)).eval())


def plain_scores(model, context, continuation):
    """The harness's computation, written out: the window (context + continuation)[-(block + 1):][:-1] through the
    model's forward without a cache, the last len(continuation) positions' log-softmax at the continuation."""
    block = model.config.block_size
    window = (context + continuation)[-(block + 1):][:-1]
    with torch.no_grad():
        logits, _ = model(torch.tensor([window]))
    logprobs = logits[0, -len(continuation):].double().log_softmax(-1)
    target = torch.tensor(continuation)
    return logprobs.gather(1, target[:, None]).sum().item(), bool((logprobs.argmax(-1) == target).all())


# ---- the numbers: log-likelihoods against the plain forward -----------------------------------------------------

def test_contexts_of_two_tokens_are_prefilled_too():
    """Every context of a batch two tokens long: the prefill is one position (its first token), the options' rows
    start from its second; in fp32 and under bf16 autocast (within bf16's rounding of the fp32 sums)."""
    model = moved_model(37)
    pairs = [([3, 4], [5, 6, 7]), ([8, 9], [1]), ([3, 4], [2, 2])]
    fp32 = score_pairs(model, pairs)
    for (context, continuation), s in zip(pairs, fp32):
        assert abs(s.loglikelihood - plain_scores(model, context, continuation)[0]) <= 1e-5
    for s, b in zip(fp32, score_pairs(model, pairs, "bf16")):
        assert abs(s.loglikelihood - b.loglikelihood) <= 0.05 * (1 + abs(s.loglikelihood))


def test_both_forwards_run_in_the_precision_asked_for(monkeypatch):
    """The prefill and the options' forward each under the caller's precision (an fp32 second forward over a bf16
    cache is off a bf16 forward by bf16's rounding, inside the tolerance above)."""
    from gptlab.tasks import score

    seen, real = [], score.autocast
    monkeypatch.setattr(score, "autocast", lambda device, precision: seen.append((device.type, precision)) or
                        real(device, precision))
    score_pairs(moved_model(37), [([3, 4, 5], [6, 7]), ([8, 9, 1], [2])], "bf16")
    assert seen == [("cpu", "bf16"), ("cpu", "bf16")]


@pytest.mark.parametrize("positions", [1, 40, 1024])
def test_shared_contexts_crops_and_lengths_score_as_the_plain_forward(positions):
    """Pairs sharing a context (one prefill), continuations of 1 to 9 tokens, contexts cut at the start to fit the
    48-token context (each option keeps what fits, so options of one item may keep different amounts), batched a
    group at a time, a few groups, or all at once: all within 1e-5 of the plain forward; greedy agrees."""
    model, rng = moved_model(37), random.Random(0)
    pairs = []
    for _ in range(6):
        context = [rng.randrange(37) for _ in range(rng.choice([1, 5, 30, 44, 60]))]
        for _ in range(rng.randrange(1, 5)):
            pairs.append((context, [rng.randrange(37) for _ in range(rng.randrange(1, 10))]))
    scored = score_pairs(model, pairs, positions=positions)
    assert any(s.cropped for s in scored) and not all(s.cropped for s in scored)
    for (context, continuation), s in zip(pairs, scored):
        expected, greedy = plain_scores(model, context, continuation)
        assert abs(s.loglikelihood - expected) <= 1e-5 and s.greedy == greedy and s.tokens == len(continuation)
        assert s.cropped == (len(context) + len(continuation) > 49)


def test_a_continuation_the_model_predicts_greedily_is_greedy():
    model = moved_model(37)
    context, greedy = [3, 1, 4, 1, 5], []
    for _ in range(4):  # the model's own greedy continuation, one token at a time
        with torch.no_grad():
            logits, _ = model(torch.tensor([context + greedy]))
        greedy.append(int(logits[0, -1].argmax()))
    wrong = greedy[:-1] + [(greedy[-1] + 1) % 37]
    assert [s.greedy for s in score_pairs(model, [(context, greedy), (context, wrong)])] == [True, False]


def test_a_continuation_longer_than_the_context_is_refused():
    model = moved_model(37)
    long = [rng % 37 for rng in range(48)]
    scored = score_pairs(model, [([5, 6], long)])  # 48 predictions from 48 positions: the context keeps its last
    assert scored[0].cropped and abs(scored[0].loglikelihood - plain_scores(model, [5, 6], long)[0]) <= 1e-5
    with pytest.raises(GptlabError, match="a continuation of 49 tokens is longer than the model's context of 48 "
                                          "tokens"):
        score_pairs(model, [([1], [2] * 49)])


# ---- the harness's own rules --------------------------------------------------------------------------------------

def test_pairs_are_encoded_as_the_harness_encodes_them():
    """lm-evaluation-harness's TemplateLM._encode_pair (a causal model) on gptlab's GPT-2 tokenizer: trailing spaces
    move to the continuation, a merge across the boundary belongs to it."""
    from lm_eval.api.model import TemplateLM

    tokenizer = GPT2Tokenizer()
    harness = SimpleNamespace(backend="causal", tok_encode=lambda text, **_: tokenizer.encode(text))
    for context, continuation in [("The cat sat on the", " mat."), ("Trailing spaces   ", "go along"),
                                  ("Ein Hund, ein", " Kätzchen 中文"), ("don", "'t split"), ("x\n\n", "y")]:
        assert encode_pair(tokenizer, context, continuation) == \
            TemplateLM._encode_pair(harness, context, continuation)


def test_an_end_of_text_in_a_task_s_text_is_the_end_of_text_token_in_every_rendering():
    """As the harness encodes its requests (tok_encode allows the special token): the options' contexts and llm.c's
    rendering of a HellaSwag record alike."""
    from gptlab.tasks.measure import item_pairs

    tokenizer = GPT2Tokenizer()
    eot, enc = tokenizer.eot_id, tokenizer.encode
    item = Item(MULTIPLE_CHOICE, ("Story one.<|endoftext|>Story two",), ("ends.", "stops."), 0, 1,
                llmc=("Story one.<|endoftext|>Story two", ("ends.", "<|endoftext|>")))
    pairs = item_pairs(tokenizer, item, "A<|endoftext|>", "t:1")
    context = [*enc("A"), eot, *enc("Story one."), eot, *enc("Story two")]
    assert pairs == [(context, enc(" ends.")), (context, enc(" stops.")), (context, enc(" ends.")),
                     (context, [*enc(" "), eot])]


def test_hellaswag_records_read_as_the_harness_preprocesses_them():
    from lm_eval.tasks.hellaswag import utils

    items = read_task(TASKS / "hellaswag.jsonl")
    records = [json.loads(line) for line in (TASKS / "hellaswag.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(items) == len(records) == 20
    for item, doc in zip(items, records):
        expected = utils.preprocess(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
        assert item.contexts == (expected,) and item.label == int(doc["label"])
        assert list(item.continuations) == [utils.preprocess(e) for e in doc["endings"]]
        assert item.options == [(expected, " " + utils.preprocess(e)) for e in doc["endings"]]
    assert "[" not in "".join(c for item in items for c in item.contexts + item.continuations)  # tags are gone


@pytest.mark.parametrize("name", FIXTURES)
def test_each_fixture_reads_as_its_kind(name):
    items = read_task(TASKS / f"{name}.jsonl")
    assert len(items) == 20 and {item.kind for item in items} == {FIXTURES[name]}
    assert [item.line for item in items] == list(range(1, 21))


# ---- the measures, by hand ----------------------------------------------------------------------------------------

def scored(*rows):
    return [Scored(ll, tokens, False, False) for ll, tokens in rows]


def test_multiple_choice_measures_worked_by_hand():
    """Options "a" (1 char), "bbbb" (4), "cc" (2) with log-likelihoods -3, -4, -5 and 1, 2, 4 tokens: acc takes the
    highest sum (a: -3), acc_norm the highest per character (b: -4/4 = -1 over a's -3 and c's -2.5), the token mean
    the highest per token (c: -5/4 = -1.25 over a's -3 and b's -2)."""
    item = Item(MULTIPLE_CHOICE, ("ctx",), ("a", "bbbb", "cc"), 0, 1)
    rows = scored((-3.0, 1), (-4.0, 2), (-5.0, 4))
    assert judge(item, rows) == {"line": 1, "label": 0, "loglikelihoods": [-3.0, -4.0, -5.0], "acc": 1.0,
                                 "acc_norm": 0.0, "token_means": [-3.0, -2.0, -1.25], "acc_token_mean": 0.0}
    assert judge(Item(MULTIPLE_CHOICE, ("ctx",), ("a", "bbbb", "cc"), 1, 1), rows)["acc_norm"] == 1.0
    assert judge(Item(MULTIPLE_CHOICE, ("ctx",), ("a", "bbbb", "cc"), 2, 1), rows)["acc_token_mean"] == 1.0
    ties = Item(MULTIPLE_CHOICE, ("ctx",), ("xx", "yy"), 1, 1)  # equal everything: the first option wins
    assert judge(ties, scored((-2.0, 1), (-2.0, 1)))["acc"] == 0.0


def test_schema_and_language_modelling_measures_worked_by_hand():
    schema = Item(SCHEMA, ("first context", "second"), ("goes on",), 1, 3)
    assert judge(schema, scored((-6.0, 3), (-5.0, 2))) == {"line": 3, "label": 1, "loglikelihoods": [-6.0, -5.0],
                                                           "acc": 1.0, "token_means": [-2.0, -2.5],
                                                           "acc_token_mean": 0.0}  # -2 > -2.5
    lm = Item(LANGUAGE_MODELLING, ("ctx",), ("word",), 0, 2)
    assert judge(lm, [Scored(-0.5, 1, True, False)])["acc"] == 1.0
    assert judge(lm, [Scored(-0.1, 1, False, False)])["acc"] == 0.0


def test_the_bootstrap_interval_surrounds_the_mean():
    assert bootstrap([1.0] * 30) == (1.0, 1.0)
    low, high = bootstrap([0.0, 1.0] * 50)
    # the mean of 100 fair coin flips: standard error 0.05, so the 95 % interval is about 0.5 +- 0.098
    assert 0.38 <= low <= 0.43 and 0.57 <= high <= 0.62
    assert bootstrap([0.0, 1.0] * 50) == (low, high)  # seeded: the same interval every run
    spread = [(i * 37 % 101) / 100 for i in range(101)]  # 101 distinct values: each seed draws its own interval
    assert bootstrap(spread) == bootstrap(spread) != bootstrap(spread, seed=1)


# ---- few-shot -----------------------------------------------------------------------------------------------------

def test_fewshot_examples_are_other_items_answered_and_the_same_under_a_limit():
    items = read_task(TASKS / "choices.jsonl")
    for index in range(len(items)):
        prefix = fewshot_prefix(items, index, 19, seed=5)  # every other item: all but this one
        examples = prefix.split("\n\n")[:-1]
        assert len(examples) == 19 and items[index].worked_example() not in examples
        assert sorted(examples) == sorted(items[j].worked_example() for j in range(20) if j != index)
    first = fewshot_prefix(items, 3, 2, seed=5)
    assert first.endswith("\n\n") and first.count("\n\n") == 2 and first != fewshot_prefix(items, 3, 2, seed=6)
    answered = items[0]
    assert answered.worked_example() == answered.contexts[0] + " " + answered.continuations[answered.label]
    with pytest.raises(GptlabError, match="--num-fewshot 20 needs at least 21 items in the file, which has 20"):
        fewshot_prefix(items, 0, 20, seed=5)


# ---- bad task files: one line naming the file and line ---------------------------------------------------------

H = '{"activity_label": "A", "ctx_a": "a", "ctx_b": "b", "endings": ["x", "y"], "label": 0'  # a HellaSwag record
BAD = {
    "missing field": ('{"context": "a", "choices": ["x", "y"]}', "field 'label' must be the index"),
    "missing context": ('{"choices": ["x", "y"], "label": 0}', "field 'context' must be a string, and is missing"),
    "context not text": ('{"context": 3, "choices": ["x", "y"], "label": 0}', "field 'context' must be a string"),
    "label out of range": ('{"context": "a", "choices": ["x", "y"], "label": 2}',
                           "label 2 is out of range for 2 options (0 to 1)"),
    "empty choice": ('{"context": "a", "choices": ["x", " "], "label": 0}', "choices[1] is empty"),
    "one choice": ('{"context": "a", "choices": ["x"], "label": 0}', "must be a list of at least 2 strings"),
    "not JSON": ('{"context": "a", ', "not JSON"),
    "not an object": ('["a", "b"]', "a record must be a JSON object"),
    "unknown form": ('{"question": "a", "answer": "b"}', "not a task record: expected HellaSwag's fields (activity_"
                     'label, ctx_a, ctx_b, endings, label), {"context", "choices", "label"}, {"contexts", '
                     '"continuation", "label"} or {"context", "continuation"}'),
    "a context alone": ('{"context": "a"}', "not a task record: expected HellaSwag's fields"),
    "empty context": ('{"context": "", "continuation": "b"}', "field 'context' is empty"),
    "HellaSwag's ctx_a empty": ('{"activity_label": "A", "ctx_a": " ", "ctx_b": "b", "endings": ["x", "y"], '
                                '"label": 0}', "field 'ctx_a' is empty"),
    "HellaSwag's ctx_b not text": ('{"activity_label": "A", "ctx_a": "a", "ctx_b": 5, "endings": ["x", "y"], '
                                   '"label": 0}', "field 'ctx_b' must be a string"),
    "HellaSwag's activity label empty": (H.replace('"A"', '""') + "}", "field 'activity_label' is empty"),
    "HellaSwag's one ending": (H.replace('["x", "y"]', '["x"]') + "}", "field 'endings' must be a list of at least 2"),
    "HellaSwag's ctx empty": (H + ', "ctx": ""}', "field 'ctx' is empty"),
    "HellaSwag's label not a number": (H.replace('"label": 0', '"label": "x"') + "}", "field 'label' must be the index"),
    "HellaSwag's label out of range": (H.replace('"label": 0', '"label": "2"') + "}",
                                       "label 2 is out of range for 2 options (0 to 1)"),
    "schema's one context": ('{"contexts": ["a"], "continuation": "b", "label": 0}',
                             "field 'contexts' must be a list of at least 2 strings"),
    "schema's continuation not text": ('{"contexts": ["a", "b"], "continuation": 1, "label": 0}',
                                       "field 'continuation' must be a string"),
    "schema's label missing": ('{"contexts": ["a", "b"], "continuation": "c"}', "field 'label' must be the index"),
    "schema's label out of range": ('{"contexts": ["a", "b"], "continuation": "c", "label": 2}',
                                    "label 2 is out of range for 2 options (0 to 1)"),
    "continuation not text": ('{"context": "a", "continuation": ["b"]}', "field 'continuation' must be a string"),
    "mixed kinds": ('{"context": "a", "continuation": "b"}\n{"context": "a", "choices": ["x", "y"], "label": 0}',
                    "a multiple choice record in a file of language modelling records"),
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_record_is_one_line_with_its_file_and_line(name, tmp_path):
    text, message = BAD[name]
    path = tmp_path / "t.jsonl"
    path.write_text('{"context": "ok", "continuation": "fine"}\n\n' + text + "\n" if name == "mixed kinds"
                    else '{"context": "ok", "choices": ["x", "y"], "label": 1}\n\n' + text + "\n", encoding="utf-8")
    with pytest.raises(GptlabError) as caught:
        read_task(path)
    line = 4 if name == "mixed kinds" else 3
    assert str(caught.value).startswith(f"{path}:{line}: ") and message in str(caught.value)
    if name == "context not text":
        assert str(caught.value).endswith("must be a string")  # present, but not text: nothing said of missing
    assert "\n" not in str(caught.value)


def test_a_second_record_of_another_kind_and_a_file_that_cannot_be_read_are_one_line(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text('{"context": "a", "continuation": "b"}\n{"context": "a", "choices": ["x", "y"], "label": 0}\n')
    with pytest.raises(GptlabError) as caught:
        read_task(path)
    assert str(caught.value) == (f"{path}:2: a multiple choice record in a file of language modelling records; keep "
                                 "one kind per file")
    with pytest.raises(GptlabError) as caught:
        read_task(tmp_path)  # a folder: the OS's reason, as it words it
    assert str(caught.value) == f"cannot read task file {tmp_path}: Is a directory"


def test_bytes_that_are_not_utf8_and_an_empty_file_are_refused(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"context": "a", "continuation": "b"}\n{"context": "caf\xe9", "continuation": "b"}\n')
    with pytest.raises(GptlabError, match=r"latin.jsonl:2: not UTF-8 text \(byte 0xe9\)"):
        read_task(path)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(GptlabError, match="empty.jsonl holds no task records"):
        read_task(tmp_path / "empty.jsonl")


def test_a_task_file_starting_with_a_utf8_byte_order_mark_reads_as_without_it(tmp_path):
    records = b'{"context": "a", "continuation": "b"}\r\n{"context": "c", "continuation": "d"}\r\n'
    (tmp_path / "plain.jsonl").write_bytes(records)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + records)  # as Windows' Notepad saves UTF-8
    assert read_task(tmp_path / "bom.jsonl") == read_task(tmp_path / "plain.jsonl")
    (tmp_path / "bad.jsonl").write_bytes(b"\xef\xbb\xbf" + records + b'{"context": "caf\xe9"}\n')
    with pytest.raises(GptlabError, match=r"bad.jsonl:3: not UTF-8 text \(byte 0xe9\)"):
        read_task(tmp_path / "bad.jsonl")


def test_a_char_model_meeting_unseen_characters_says_which_and_where():
    tokenizer = CharTokenizer("abc xyzr")
    items = [Item(MULTIPLE_CHOICE, ("abc",), ("xyz", "zéro"), 0, 7)]
    with pytest.raises(GptlabError, match=r"^t.jsonl:7: the text has 2 character\(s\) the char vocabulary has never "
                                          r"seen: 'o', 'é'"):
        evaluate_items(moved_model(tokenizer.vocab_size), tokenizer, items, "t.jsonl")
    with pytest.raises(GptlabError, match=r"^task:7: the text has 2"):  # a task given no name is "task"
        evaluate_items(moved_model(tokenizer.vocab_size), tokenizer, items)


def test_eval_help_shows_the_task_flags_with_their_meaning(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps help at the terminal's width: one line per flag here
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--help"])
    shown = [" ".join(line.split()) for line in capsys.readouterr().out.split("\n  --")]
    assert exit_.value.code == 0
    assert shown[shown.index(next(s for s in shown if s.startswith("task FILE"))):] == [
        "task FILE a task file (JSONL: multiple choice, HellaSwag's records, schema or language modelling) or a "
        "folder of them, to score the run on instead of text; repeatable",
        "limit LIMIT score only the first N items of each task file",
        "num-fewshot NUM_FEWSHOT worked examples from the same file before each item (never the item itself; "
        "default 0)",
        "seed SEED which few-shot examples are drawn (default 1234)",
        "no-save print the scores without writing them to RUN/evals/",
        "lm-eval TASKS run lm-evaluation-harness tasks (comma-separated names) on the run through gptlab's harness "
        "model, with --limit and --num-fewshot; needs the eval extra (pip install 'gptlab[eval]')",
        "lm-eval-include FOLDER a folder of the harness's task YAML files to add to (or, with "
        "--lm-eval-only-include, use instead of) its own tasks",
        "lm-eval-only-include only the tasks under --lm-eval-include (faster: the harness's own are not indexed)"]


def test_scoring_defaults_to_fp32_and_the_seed_of_the_command_line_and_refuses_a_precision_it_has_not():
    """evaluate_items' defaults are eval --task's: fp32 (the weights' own, no autocast) and few-shot seed 1234; a
    precision that is no prepared one ("auto" unresolved, a typo) is refused, not scored as fp32."""
    tokenizer = CharTokenizer(fixture_text())
    model, items = moved_model(tokenizer.vocab_size, 96), read_task(TASKS / "choices.jsonl")
    start = time.perf_counter()
    default = evaluate_items(model, tokenizer, items, num_fewshot=1, limit=6)
    took = time.perf_counter() - start
    assert default.per_item == evaluate_items(model, tokenizer, items, "task", "fp32", 1, 1234, 6).per_item
    assert default.per_item != evaluate_items(model, tokenizer, items, "task", "fp32", 1, 1235, 6).per_item
    assert 0 < default.seconds <= took  # the call's own time
    for precision in ("auto", "FP32", "fp16"):
        with pytest.raises(GptlabError, match=f"^precision must be one of fp32, bf16, int8, not '{precision}'$"):
            evaluate_items(model, tokenizer, items, precision=precision, limit=1)


# ---- a whole task, and the CLI --------------------------------------------------------------------------------------

def test_a_task_scores_each_item_as_its_options_plain_forwards_say():
    """evaluate_items on the multiple-choice fixture with a char model: each item's measures recomputed here from
    the plain forward of each option (encoded separately, no cache), and the mean is acc's value."""
    tokenizer = CharTokenizer(fixture_text())
    model, items = moved_model(tokenizer.vocab_size, 96), read_task(TASKS / "hellaswag.jsonl")
    result = evaluate_items(model, tokenizer, items, limit=12)
    assert result.items == 12 and result.kind == MULTIPLE_CHOICE and set(result.measures) == \
        {"acc", "acc_norm", "acc_token_mean"}
    accs = []
    for item, row in zip(items, result.per_item):
        lls = []
        for context, continuation in item.options:
            ids = tokenizer.encode(context), tokenizer.encode(continuation)  # chars: no merge across the boundary
            lls.append(plain_scores(model, *ids)[0])
        assert np.allclose(row["loglikelihoods"], lls, atol=1e-4)
        norm = [ll / len(text) for ll, text in zip(lls, item.continuations)]
        assert row["acc"] == float(int(np.argmax(lls)) == item.label)
        assert row["acc_norm"] == float(int(np.argmax(norm)) == item.label)
        accs.append(row["acc"])
    assert result.measures["acc"].value == pytest.approx(sum(accs) / 12)
    assert result.measures["acc"].low <= result.measures["acc"].value <= result.measures["acc"].high


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    """A char run trained a few steps on the fixtures' own text (its vocabulary covers them)."""
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "corpus.txt").write_text(fixture_text() * 3, encoding="utf-8")
    tiny = ["--n-layer", "1", "--n-head", "2", "--n-embd", "24", "--block-size", "64", "--batch-size", "4",
            "--eval-interval", "5", "--eval-batches", "1", "--precision", "fp32", "--quiet"]
    assert main(["prepare", str(folder / "corpus.txt"), "--out", str(folder / "data"), "--quiet"]) == 0
    assert main(["train", "--data", str(folder / "data"), "--run", str(folder / "run"), "--max-steps", "6",
                 *tiny]) == 0
    return folder / "run"


def test_eval_task_prints_each_measure_and_keeps_the_results_in_the_run(task_run, capsys):
    assert main(["eval", "--run", str(task_run), "--task", str(TASKS), "--precision", "fp32", "--limit", "5"]) == 0
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert lines[0].split() == ["task", "kind", "measure", "value", "95%", "interval", "items", "items/s"]
    measures = [(Path(line.split()[0]).stem, re.search(r" (acc\w*) ", line).group(1)) for line in lines[1:]]
    assert measures == [("choices", "acc"), ("choices", "acc_norm"), ("choices", "acc_token_mean"),
                        ("hellaswag", "acc"), ("hellaswag", "acc_norm"), ("hellaswag", "acc_token_mean"),
                        ("lambada", "acc"), ("schema", "acc"), ("schema", "acc_token_mean")]
    # this call's files (other tests judge the same run: their limits and shots name theirs apart, in any order)
    saved = sorted((task_run / "evals").glob("*-fp32-limit5.json"))
    assert [p.name.split("-")[0] for p in saved] == ["choices", "hellaswag", "lambada", "schema"]
    assert all(f"saved {p}" in err for p in saved)
    result = json.loads(saved[1].read_text())
    assert result["items"] == 5 and result["precision"] == "fp32" and result["limit"] == 5
    assert result["run"] == str(task_run) and result["task"] == str(TASKS / "hellaswag.jsonl")
    assert result["checkpoint"] == str(task_run / "checkpoints" / f"best-{result['step']:08d}")
    assert (result["num_fewshot"], result["seed"]) == (0, 1234)
    assert saved[1].name == f"hellaswag-{result['sha256'][:8]}-step{result['step']}-fp32-limit5.json"
    assert len(result["per_item"]) == 5 and all(len(r["loglikelihoods"]) == 4 for r in result["per_item"])
    acc = result["measures"]["acc"]
    assert acc["value"] == pytest.approx(sum(r["acc"] for r in result["per_item"]) / 5)
    shown = next(line for line in lines if line.startswith(str(TASKS / "hellaswag.jsonl")[-32:]) and " acc " in line)
    assert f"{acc['value']:.4f}" in shown
    assert shown.split(maxsplit=1)[1].startswith(result["kind"] + " ") and 0 <= result["cropped"] <= 5
    assert isinstance(result["seconds"], float) and 0 < result["seconds"] == round(result["seconds"], 3)


def test_eval_task_json_fewshot_and_bad_flags(task_run, capsys):
    args = ["eval", "--run", str(task_run), "--task", str(TASKS / "choices.jsonl"), "--precision", "fp32",
            "--limit", "4", "--no-save", "--json"]
    assert main(args) == 0
    zero = json.loads(capsys.readouterr().out)
    assert main([*args, "--num-fewshot", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert zero[0]["items"] == two[0]["items"] == 4 and zero[0]["kind"] == "multiple choice"
    assert main([*args[:7], "--limit", "1", "--no-save", "--json"]) == 0  # the fewest items
    assert json.loads(capsys.readouterr().out)[0]["items"] == 1
    assert not (task_run / "evals" / "choices").exists()
    for flags, message in [(["--limit", "0"], "--limit must be >= 1, not 0"),
                           (["--num-fewshot", "-1"], "--num-fewshot must be >= 0, not -1"),
                           (["--task", "nowhere.jsonl"], "task file nowhere.jsonl does not exist"),
                           (["--task", str(TASKS), "--data", "x"], "--task and --lm-eval score tasks, not text")]:
        assert main(["eval", "--run", str(task_run), "--task", str(TASKS / "choices.jsonl"), *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and err.strip().count("\n") == 0, err
    assert math.isfinite(zero[0]["measures"]["acc"]["value"])


def test_eval_task_takes_files_and_folders_in_order_in_the_precision_asked(task_run, tmp_path, capsys):
    """--task FILE --task FOLDER scores the file, then the folder's files in name order; an empty folder is refused
    in one line; the precision asked is the one scored and named in the saved file ("auto": bf16 only where the CPU
    multiplies it natively, scoring being torch's forward)."""
    from gptlab.runtime import bf16_supported

    (tmp_path / "empty").mkdir()
    assert main(["eval", "--run", str(task_run), "--task", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert f"task folder {tmp_path / 'empty'} holds no .jsonl files" in err and err.strip().count("\n") == 0
    flags = ["eval", "--run", str(task_run), "--limit", "3", "--json"]
    assert main([*flags, "--task", str(TASKS / "lambada.jsonl"), "--task", str(TASKS), "--precision", "int8"]) == 0
    scored = [row["task"] for row in json.loads(capsys.readouterr().out)]
    assert scored == [str(TASKS / "lambada.jsonl")] + [str(f) for f in sorted(TASKS.glob("*.jsonl"))]
    assert len(list((task_run / "evals").glob("*-step6-int8-limit3.json"))) == len(scored) - 1  # lambada's twice
    assert main([*flags, "--task", str(TASKS / "choices.jsonl"), "--precision", "auto"]) == 0
    auto = "bf16" if bf16_supported(torch.device("cpu")) else "fp32"
    assert list((task_run / "evals").glob(f"choices-*-step6-{auto}-limit3.json"))


def test_eval_task_shows_each_files_progress_on_a_terminal(task_run, monkeypatch):
    """On a terminal, each task file gets a progress bar: its name, items done of the items to score (--limit's;
    the bar is redrawn at most every 0.1 s and cleared at the end, so its first drawing is what is sure to show)."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["eval", "--run", str(task_run), "--task", str(TASKS / "choices.jsonl"), "--precision", "fp32",
                 "--limit", "3", "--no-save"]) == 0
    shown = terminal.getvalue()
    assert re.search(r"choices\.jsonl: +0%\|.*\| 0/3 \[", shown) and "item/s" in shown, shown  # at its start
    terminal.seek(0), terminal.truncate()
    import functools

    import tqdm
    monkeypatch.setattr(tqdm.tqdm, "__init__", functools.partialmethod(tqdm.tqdm.__init__, mininterval=0))
    assert main(["eval", "--run", str(task_run), "--task", str(TASKS / "choices.jsonl"), "--precision", "fp32",
                 "--limit", "3", "--no-save"]) == 0
    shown = terminal.getvalue()
    assert re.findall(r"\| (\d)/3 \[", shown) == ["0", "1", "2", "3"], shown  # a step per item scored
    screen = []  # what the terminal shows at the end: each line's drawings, one over the other from its start
    for line in shown.split("\n"):
        seen = ""
        for drawing in line.split("\r"):
            seen = drawing + seen[len(drawing):]
        screen.append(seen.strip())
    assert not any("%|" in line or "item/s" in line for line in screen), screen  # the bar is cleared when done


def test_eval_task_draws_no_bar_where_stderr_is_no_terminal_and_names_the_file_of_an_item_it_cannot_score(
        task_run, tmp_path, capsys):
    assert main(["eval", "--run", str(task_run), "--task", str(TASKS / "choices.jsonl"), "--precision", "fp32",
                 "--limit", "3", "--no-save", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "%|" not in err and "item/s" not in err and "0/3" not in err, err  # not a terminal: no bar at all
    assert err.splitlines()[1:] == [f"gptlab: {TASKS / 'choices.jsonl'}: 3 item(s) had their context cut at the "
                                    "start to fit the model's context"]  # each of the 3 longer than the 64 tokens
    assert json.loads(out)[0]["cropped"] == 3
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"context": "ROMEO:", "choices": ["a", "the " * 20], "label": 0}) + "\n",  # " " + 80
                    encoding="utf-8")
    assert main(["eval", "--run", str(task_run), "--task", str(long), "--no-save"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"{long}:1: a continuation of 81 tokens is longer than the model's context of 64 tokens")


def test_eval_task_scores_in_bf16_when_asked_on_any_cpu(task_run, capsys):
    """bf16 scoring is autocast over the fp32 weights: the log-likelihoods move by bf16's rounding, no more."""
    flags = ["eval", "--run", str(task_run), "--task", str(TASKS / "choices.jsonl"), "--limit", "4"]
    per_item = {}
    for precision in ("fp32", "bf16"):
        assert main([*flags, "--precision", precision]) == 0
        (saved,) = (task_run / "evals").glob(f"choices-*-{precision}-limit4.json")
        result = json.loads(saved.read_text())
        assert result["precision"] == precision
        per_item[precision] = [ll for row in result["per_item"] for ll in row["loglikelihoods"]]
    capsys.readouterr()
    moved = [abs(a - b) for a, b in zip(per_item["fp32"], per_item["bf16"])]
    assert len(moved) == 12 and 0 < max(moved) < 0.05 * max(abs(a) for a in per_item["fp32"]), moved


def test_a_run_is_judged_while_a_training_holds_its_lock(task_run, capsys):
    """eval --task reads the committed checkpoint and writes only RUN/evals/: a training's lock does not stop it."""
    from gptlab.rundir import RunLock

    with RunLock(task_run):
        assert main(["eval", "--run", str(task_run), "--task", str(TASKS / "lambada.jsonl"), "--precision", "fp32",
                     "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "lambada.jsonl" in out and " acc " in out
    assert list((task_run / "evals").glob("lambada-*-limit2.json"))


# ---- past the first batch, and the measures' own rules (issue: checks that cross every boundary) ------------------

def test_the_bootstrap_interval_is_the_95_percent_one():
    """200 values spread evenly over [0, 1]: the bootstrap distribution of their mean is normal to well within the
    tolerance, so its 2.5th and 97.5th percentiles are the mean -/+ 1.95996 standard errors (the closed form, from
    the normal quantile); the 5th and 95th (-/+ 1.64485) lie 0.31 standard errors inside, three tolerances away."""
    from statistics import NormalDist

    values = (np.arange(200) + 0.5) / 200
    se = values.std() / math.sqrt(len(values))  # the resampled mean's spread: the population sd over sqrt(n)
    z = NormalDist().inv_cdf(0.975)
    low, high = bootstrap(values, resamples=20_000)  # Monte Carlo error of a 2.5 % point: about 0.02 se
    assert abs(low - (0.5 - z * se)) <= 0.1 * se and abs(high - (0.5 + z * se)) <= 0.1 * se, (low, high, se)


def test_acc_norm_divides_by_the_options_own_characters_as_the_harness_does(tmp_path):
    """Options "a" and "bbb" with log-likelihoods -2 and -5: per character of the option itself "bbb" wins (-5/3 >
    -2/1), but counting the space in front of each (the continuation scored) "a" would (-2/2 > -5/4). The harness's
    own multiple-choice scoring (process_results of a task written here) on the same numbers agrees with gptlab's."""
    from lm_eval.tasks import TaskManager

    record = {"context": "Q:", "choices": ["a", "bbb"], "label": 1}
    (tmp_path / "one.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "one.yaml").write_text(
        "task: one_item\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    validation: {tmp_path / 'one.jsonl'}\nvalidation_split: validation\noutput_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\ndoc_to_choice: choices\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    task = TaskManager(include_path=str(tmp_path), include_defaults=False).load(["one_item"])["tasks"]["one_item"]
    theirs = task.process_results(record, [(-2.0, False), (-5.0, False)])
    (item,) = read_task(tmp_path / "one.jsonl")
    ours = judge(item, scored((-2.0, 1), (-5.0, 1)))
    assert (ours["acc"], ours["acc_norm"]) == (theirs["acc"], theirs["acc_norm"]) == (0.0, 1.0)


def test_the_cropped_count_counts_items_not_options_in_every_batch():
    """With a 48-token char model: an item whose context of 60 loses its start for both options, one whose context
    of 44 keeps all for " xx" (47 tokens) but not for " yyyyyyyy" (53), and short ones that keep all. Placed at 0,
    35 and 36 of 40 items (35 and 36 past the first batch of 32): 3 items cropped (5 options)."""
    tokenizer = CharTokenizer("abcxy ")
    both, one, short = (Item(MULTIPLE_CHOICE, (c,), conts, 0, 1) for c, conts in [
        ("a" * 60, ("xx", "yyy")), ("c" * 44, ("xx", "yyyyyyyy")), ("b" * 10, ("x", "y"))])
    items = [short] * 40
    items[0], items[35], items[36] = both, both, one
    result = evaluate_items(moved_model(tokenizer.vocab_size), tokenizer, items)
    assert result.items == 40 and result.cropped == 3


def test_the_table_gives_each_measure_its_interval_and_items_per_second():
    """items / seconds (10 items in 4 s: 2.5 a second), and a task scored in no measurable time still prints."""
    from gptlab.tasks.measure import Measure, TaskScores
    from gptlab.tasks.report import table

    measures = {"acc": Measure(0.5, 0.25, 0.75), "acc_norm": Measure(0.6, 0.4, 0.8)}
    lines = table([("tasks/t.jsonl", TaskScores("multiple choice", 10, measures, 0, 4.0)),
                   ("tasks/u.jsonl", TaskScores("multiple choice", 10, measures, 0, 0.0))]).splitlines()
    assert lines[0].split() == ["task", "kind", "measure", "value", "95%", "interval", "items", "items/s"]
    assert lines[1].split() == ["tasks/t.jsonl", "multiple", "choice", "acc", "0.5000", "[0.2500,", "0.7500]", "10",
                                "2.5"]
    assert lines[2].split()[3:] == ["acc_norm", "0.6000", "[0.4000,", "0.8000]", "10", "2.5"]
    assert lines[3].split()[-1] == "10000000000.0" and len(lines) == 5  # 10 items over the 1e-9 s floor


def test_result_files_are_named_by_every_setting_that_changes_the_score(tmp_path):
    """A k-shot result never replaces the 0-shot one, nor one of another seed or limit: each setting in the name
    (the seed only where examples are drawn)."""
    from gptlab.tasks.report import result_path

    def name(shots, limit, seed):
        return result_path(tmp_path, "tasks/t.jsonl", "ab" * 32, 5, "fp32", shots, limit, seed).name

    settings = [(0, None, 1234), (3, None, 1234), (3, None, 7), (5, None, 7), (3, 40, 7), (0, 40, 1234)]
    assert len({name(*s) for s in settings}) == len(settings)
    assert name(0, None, 7) == name(0, None, 1234) == "t-abababab-step5-fp32.json"
    assert name(3, 40, 7) == "t-abababab-step5-fp32-3shot-seed7-limit40.json"


def test_fewshot_examples_are_the_right_answers_of_schema_items_whatever_their_label():
    """A schema item's worked example is its right context (label 1 or 2, not the first) and the continuation; the
    examples of an item past the first batch are other items' (drawn by the seeded rule), never its own."""
    items = [Item(SCHEMA, tuple(f"ctx{i}-{j}" for j in range(3)), (f"goes on {i}.",), i % 3, i + 1) for i in range(40)]
    assert items[4].worked_example() == "ctx4-1 goes on 4." and items[5].worked_example() == "ctx5-2 goes on 5."
    for index in (31, 32, 33, 39):
        drawn = random.Random(1234 * 1_000_003 + index).sample([j for j in range(40) if j != index], 3)
        assert fewshot_prefix(items, index, 3, 1234) == "".join(items[j].worked_example() + "\n\n" for j in drawn)


def test_hellaswag_records_keep_llm_c_context_and_raw_endings(tmp_path):
    """llm.c reads a HellaSwag record's `ctx` and raw endings; a record without `ctx` gets HellaSwag's own rule for
    it: ctx_a, then a space and ctx_b where ctx_b is not empty."""
    base = {"activity_label": "Home", "endings": ["goes [title] on.", "stops."], "label": "1"}
    records = [{**base, "ctx_a": "A man sits.", "ctx_b": "he", "ctx": "A man sits. he"},
               {**base, "ctx_a": "A man sits.", "ctx_b": "he"}, {**base, "ctx_a": "[header] How to sit", "ctx_b": ""},
               {**base, "ctx_a": "A man sits.", "ctx_b": "he", "ctx": "Its own ctx, whatever ctx_a and ctx_b say"}]
    (tmp_path / "h.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    items = read_task(tmp_path / "h.jsonl")
    assert [item.llmc for item in items] == [("A man sits. he", ("goes [title] on.", "stops."))] * 2 + [
        ("[header] How to sit", ("goes [title] on.", "stops.")),
        ("Its own ctx, whatever ctx_a and ctx_b say", ("goes [title] on.", "stops."))]
    assert items[0].contexts == ("Home: A man sits. He",) and items[0].continuations == ("goes. on.", "stops.")


def test_fewshot_runs_on_every_kind_and_keeps_its_own_file(task_run, capsys):
    """2-shot on every fixture kind (the schema fixture's labels are 1): each scored and saved beside, not over,
    the 0-shot results."""
    flags = ["eval", "--run", str(task_run), "--task", str(TASKS), "--precision", "fp32", "--limit", "6"]
    assert main(flags) == 0 and main([*flags, "--num-fewshot", "2", "--seed", "3"]) == 0
    capsys.readouterr()
    zero = sorted((task_run / "evals").glob("*-fp32-limit6.json"))
    two = sorted((task_run / "evals").glob("*-fp32-2shot-seed3-limit6.json"))
    assert [p.name.split("-")[0] for p in zero] == [p.name.split("-")[0] for p in two] == FIXTURES_SORTED
    assert {json.loads(p.read_text())["num_fewshot"] for p in zero} == {0}
    assert {json.loads(p.read_text())["num_fewshot"] for p in two} == {2}
    assert {r["label"] for r in json.loads(two[3].read_text())["per_item"]} == {1}  # schema's right contexts


FIXTURES_SORTED = sorted(FIXTURES)
