"""lm-evaluation-harness both ways, on one tiny random GPT-2 (Hugging Face's GPT2LMHeadModel with a byte-level BPE
trained on the fixtures, saved to a folder, imported into gptlab): gptlab's harness model ("gptlab") beside the
harness's own "hf" model gives the same per-request log-likelihoods, rolling log-likelihoods and greedy
generations, the same acc / acc_norm on a local harness task, and `gptlab eval --task` gives the harness's acc and
acc_norm on HellaSwag-format items."""

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import perturbed

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files: never ask the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import lm_eval  # noqa: E402  (the `eval` extra, which make test installs)
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from gptlab.hf.gpt2_folders import load_hf_model  # noqa: E402
from gptlab.hf.hf_tokenizer import write_tokenizer_files  # noqa: E402
from gptlab.tasks.harness import GptlabLM  # noqa: E402
from gptlab.tasks.items import read_task  # noqa: E402
from gptlab.tasks.measure import evaluate_items  # noqa: E402
from gptlab.tokenizer import BPETokenizer  # noqa: E402

TASKS = Path(__file__).parent / "data" / "tasks"
TOLERANCE = 1e-4  # per request, in nats: the two models run the same weights through different code


def fixture_text() -> str:
    return "\n\n".join(s for name in ("hellaswag", "choices", "schema", "lambada")
                       for item in read_task(TASKS / f"{name}.jsonl") for s in item.contexts + item.continuations)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the harness's hf model, gptlab's harness model) over the same saved GPT-2."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("hf")
    tokenizer = BPETokenizer.train([fixture_text()], 400)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=48, n_layer=2, n_head=3, n_positions=96,
                        initializer_range=0.2, bos_token_id=tokenizer.eot_id, eos_token_id=tokenizer.eot_id)
    GPT2LMHeadModel(config).save_pretrained(folder)
    write_tokenizer_files(folder, tokenizer, 96)
    hf = HFLM(pretrained=str(folder), device="cpu", batch_size=4, dtype="float32")
    ours = GptlabLM(model=load_hf_model(folder), tokenizer=tokenizer)
    return hf, ours, folder


def instances(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_per_request_loglikelihoods_match_the_hf_model(models):
    hf, ours, _ = models
    args = [(item.contexts[0], " " + c) for item in read_task(TASKS / "hellaswag.jsonl")[:6] for c in
            item.continuations]
    args += [("", "No context at all, scored after end-of-text."), ("Trailing space ", "moves along"),
             ("A" * 300, " long contexts lose their start"), ("One text.<|endoftext|>Another", " begins")]
    eot = ours.tokenizer.eot_id  # the harness's texts may hold the end-of-text token: it is that token, as in HF's
    assert ours.tok_encode("One.<|endoftext|>Two") == [*ours.tokenizer.encode("One."), eot,
                                                       *ours.tokenizer.encode("Two")]
    theirs, mine = hf.loglikelihood(instances("loglikelihood", args)), ours.loglikelihood(
        instances("loglikelihood", args))
    assert len(mine) == len(args)
    worst = max(abs(a[0] - b[0]) for a, b in zip(theirs, mine))
    assert worst <= TOLERANCE, worst
    assert [a[1] for a in theirs] == [b[1] for b in mine]


def test_rolling_loglikelihoods_and_greedy_generations_match_the_hf_model(models):
    hf, ours, _ = models
    texts = [fixture_text()[:2000], "Zoë n'a pas rêvé: 中文 too."]  # the first needs several windows of 96
    theirs = hf.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in texts]))
    mine = ours.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in texts]))
    assert max(abs(a - b) for a, b in zip(theirs, mine)) <= 10 * TOLERANCE  # sums over ~1000 tokens
    requests = [(item.contexts[0], {"until": ["."], "max_gen_toks": 12, "do_sample": False})
                for item in read_task(TASKS / "lambada.jsonl")[:4]]
    assert ours.generate_until(instances("generate_until", requests)) == \
        hf.generate_until(instances("generate_until", requests))


