"""`gptlab eval --task` beside lm-evaluation-harness at realistic size: 100 items of each task kind (past three
batches of ITEMS_PER_CALL), one tiny random GPT-2 (Hugging Face's GPT2LMHeadModel, a byte-level BPE trained on the
items, imported into a gptlab run), scored 0-shot and 3-shot through the CLI with its results saved, and the same
items through the harness's own `hf` model and its task YAMLs written here. Every item's log-likelihoods, acc and
acc_norm are the harness's, 0-shot and k-shot (the harness draws each item's examples by gptlab's documented rule,
through a sampler of its own kind, and formats them itself); --limit scores the first items as the whole file does;
acc_token_mean is llm.c's HellaSwag evaluation (transformers, written out here); greedy generation with stop strings
that occur is the hf model's. `pytest tests/test_tasks_vs_harness.py -s -k table` prints the comparison table of
docs/evaluation-vs-lm-eval.md."""

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files: never ask the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from lm_eval.api.instance import Instance  # noqa: E402  (the `eval` extra, which make test installs)
from lm_eval.evaluator import evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from gptlab.cli import main  # noqa: E402
from gptlab.hf.gpt2_folders import load_hf_model  # noqa: E402
from gptlab.hf.hf_tokenizer import write_tokenizer_files  # noqa: E402
from gptlab.tasks.harness import GptlabLM  # noqa: E402
from gptlab.tasks.items import read_task  # noqa: E402
from gptlab.tasks.measure import ITEMS_PER_CALL, evaluate_items  # noqa: E402
from gptlab.tokenizer import BPETokenizer  # noqa: E402

ITEMS = 100  # per kind: three whole batches of 32 and a part of one
SHOTS, SEED, LIMIT = 3, 7, 40  # the seed and the limit off their defaults; 40: a batch and a part
BLOCK = 160  # the model's context: some 3-shot contexts lose their start, on both sides alike
TOLERANCE = 1e-4  # per log-likelihood, in nats: the same weights through two implementations
KINDS = {"choices": "multiple choice", "hellaswag": "multiple choice (HellaSwag records)", "schema": "schema",
         "lambada": "language modelling"}
MEASURES = {"choices": ("acc", "acc_norm"), "hellaswag": ("acc", "acc_norm"), "schema": ("acc",),
            "lambada": ("acc",)}
STOPS = [" ", "e", "in"]  # generation stops that occur in the tiny model's greedy text, each first in some
WORDS = ("the a man woman dog cat child runner baker pilot river house garden kitchen bread water map song letter "
         "walks runs reads writes sings opens closes takes gives paints slowly quietly then after before into over "
         "under bright dark small large red green café très naïve Zoë 中文").split()


# ---- the items: seeded records of each kind -------------------------------------------------------------------------

def words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return words(rng, lo, hi).capitalize() + rng.choice(".!?")


def hellaswag_record(rng: random.Random) -> dict:
    """HellaSwag's own form: WikiHow's (tags, ctx_b empty) or ActivityNet's (ctx_b the start of the last
    sentence); `ctx` is ctx_a, then a space and ctx_b where ctx_b is not empty, as in HellaSwag's files."""
    if rng.random() < 0.3:
        ctx_a, ctx_b = f"[header] How to {words(rng, 1, 2)} [title] {sentence(rng, 2, 4)} [step]", ""
    else:
        ctx_a, ctx_b = sentence(rng, 3, 6), rng.choice(["then", "he", "she", "the man", "a woman"])
    endings = [words(rng, 1, 6) + "." + (" [substeps] " + words(rng, 1, 2) if rng.random() < 0.2 else "")
               for _ in range(4)]
    return {"activity_label": rng.choice(["Cooking", "Sports", "Home and Garden"]), "ctx_a": ctx_a, "ctx_b": ctx_b,
            "ctx": f"{ctx_a} {ctx_b}" if ctx_b else ctx_a, "endings": endings, "label": str(rng.randrange(4))}


def choices_record(rng: random.Random) -> dict:
    k = rng.randint(2, 5)
    return {"context": sentence(rng, 3, 8), "choices": [words(rng, 1, 6) + rng.choice(".?") for _ in range(k)],
            "label": rng.randrange(k)}


def schema_record(rng: random.Random) -> dict:
    names = rng.sample(["The pilot", "The baker", "Zoë", "A child", "Der Gärtner", "The runner"], 3)
    k = rng.randint(2, 3)
    return {"contexts": [f"{names[0]} thanked {names[1]} because {n}" for n in names[:k]],
            "continuation": words(rng, 2, 6) + ".", "label": rng.randrange(k)}


