"""Planted bugs of `gptlab eval --task` past its edges: items past the first batch of ITEMS_PER_CALL, few-shot
examples under --limit and in later batches, the measures' divisors and interval, the result files' names, llm.c's
rendering of HellaSwag records, and the harness model's stop strings."""

from planted import Planted

MEASURE = "src/gptlab/tasks/measure.py"
ITEMS = "src/gptlab/tasks/items.py"
REPORT = "src/gptlab/tasks/report.py"
HARNESS = "src/gptlab/tasks/harness.py"
VERBS = "src/gptlab/cli/task_verbs.py"
VS = "tests/test_tasks_vs_harness.py"
EVERY_ITEM = f"{VS}::test_every_item_scores_as_the_harness_scores_it"
LIMIT = f"{VS}::test_a_limit_scores_the_first_items_as_the_whole_file_does"
OWN_FILE = f"{VS}::test_each_setting_keeps_its_own_result_file"
LLMC = f"{VS}::test_acc_token_mean_is_llm_c_hellaswag_evaluation_item_for_item"
STOPS = f"{VS}::test_greedy_generation_with_stop_strings_that_occur_is_the_hf_models"
TASKS = "tests/test_tasks.py"
BOOTSTRAP = f"{TASKS}::test_the_bootstrap_interval_is_the_95_percent_one"
ACC_NORM = f"{TASKS}::test_acc_norm_divides_by_the_options_own_characters_as_the_harness_does"
CROPPED = f"{TASKS}::test_the_cropped_count_counts_items_not_options_in_every_batch"
NAMES = f"{TASKS}::test_result_files_are_named_by_every_setting_that_changes_the_score"
SCHEMA_SHOTS = f"{TASKS}::test_fewshot_examples_are_the_right_answers_of_schema_items_whatever_their_label"
KINDS_SHOTS = f"{TASKS}::test_fewshot_runs_on_every_kind_and_keeps_its_own_file"

PLANTED = [
    Planted("taskedge: the last item of every batch of ITEMS_PER_CALL never scored", MEASURE, "evaluate_items",
            [("batch, pairs = chosen[first:first + ITEMS_PER_CALL], []",
              "batch, pairs = chosen[first:first + ITEMS_PER_CALL - 1], []")],
            [EVERY_ITEM, LIMIT]),
    Planted("taskedge: the items of a batch start over from index 0 (later batches draw the first batch's examples)",
            MEASURE, "evaluate_items",
            [("for index, item in enumerate(batch, first):", "for index, item in enumerate(batch):")],
            [EVERY_ITEM]),
    Planted("taskedge: few-shot examples drawn from the --limit items only, not the whole file", MEASURE,
            "evaluate_items",
            [("fewshot_prefix(items, index, num_fewshot, seed)", "fewshot_prefix(chosen, index, num_fewshot, seed)")],
            [LIMIT]),
    Planted("taskedge: an item may be drawn as its own few-shot example", MEASURE, "fewshot_prefix",
            [("others = [j for j in range(len(items)) if j != index]", "others = list(range(len(items)))")],
            [SCHEMA_SHOTS, EVERY_ITEM]),
    Planted("taskedge: the few-shot example shows the first option, not the right one", ITEMS, "Item.worked_example",
            [("context, continuation = self.options[self.label]", "context, continuation = self.options[0]")],
            [SCHEMA_SHOTS, EVERY_ITEM]),
    Planted("taskedge: acc_norm divides by the continuation scored, its delimiter counted", MEASURE, "judge",
            [("chars = np.array([float(len(t)) for t in item.option_texts])",
              "chars = np.array([float(len(c)) for _, c in item.options])")],
            [ACC_NORM, EVERY_ITEM]),
    Planted("taskedge: the bootstrap interval is the 90 % one (5th to 95th percentile)", MEASURE, "bootstrap",
            [("return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))",
              "return float(np.percentile(means, 5)), float(np.percentile(means, 95))")],
            [BOOTSTRAP]),
    Planted("taskedge: the cropped count counts options, not items", MEASURE, "evaluate_items",
            [("cropped += any(s.cropped for s in item_scores)", "cropped += sum(s.cropped for s in item_scores)")],
            [CROPPED]),
    Planted("taskedge: a k-shot result file named as the 0-shot one (it replaces it)", REPORT, "result_path",
            [('parts += [f"{num_fewshot}shot", f"seed{seed}"] if num_fewshot else []', "")],
            [NAMES, OWN_FILE, KINDS_SHOTS]),
    Planted("taskedge: a k-shot result file named without its seed (one seed's replaces another's)", REPORT,
            "result_path", [('parts += [f"{num_fewshot}shot", f"seed{seed}"] if num_fewshot else []',
              'parts += [f"{num_fewshot}shot"] if num_fewshot else []')],
            [NAMES]),
    Planted("taskedge: a --limit result file named as the whole file's", REPORT, "result_path",
            [('parts += [f"limit{limit}"] if limit is not None else []', "")],
            [NAMES, LIMIT]),
    Planted("taskedge: acc_token_mean on the harness's rendering of a HellaSwag record, not llm.c's", MEASURE, "judge",
            [("per_token = scored[len(item.options):] or scored", "per_token = scored[:len(item.options)]")],
            [LLMC]),
    Planted("taskedge: llm.c's context of a HellaSwag record is its activity label and ctx", ITEMS, "_item",
            [('raw = _text(record, "ctx", where) if "ctx" in record else',
              'raw = f"{record[\'activity_label\']}: " + _text(record, "ctx", where) if "ctx" in record else')],
            [LLMC]),
    Planted("taskedge: llm.c's endings encoded without the space in front", MEASURE, "item_pairs",
            [('tokenizer.encode(" " + ending, allow_special=True)', "tokenizer.encode(ending, allow_special=True)")],
            [LLMC]),
    Planted("taskedge: a generation keeps the stop string it stopped at", HARNESS, "GptlabLM.generate_until",
            [("text = text[:text.index(stop)]", "text = text[:text.index(stop) + len(stop)]")],
            [STOPS]),
    Planted("taskedge: a generation is cut at its first stop string only", HARNESS, "GptlabLM.generate_until",
            [("for stop in until:", "for stop in until[:1]:")],
            [STOPS]),
    Planted("taskedge: --seed does not reach the harness's few-shot sampler", VERBS, "eval_harness",
            [(",\n                                      fewshot_random_seed=args.seed)", ")")],
            ["tests/test_harness.py::test_eval_lm_eval_seed_is_the_harness_few_shot_seed"]),
]