TASK_YAML = """task: gptlab_fixture_{name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {path}
validation_split: validation
output_type: multiple_choice
{extra}
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    """Two local harness tasks over the fixtures: HellaSwag's records through the harness's own HellaSwag
    preprocessing, and the plain multiple-choice form."""
    folder = tmp_path_factory.mktemp("harness-tasks")
    (folder / "utils.py").write_text("from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: F401\n")
    (folder / "hellaswag.yaml").write_text(TASK_YAML.format(
        name="hellaswag", path=TASKS / "hellaswag.jsonl",
        extra='process_docs: !function utils.process_docs\ndoc_to_text: "{{query}}"\ndoc_to_choice: "choices"'))
    (folder / "choices.yaml").write_text(TASK_YAML.format(
        name="choices", path=TASKS / "choices.jsonl", extra='doc_to_text: "{{context}}"\ndoc_to_choice: "choices"'))
    return folder


@pytest.fixture(scope="module")
def task_manager(task_folder):
    return TaskManager(include_path=str(task_folder), include_defaults=False)


def harness_scores(lm, task_manager, name):
    results = lm_eval.simple_evaluate(model=lm, tasks=[f"gptlab_fixture_{name}"], task_manager=task_manager,
                                      log_samples=False, bootstrap_iters=0)
    row = results["results"][f"gptlab_fixture_{name}"]
    return row["acc,none"], row["acc_norm,none"]


@pytest.mark.parametrize("name", ["hellaswag", "choices"])
def test_acc_and_acc_norm_are_the_harness_hf_models(models, task_manager, name):
    """The same task through the harness with its hf model, with gptlab's harness model, and through `gptlab eval
    --task`'s own code: the same acc and acc_norm."""
    hf, ours, folder = models
    expected = harness_scores(hf, task_manager, name)
    assert harness_scores(ours, task_manager, name) == pytest.approx(expected, abs=1e-9)
    scores = evaluate_items(ours.model, ours.tokenizer, read_task(TASKS / f"{name}.jsonl"))
    assert (scores.measures["acc"].value, scores.measures["acc_norm"].value) == pytest.approx(expected, abs=1e-9)
    assert json.loads((folder / "config.json").read_text())["n_positions"] == 96


def test_eval_lm_eval_runs_harness_tasks_on_a_run(models, task_manager, task_folder, tmp_path, capsys):
    """`gptlab eval --lm-eval TASK` on the imported run prints the harness's table with the hf model's acc; an
    unknown task is one line."""
    from gptlab.cli import main

    hf, _, folder = models
    assert main(["import", str(folder), "--run", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    from gptlab.inference.weights import InferenceLinear

    alone = GptlabLM(run=tmp_path / "run", batch_size=8)  # model_args=run=RUN: fp32 on the CPU, the harness's
    assert alone.precision == "fp32" and alone.checkpoint.path.parent == tmp_path / "run" / "checkpoints"
    assert not any(isinstance(m, InferenceLinear) for m in alone.model.modules())  # scored as trained: no packing
    assert {p.dtype for p in alone.model.parameters()} == {torch.float32}
    assert next(alone.model.parameters()).device == torch.device("cpu") and GptlabLM(
        model=alone.model, tokenizer=alone.tokenizer).checkpoint is None
    flags = ["eval", "--run", str(tmp_path / "run"), "--precision", "fp32", "--lm-eval-include", str(task_folder),
             "--lm-eval-only-include"]
    assert main([*flags, "--lm-eval", "gptlab_fixture_choices"]) == 0
    out, err = capsys.readouterr()
    assert "gptlab: gptlab_fixture_choices: 20 of 20 items scored, precision fp32" in err
    row = next([c.strip() for c in line.split("|")] for line in out.splitlines() if "|acc " in line)
    expected_acc, _ = harness_scores(hf, task_manager, "choices")
    assert float(row[row.index("acc") + 2]) == pytest.approx(expected_acc, abs=1e-4), out
    assert main([*flags[:3], "--precision", "int8", *flags[5:], "--lm-eval", "gptlab_fixture_choices", "--limit",
                 "1"]) == 0  # the fewest items
    assert "gptlab: gptlab_fixture_choices: 1 of 20 items scored, precision int8" in capsys.readouterr().err
    assert main([*flags, "--lm-eval", "gptlab_fixture_choices", "--limit", "0"]) == 2
    assert "--limit must be >= 1, not 0" in capsys.readouterr().err
    assert main([*flags, "--lm-eval", "no_such_task, gptlab_fixture_choices,other_missing"]) == 2
    err = capsys.readouterr().err  # every unknown name, in order, the known one left out
    assert "lm-evaluation-harness has no task no_such_task, other_missing; see" in err
    assert err.strip().count("\n") == 0
    assert main([*flags[:-1], "--lm-eval", "no_such_task,hellaswag"]) == 2  # the harness's own tasks, known too
    assert "has no task no_such_task; see" in capsys.readouterr().err
    assert main([*flags, "--lm-eval", "hellaswag"]) == 2  # --lm-eval-only-include: the include folder's alone
    assert "has no task hellaswag; see" in capsys.readouterr().err
    absent = next((d for d in ("cuda", "mps") if not (torch.cuda.is_available() if d == "cuda" else
                                                       torch.backends.mps.is_available())), None)
    if absent is not None:  # the device asked reaches the model (a machine with both has none absent to ask for)
        assert main([*flags, "--lm-eval", "gptlab_fixture_choices", "--device", absent]) == 2
        assert f"device {absent!r} is not available on this machine" in capsys.readouterr().err


def test_a_char_model_without_end_of_text_scores_from_the_second_token():
    """No end-of-text token to condition on: an empty context's continuation and a rolling text are scored from
    their second character, the first being the context (the plain forward's sums here); a one-character
    continuation with no context is refused in one line."""
    from gptlab.config import ModelConfig
    from gptlab.errors import GptlabError
    from gptlab.model import GPT
    from gptlab.tokenizer import CharTokenizer
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    tokenizer = CharTokenizer("abcdefgh ")
    torch.manual_seed(3)
    model = perturbed(GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=16,
                                      dropout=0.0)).eval())
    lm = GptlabLM(model=model, tokenizer=tokenizer)

    def plain(ids):  # log p of ids[1:], each from every id before it within the last 8
        total = 0.0
        for i in range(1, len(ids)):
            with torch.no_grad():
                logits, _ = model(torch.tensor([ids[max(0, i - 8):i]]))
            total += logits[0, -1].double().log_softmax(-1)[ids[i]].item()
        return total

    ids = tokenizer.encode("bad cafe")
    (ll, _), = lm.loglikelihood(instances("loglikelihood", [("", "bad cafe")]))
    assert abs(ll - plain(ids)) <= 1e-5
    # contexts and none mixed in one call, two characters with none (the fewest it scores): each in its place
    asked = [("ca", "fe"), ("", "ab"), ("b", "ag"), ("", "bad cafe")]
    got = [ll for ll, _ in lm.loglikelihood(instances("loglikelihood", asked))]
    want = [plain(tokenizer.encode(c + x)) - (plain(tokenizer.encode(c)) if c else 0.0) for c, x in asked]
    assert len(got) == len(asked) and max(abs(g - w) for g, w in zip(got, want)) <= 1e-5, (got, want)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the precision asked reaches the scoring: bf16's sums
        in_bf16 = plain(tokenizer.encode("cafe bad")) - plain(tokenizer.encode("cafe"))
    (ll, _), = GptlabLM(model=model, tokenizer=tokenizer, precision="bf16").loglikelihood(
        instances("loglikelihood", [("cafe", " bad")]))
    assert abs(ll - in_bf16) < 0.1 * abs(ll - plain(tokenizer.encode("cafe bad")) + plain(tokenizer.encode("cafe")))
    text = "abc defg hgf edcba"  # 18 characters: the harness's rolling windows of 8, the first character their start
    first, *rest = tokenizer.encode(text)
    expected = 0.0
    for context, targets in map(make_disjoint_window, get_rolling_token_windows(rest, first, 8, 1)):
        window = (context + targets)[-9:][:-1]
        with torch.no_grad():
            logits, _ = model(torch.tensor([window]))
        logprobs = logits[0, -len(targets):].double().log_softmax(-1)
        expected += logprobs.gather(1, torch.tensor(targets)[:, None]).sum().item()
    (rolled,) = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]))
    assert abs(rolled - expected) <= 1e-4
    with pytest.raises(GptlabError, match="a continuation of one token with no context cannot be scored"):
        lm.loglikelihood(instances("loglikelihood", [("", "a")]))
    with pytest.raises(GptlabError, match="an empty context cannot be continued by a model without an end-of-text"):
        lm.generate_until(instances("generate_until", [("", {"until": ["."], "max_gen_toks": 2})]))
    assert len(lm.generate_until(instances("generate_until", [("ab", {"until": [], "max_gen_toks": 3})]))[0]) == 3


def test_the_harness_cache_hook_keeps_each_result_under_its_request(models, tmp_path):
    """lm-evaluation-harness's --use_cache: a model hands each result to its cache hook as it goes (an interrupted
    run keeps what it finished); each one lands under the harness's hash of its request type and arguments."""
    from lm_eval.api.model import CachingLM, hash_args

    _, ours, _ = models
    cache = CachingLM(ours, str(tmp_path / "cache.db"))  # connects its hook to the model
    kinds = {"loglikelihood": ("A man walks", " into the river."), "loglikelihood_rolling": ("The dog runs.",),
             "generate_until": ("The house", {"until": ["."], "max_gen_toks": 4})}
    for kind, args in kinds.items():
        (result,) = getattr(ours, kind)(instances(kind, [args]))
        assert cache.dbdict[hash_args(kind, args)] == result


def test_eval_lm_eval_seed_is_the_harness_few_shot_seed(models, task_folder, tmp_path, monkeypatch):
    """`--seed` draws the few-shot examples of the harness's tasks too: it reaches simple_evaluate as
    fewshot_random_seed (the seed of the harness's few-shot sampler), not only as its Python seed."""
    from gptlab.cli import main

    class Called(Exception):
        pass

    seen = {}

    def simple_evaluate(**kwargs):
        seen.update(kwargs)
        raise Called

    _, _, folder = models
    assert main(["import", str(folder), "--run", str(tmp_path / "run")]) == 0
    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    with pytest.raises(Called):
        main(["eval", "--run", str(tmp_path / "run"), "--lm-eval-include", str(task_folder), "--lm-eval-only-include",
              "--lm-eval", "gptlab_fixture_choices", "--num-fewshot", "2", "--seed", "9"])
    assert seen["fewshot_random_seed"] == 9 and seen["random_seed"] == 9 and seen["num_fewshot"] == 2


def test_generation_requests_at_their_edges():
    """generate_until as the harness hands it requests: `until` a plain string (one stop, not its characters),
    no max_gen_toks (the harness's default, 256 tokens), a context longer than the window keeps its last
    max_length - max_gen_toks tokens (greedy from those, by hand), max_gen_toks up to max_length - 1 and not
    max_length, and a model that ends its text at once (end-of-text) gives "" (the token is cut, not decoded)."""
    from gptlab.config import ModelConfig
    from gptlab.errors import GptlabError
    from gptlab.model import GPT
    from gptlab.tokenizer import CharTokenizer

    tokenizer = CharTokenizer("abcdefgh ")
    torch.manual_seed(5)
    model = perturbed(GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=1, n_head=2,
                                      n_embd=16, dropout=0.0)).eval())
    lm = GptlabLM(model=model, tokenizer=tokenizer)

    def gen(context, **kwargs):
        return lm.generate_until(instances("generate_until", [(context, kwargs)]))[0]

    context = "abc defg hgf edcba cafe bad head"  # 32 characters: twice the window
    ids = tokenizer.encode(context)[-12:]  # max_gen_toks 4 leaves 16 - 4 for the context
    for _ in range(4):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    expected = tokenizer.decode(ids[-4:])
    assert gen(context, until=[], max_gen_toks=4) == expected
    full = gen("cafe", until=[], max_gen_toks=12)
    assert len(full) == 12
    assert gen("cafe", until=full[3] + "z", max_gen_toks=12) == full  # "z" is never generated: no stop met
    assert gen("cafe", until=full[3:5], max_gen_toks=12) == full[:full.index(full[3:5])]
    assert len(gen("cafe", until=[], max_gen_toks=15)) == 15  # one character of context kept
    with pytest.raises(GptlabError, match="max_gen_toks 16 leaves no room for a context in the model's 16 tokens"):
        gen("cafe", until=[], max_gen_toks=16)

    long = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=260, n_layer=1, n_head=2, n_embd=16,
                           dropout=0.0)).eval()
    assert len(GptlabLM(model=long, tokenizer=tokenizer).generate_until(
        instances("generate_until", [("cafe", {"until": []})]))[0]) == 256

    bpe = BPETokenizer.train([fixture_text()], 300)
    ends = GPT(ModelConfig(vocab_size=bpe.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16,
                           dropout=0.0)).eval()
    with torch.no_grad():  # every position's last hidden state is the end-of-text token's embedding, scaled up
        ends.transformer.ln_f.weight.zero_()
        ends.transformer.ln_f.bias.copy_(ends.transformer.wte.weight[bpe.eot_id] * 50)
        ends.transformer.wte.weight[bpe.eot_id] *= 10
    eot_lm = GptlabLM(model=ends, tokenizer=bpe)
    assert int(ends(torch.tensor([bpe.encode("The house")]))[0][0, -1].argmax()) == bpe.eot_id
    assert eot_lm.generate_until(instances("generate_until", [("The house", {"until": ["."],
                                                                             "max_gen_toks": 3})])) == [""]