def lambada_record(rng: random.Random) -> dict:
    return {"context": sentence(rng, 5, 12)[:-1], "continuation": rng.choice(WORDS)}


RECORDS = {"choices": choices_record, "hellaswag": hellaswag_record, "schema": schema_record,
           "lambada": lambada_record}


def make_some_answerable(folder: Path, tasks: Path, records: list[dict]) -> None:
    """Each language-modelling record whose context the model (in `folder`) continues greedily with a space and a
    word gets that word as its continuation, so that acc is not 0 on every item; the file is written again."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tokenizer, model = AutoTokenizer.from_pretrained(folder), GPT2LMHeadModel.from_pretrained(folder).eval()
    for record in records:
        with torch.no_grad():
            logits = model(torch.tensor([tokenizer.encode(record["context"], add_special_tokens=False)])).logits
        word = tokenizer.decode([int(logits[0, -1].argmax())])
        if word.startswith(" ") and word[1:].isprintable() and word[1:].strip() == word[1:] != "":
            record["continuation"] = word[1:]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    (tasks / "lambada.jsonl").write_text(text, encoding="utf-8")


def write_tasks(folder: Path) -> dict[str, list[dict]]:
    """ITEMS records of each kind in folder/NAME.jsonl, each with its index in the file (the harness's sampler
    reads it; gptlab ignores fields it does not know)."""
    out = {}
    for name, make in RECORDS.items():
        rng = random.Random(name)
        out[name] = [{**make(rng), "index": i} for i in range(ITEMS)]
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out[name])
        (folder / f"{name}.jsonl").write_text(text, encoding="utf-8")
    return out


# ---- the harness's tasks over the same files ------------------------------------------------------------------------

SAMPLER = """import random

from lm_eval.api.samplers import ContextSampler
from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: F401


class GptlabRule(ContextSampler):
    \"\"\"gptlab's documented rule for item `index`: random.Random(seed * 1_000_003 + index) samples k of the other
    items' indices.\"\"\"

    def sample(self, n, eval_doc=None, df=None, **kwargs):
        docs, index = self.fewshot_docs(), eval_doc["index"]
        drawn = random.Random({seed} * 1_000_003 + index).sample([j for j in range(len(docs)) if j != index], n)
        assert index not in drawn and all(docs[j]["index"] == j for j in drawn)
        return [docs[j] for j in drawn]
"""

FORMS = {  # the harness's fields for each kind, as its own tasks of that kind write them
    "choices": 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: choices\n'
               'doc_to_target: "{{label}}"',
    "hellaswag": 'output_type: multiple_choice\nprocess_docs: !function utils.process_docs\ndoc_to_text: "{{query}}"\n'
                 'doc_to_choice: choices\ndoc_to_target: "{{label}}"',
    "schema": 'output_type: multiple_choice\ndoc_to_text: "{{label}}"\ndoc_to_choice: contexts\n'
              'doc_to_target: continuation',  # winogrande's form: an int text means one context per option
    "lambada": 'output_type: loglikelihood\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{\' \' + continuation}}"\n'
               'target_delimiter: ""',  # lambada_openai's form
    "generate": 'output_type: generate_until\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
                f'generation_kwargs:\n  until: {json.dumps(STOPS)}\n  max_gen_toks: 6\n  do_sample: false',
}


def write_harness_tasks(folder: Path, tasks: Path) -> list[str]:
    """A harness task per kind and shot count (and one generation task), over the files in `tasks`; the k-shot
    ones draw their examples with GptlabRule. Their names."""
    (folder / "utils.py").write_text(SAMPLER.format(seed=SEED))
    names = []
    for name, form in FORMS.items():
        for shots in ((0,) if name == "generate" else (0, SHOTS)):
            task = f"vs_{name}_{shots}shot"
            metrics = ["exact_match"] if name == "generate" else MEASURES[name]
            fewshot = f"num_fewshot: {SHOTS}\nfewshot_config:\n  sampler: !function utils.GptlabRule\n" if shots else ""
            (folder / f"{task}.yaml").write_text(
                f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: "
                f"{tasks / ('lambada' if name == 'generate' else name)}.jsonl\nvalidation_split: validation\n"
                f"{form}\n{fewshot}metric_list:\n" + "".join(f"  - metric: {m}\n    aggregation: mean\n"
                                                              f"    higher_is_better: true\n" for m in metrics))
            names.append(task)
    return names


def harness_samples(lm, folder: Path, names: list[str]) -> dict[str, dict]:
    """Each task's harness results: {"results": its aggregate row, "samples": its per-item rows in file order}."""
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    out = evaluate(lm, manager.load(names), bootstrap_iters=0, log_samples=True, verbosity="WARNING")
    return {n: {"results": out["results"][n], "samples": sorted(out["samples"][n], key=lambda s: s["doc_id"])}
            for n in names}


# ---- one model, both sides ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared machine: one intra-op thread (the CLI's set_threads too) runs them fastest."""
    import gptlab.runtime

    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gptlab.runtime, "set_threads", lambda: torch.set_num_threads(1))
        torch.set_num_threads(1)
        yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The task files, the GPT-2 folder, the run imported from it, and the harness's results on every task."""
    root = tmp_path_factory.mktemp("vs-harness")
    (root / "tasks").mkdir()
    records = write_tasks(root / "tasks")
    text = "\n\n".join(json.dumps(r, ensure_ascii=False) for rs in records.values() for r in rs)
    tokenizer = BPETokenizer.train([text], 400)
    torch.manual_seed(0)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=48, n_layer=2, n_head=3, n_positions=BLOCK,
                        initializer_range=0.2, bos_token_id=tokenizer.eot_id, eos_token_id=tokenizer.eot_id)
    GPT2LMHeadModel(config).save_pretrained(root / "hf")
    write_tokenizer_files(root / "hf", tokenizer, BLOCK)
    make_some_answerable(root / "hf", root / "tasks", records["lambada"])
    assert main(["import", str(root / "hf"), "--run", str(root / "run")]) == 0
    (root / "harness").mkdir()
    names = write_harness_tasks(root / "harness", root / "tasks")
    hf = HFLM(pretrained=str(root / "hf"), device="cpu", batch_size=32, dtype="float32")
    theirs = harness_samples(hf, root / "harness", names)
    ours = GptlabLM(model=load_hf_model(root / "hf"), tokenizer=tokenizer)
    return {"root": root, "records": records, "tokenizer": tokenizer, "ours": ours, "harness": theirs}


@pytest.fixture(scope="module")
def saved(world):
    """gptlab eval --task's saved results on the folder of task files: 0-shot, 3-shot, and 3-shot --limit 70,
    by (task name, setting)."""
    run, tasks = world["root"] / "run", world["root"] / "tasks"
    settings = {"0shot": [], f"{SHOTS}shot": ["--num-fewshot", str(SHOTS)],
                f"{SHOTS}shot-limit": ["--num-fewshot", str(SHOTS), "--limit", str(LIMIT)]}
    out = {}
    for setting, flags in settings.items():
        before = set((run / "evals").glob("*.json")) if (run / "evals").exists() else set()
        assert main(["eval", "--run", str(run), "--task", str(tasks), "--precision", "fp32", "--seed", str(SEED),
                     *flags]) == 0
        written = sorted(set((run / "evals").glob("*.json")) - before)
        assert [p.name.split("-")[0] for p in written] == sorted(RECORDS)  # new files: nothing written over
        for path in written:
            out[path.name.split("-")[0], setting] = {**json.loads(path.read_text()), "file": path.name}
    return out


# ---- the comparisons ------------------------------------------------------------------------------------------------

def per_item_differences(ours: list[dict], theirs: list[dict], measures: tuple[str, ...]) -> tuple[float, int]:
    """(the largest log-likelihood difference, the items whose measures differ) between gptlab's saved rows and
    the harness's samples, item by item."""
    worst, differ = 0.0, 0
    for mine, sample in zip(ours, theirs, strict=True):
        lls = [ll for ll, _ in sample["filtered_resps"]]
        worst = max(worst, float(np.max(np.abs(np.array(mine["loglikelihoods"]) - lls))))
        differ += any(float(mine[m]) != float(sample[m]) for m in measures)
    return worst, differ


@pytest.mark.parametrize("shots", [0, SHOTS])
@pytest.mark.parametrize("name", list(RECORDS))
def test_every_item_scores_as_the_harness_scores_it(world, saved, name, shots):
    """Each of the 100 items, in every batch: the same log-likelihoods (within TOLERANCE), the same acc and acc_norm,
    and so the same figures; k-shot with the examples the harness drew by the documented rule and formatted itself
    (the right answer's text, a schema's right context, whatever its label)."""
    result, harness = saved[name, f"{shots}shot"], world["harness"][f"vs_{name}_{shots}shot"]
    assert result["items"] == len(result["per_item"]) == len(harness["samples"]) == ITEMS
    assert [row["line"] for row in result["per_item"]] == list(range(1, ITEMS + 1))
    worst, differ = per_item_differences(result["per_item"], harness["samples"], MEASURES[name])
    assert worst <= TOLERANCE and differ == 0, (worst, differ)
    for measure in MEASURES[name]:
        assert result["measures"][measure]["value"] == pytest.approx(harness["results"][f"{measure},none"], abs=1e-12)
    assert result["num_fewshot"] == shots and result["seed"] == SEED
    if name == "schema":
        assert {r["label"] for r in world["records"]["schema"]} == {0, 1, 2}


@pytest.mark.parametrize("name", list(RECORDS))
def test_a_limit_scores_the_first_items_as_the_whole_file_does(saved, name):
    """--limit 40 at 3-shot (a whole batch and 8 items past it): each item as in the whole file's run, the examples
    drawn from the whole file by the item's own index; its own result file beside the whole file's."""
    limited, whole = saved[name, f"{SHOTS}shot-limit"], saved[name, f"{SHOTS}shot"]
    assert limited["items"] == len(limited["per_item"]) == LIMIT > ITEMS_PER_CALL and limited["limit"] == LIMIT
    for mine, full in zip(limited["per_item"], whole["per_item"][:LIMIT], strict=True):
        assert np.allclose(mine["loglikelihoods"], full["loglikelihoods"], atol=1e-5, rtol=0)
        assert {k: v for k, v in mine.items() if k not in ("loglikelihoods", "token_means")} == \
            {k: v for k, v in full.items() if k not in ("loglikelihoods", "token_means")}
    assert limited["file"] != whole["file"] and limited["file"].endswith(f"-{SHOTS}shot-seed{SEED}-limit{LIMIT}.json")


def test_each_setting_keeps_its_own_result_file(saved):
    """0-shot, 3-shot and 3-shot --limit 40 on one run: three files per task, none written over another (the
    `saved` fixture checks that each command wrote new files), each with its own settings inside."""
    for name in RECORDS:
        files = [saved[name, s]["file"] for s in ("0shot", f"{SHOTS}shot", f"{SHOTS}shot-limit")]
        assert len(set(files)) == 3 and not any("shot" in part for part in files[0].split("-"))
        assert [saved[name, s]["num_fewshot"] for s in ("0shot", f"{SHOTS}shot")] == [0, SHOTS]


def llmc_hellaswag(folder: Path, records: list[dict]) -> list[list[float]]:
    """llm.c's HellaSwag evaluation (dev/data/hellaswag.py), written out with transformers: one row per ending, the
    ids of the record's `ctx` then those of " " + ending (each encoded on its own), right-padded; the cross-entropy
    at every position, masked to the ending's tokens and averaged over them. Each item's mean losses."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tokenizer, model = AutoTokenizer.from_pretrained(folder), GPT2LMHeadModel.from_pretrained(folder).eval()
    out = []
    for record in records:
        ctx = tokenizer.encode(record["ctx"], add_special_tokens=False)
        rows = [ctx + tokenizer.encode(" " + ending, add_special_tokens=False) for ending in record["endings"]]
        tokens = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = torch.tensor(row)
            mask[i, len(ctx):len(row)] = 1
        with torch.no_grad():
            logits = model(tokens).logits
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
        shifted = mask[:, 1:]  # position j predicts token j + 1
        out.append(((losses * shifted).sum(1) / shifted.sum(1)).tolist())
    return out


@pytest.fixture(scope="module")
def llmc(world):
    return llmc_hellaswag(world["root"] / "hf", world["records"]["hellaswag"])


def test_acc_token_mean_is_llm_c_hellaswag_evaluation_item_for_item(world, saved, llmc):
    """On HellaSwag's records acc_token_mean is llm.c's measure: its context (the record's `ctx`, no activity label,
    no cleaning), its endings, its mean over the ending's tokens; each item's mean losses and choice the same."""
    rows = saved["hellaswag", "0shot"]["per_item"]
    right = 0
    for row, losses, record in zip(rows, llmc, world["records"]["hellaswag"], strict=True):
        assert np.allclose(row["token_means"], -np.array(losses), atol=TOLERANCE, rtol=0)
        right += int(np.argmin(losses)) == int(record["label"])
        assert row["acc_token_mean"] == float(int(np.argmin(losses)) == int(record["label"]))
    assert saved["hellaswag", "0shot"]["measures"]["acc_token_mean"]["value"] == pytest.approx(right / ITEMS)
    differs = [r for r in world["records"]["hellaswag"] if r["ctx"] not in world["harness"]["vs_hellaswag_0shot"][
        "samples"][r["index"]]["arguments"][0][0]]
    assert differs  # llm.c's context is not the harness's: the activity label and the cleaning make them differ


def generations(world, until: list[str]) -> list[str]:
    """gptlab's harness model's greedy text after each language-modelling context, 6 tokens, cut at `until`: the
    requests the harness makes of the generation task."""
    requests = [Instance(request_type="generate_until", doc={}, idx=0, arguments=(
        r["context"], {"until": until, "max_gen_toks": 6, "do_sample": False})) for r in world["records"]["lambada"]]
    return world["ours"].generate_until(requests)


@pytest.fixture(scope="module")
def generated(world):
    """The generation task through the harness with gptlab's harness model."""
    return harness_samples(world["ours"], world["root"] / "harness", ["vs_generate_0shot"])["vs_generate_0shot"]


def test_greedy_generation_with_stop_strings_that_occur_is_the_hf_models(world, generated):
    """A generate_until task of 100 items, stops " ", "e" and "in": gptlab's harness model gives the hf model's text
    for every item, each the uncut text up to the first place any stop string starts (worked out here); each stop
    string is the one that cuts for some items, and the texts with no stop in them are kept whole."""
    texts = [s["filtered_resps"][0] for s in generated["samples"]]
    assert texts == [s["filtered_resps"][0] for s in world["harness"]["vs_generate_0shot"]["samples"]]
    uncut, first = generations(world, []), []
    for text, whole in zip(texts, uncut, strict=True):
        at = {stop: whole.find(stop) for stop in STOPS if stop in whole}
        first.append(min(at, key=at.get) if at else None)
        assert text == (whole[:min(at.values())] if at else whole)
    assert min(first.count(stop) for stop in STOPS) > 0 and first.count(None) > 0, (first, uncut)


# ---- the table of docs/evaluation-vs-lm-eval.md ---------------------------------------------------------------------

def comparison_rows(world, saved, llmc, generated) -> list[tuple]:
    """(task kind, shots, measure, gptlab's figure, the peer's, the peer, items, items whose measure differs)."""
    rows = []
    for name in RECORDS:
        for setting, shown, shots in (("0shot", "0", 0), (f"{SHOTS}shot", f"{SHOTS}", SHOTS),
                                      (f"{SHOTS}shot-limit", f"{SHOTS}, --limit {LIMIT}", SHOTS)):
            result = saved[name, setting]
            samples = world["harness"][f"vs_{name}_{shots}shot"]["samples"][:result["items"]]
            for m in MEASURES[name]:
                differ = sum(float(r[m]) != float(s[m]) for r, s in zip(result["per_item"], samples, strict=True))
                rows.append((KINDS[name], shown, m, result["measures"][m]["value"],
                             float(np.mean([float(s[m]) for s in samples])), "lm-eval, hf model", result["items"],
                             differ))
    hellaswag = saved["hellaswag", "0shot"]
    llmc_right = [float(int(np.argmin(losses)) == int(r["label"])) for losses, r in
                  zip(llmc, world["records"]["hellaswag"], strict=True)]
    rows.append((KINDS["hellaswag"], "0", "acc_token_mean", hellaswag["measures"]["acc_token_mean"]["value"],
                 float(np.mean(llmc_right)), "llm.c's rule, transformers", ITEMS,
                 sum(r["acc_token_mean"] != v for r, v in zip(hellaswag["per_item"], llmc_right, strict=True))))
    theirs = world["harness"]["vs_generate_0shot"]
    rows.append(("generation (generate_until)", "0", "exact_match", generated["results"]["exact_match,none"],
                 theirs["results"]["exact_match,none"], "lm-eval, hf model", ITEMS,
                 sum(a["filtered_resps"] != b["filtered_resps"] for a, b in zip(generated["samples"],
                                                                                theirs["samples"], strict=True))))
    return rows


def test_the_comparison_table_has_gptlab_equal_to_its_peers_everywhere(world, saved, llmc, generated):
    """Every task kind, 0-shot and 3-shot (and 3-shot under --limit), every measure with a peer: gptlab's figure is
    the peer's and no item differs. Printed (-s) as the table of docs/evaluation-vs-lm-eval.md."""
    rows = comparison_rows(world, saved, llmc, generated)
    lines = ["| task kind | shots | measure | gptlab | peer | peer's figure | items | items that differ |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {kind} | {shots} | `{m}` | {ours:.4f} | {peer} | {theirs:.4f} | {items} | {differ} |"
              for kind, shots, m, ours, theirs, peer, items, differ in rows]
    print("\n" + "\n".join(lines))
    assert len(rows) == 3 * 6 + 2 and all(ours == pytest.approx(theirs, abs=1e-12) and differ == 0
                                          for _, _, _, ours, theirs, _, _, differ in rows)
