"""Mutation testing per module with mutmut (pinned in the `mutants` extra): `make mutants` runs every module in
scope, `make mutants MODULE=sampling` one. Each module has its own mutmut folder, .mutants/MODULE/ (ignored by git),
so results are kept between runs: mutmut re-tests the functions whose source changed, and when the module's test
files change this script re-tests its survivors and untested mutants against fresh stats (a weakened test is not
looked for: `--fresh` starts the module over).

    python scripts/mutants.py                  # every module, then the table
    python scripts/mutants.py sampling engine  # these modules
    python scripts/mutants.py --report         # the table from the kept results, nothing run
    python scripts/mutants.py --list           # the modules, their sources and tests
    python scripts/mutants.py --root OLD --sample 40 engine   # an estimate: 40 random mutants run, the rest not

Score = (killed + timeout) / (generated - message - equivalent), per module:
- message: a mutant whose only change is a string literal inside a message call (an exception built with it, print,
  warnings.warn, a logger's or parser's error/warning/info/debug) or an assert statement's message: found by
  comparing each mutant's AST with the original function's, marked skipped before mutmut runs, so never run;
- equivalent: the reviewed equivalent survivors listed in docs/equivalent-mutants.toml, each with its reason, found by
  the code they change (scripts/mutants_ledger.py), not by mutmut's positional names;
- "no tests" (no selected test calls the function) counts against the score, as a survivor does.
Functions that only a CLI subprocess reaches: mutmut 3 maps tests to functions by the calls it records in the pytest
process; scripts/mutmut_hooks records the calls a subprocess makes too (tests/conftest.py already puts the mutated
src/ first on a subprocess's PYTHONPATH, and the subprocess inherits MUTANT_UNDER_TEST).
--sample N runs N mutants drawn at random (seeded) from those not yet run, marks the rest "not sampled" (left out of
the score, which then says "sample"): a score of an older checkout (its "before") for a fraction of the time.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # this repository: the hooks and the equivalents list live here
sys.path.insert(0, str(HERE / "scripts"))  # mutants_ledger.py, beside this file
from mutants_ledger import changed_lines, find, functions, load_equivalents, module_of, only_message_changed
# -11 / -6: the tests' process died of SIGSEGV / SIGABRT (a mutant that passes a bad pointer to C++): the suite fails
STATUS = {1: "killed", 3: "killed", -11: "killed", -6: "killed", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout",
          0: "survived", 5: "no tests", 33: "no tests", 34: "message", 35: "not sampled",
          None: "not checked"}  # the rest: "other"; mutmut's 255 among them (its worker's call of pytest raised, e.g.
# pytest's usage error for a test id it cannot find: no verdict on the mutant; mutmut itself counts it a timeout)
COLUMNS = ["generated", "message", "equivalent", "killed", "timeout", "survived", "no tests", "other", "not checked",
           "not sampled"]
LINKED = ["src", "tests", "README.md", "docs", "scripts", "Makefile"]  # what a module's folder sees of the repo


@dataclass(frozen=True)
class Module:
    sources: tuple[str, ...]  # relative to the repository
    tests: tuple[str, ...]


def _m(sources: str, tests: str) -> Module:
    """Sources and tests by short name: "data/prepare" is src/gptlab/data/prepare.py, "test_cli" tests/test_cli.py
    and "test_cli::test_x" that file's one test."""
    def test(t: str) -> str:
        file, _, name = t.partition("::")
        return f"tests/{file}.py" + (f"::{name}" if name else "")
    return Module(tuple(f"src/gptlab/{s}.py" for s in sources.split()), tuple(test(t) for t in tests.split()))


# Each module's tests: the files that exercise it (mutmut then runs, per mutant, only the tests that reach the mutated
# function). Keep each list to what is needed: the stats run goes through all of them once.
MODULES = {
    "sampling": _m("sampling", "test_sampling test_engine test_structured"),
    "textstream": _m("textstream", "test_textstream test_engine"),
    "engine": _m("engine", "test_engine test_running_batch test_sampling test_textstream test_fused test_serve_batching test_int8 "
                 "test_prefix_cache test_speculative test_structured"),
    # issue 45: speculation's proposals and its bench
    "speculate": _m("inference/speculate", "test_speculative test_serve_scheduler"),
    "bench.speculative": _m("bench/speculative", "test_bench_speculative"),
    # issue 46: constrained generation, one row's state, the API's structured output and its bench
    # (grammar: test_structured reaches every function of it; the server's tests would add minutes a mutant)
    "grammar": _m("inference/grammar", "test_structured test_bench_constrained"),
    "rows": _m("inference/rows", "test_engine test_running_batch test_sampling test_textstream test_serve_batching "
               "test_speculative test_structured"),
    "serve.structured": _m("serve/structured", "test_structured_api test_tool_choice"),
    "bench.constrained": _m("bench/constrained", "test_bench_constrained"),
    # issue 47: hook points by TransformerLens's names, patching, head detectors, their pictures and benches
    "hooks": _m("model inspect/hooks inspect/lens", "test_hooks test_patching test_model test_engine "
                "test_activation_checkpointing"),
    "patching": _m("inspect/patching inspect/circuit", "test_patching test_inspect_patch"),
    "heads": _m("heads inspect/heatmaps", "test_heads test_heads_edges test_heatmaps test_inspect_patch"),
    "bench.interp": _m("bench/interp", "test_inspect_patch"),
    # issue 48: GGUF out and in, llama.cpp as a peer
    "ggml": _m("ggml/vocab ggml/gguf_out ggml/gguf_in ggml/gelu", "test_gguf"),
    "ggml.peer": _m("ggml/peer", "test_llamacpp"),
    "bench.llamacpp": _m("bench/llamacpp", "test_bench_llamacpp"),
    # issue 44: the prompt pass and the exact prefix cache
    "prefix_cache": _m("inference/prefix_cache", "test_prefix_cache test_serve_prefix test_running_batch test_engine"),
    "serve.api": _m("serve/api", "test_serve test_serve_api test_serve_batching test_serve_chat"),
    "serve.app": _m("serve/app", "test_serve test_serve_api test_serve_batching test_serve_chat test_serve_harness"),
    "serve.scheduler": _m("serve/scheduler", "test_serve test_serve_scheduler test_serve_batching test_serve_chat"),
    # issue 44: every answer's shape (completions, chat, streams, usage, logprobs) and /metrics
    "serve.responses": _m("serve/responses serve/metrics", "test_serve test_serve_api test_serve_chat "
                          "test_serve_chat_bytes test_serve_prefix test_structured_api test_serve_scheduler"),
    "corpus": _m("data/corpus", "test_corpus test_readers test_data"),
    "readers": _m("data/readers", "test_readers test_corpus test_data"),
    "encoder": _m("data/encoder", "test_corpus test_shards"),
    "staging": _m("data/staging", "test_tokenfiles test_shards test_corpus"),
    "tokenfiles": _m("data/tokenfiles", "test_tokenfiles test_data test_shards test_nothing_lost"),
    "data": _m("data/prepare data/batches", "test_data test_tokenfiles test_corpus test_shards"),
    "inspect": _m("inspect/anatomy inspect/page inspect/pictures inspect/trace", "test_inspect test_inspect_page test_trace"),
    # of test_cli (slow under mutmut's tracing), the tests that reach runs.py: the default run folder, which run
    # sample picks, compare, a config file's data
    "runs": _m("runs", "test_runs test_runs_start test_cli::test_default_run_dir_never_overwrites_an_earlier_run "
               "test_cli::test_version_and_which_run_sample_and_eval_picked "
               "test_cli::test_compare_puts_runs_with_different_tokenizers_on_bits_per_byte "
               "test_cli::test_compare_refuses_a_picture_format_it_cannot_write_in_one_line "
               "test_cli::test_a_config_files_data_path_is_relative_to_its_folder"),
    # test_data: folder_kind (its one test); test_checkpoint: state.json's schema (TrainingState), old files included.
    # Not test_faults (its crashes reach rundir only through the checkpoints test_nothing_lost also writes): with it,
    # mutmut's first traced run of the list took more than 90 minutes on a busy 2-CPU machine
    "rundir": _m("rundir", "test_nothing_lost test_runs test_runs_start test_checkpoint "
                 "test_data::test_what_a_folder_holds_decides_what_may_be_written_over_it"),
    "checkpoint": _m("checkpoint", "test_checkpoint test_nothing_lost test_faults test_train test_runtime test_lora "
                     "test_lora_chat"),
    "preflight": _m("training/preflight", "test_nothing_lost test_train test_shards "
                    "test_conversations::test_fine_tuning_grows_the_vocabulary_by_the_markers_at_the_mean_row"),
    "evaluate": _m("evaluate", "test_evaluate test_hf"),
    "optim": _m("optim", "test_optim test_train"),
    "int8": _m("inference/int8", "test_int8"),
    # how a model is made ready to generate with: packed (and, for bf16 without native products, widened) weights
    "weights": _m("inference/weights inference/loading inference/prepared",
                  "test_engine test_load_for_inference test_fused"),
    # issue 25: the named kernel builds and the CPU's features they are chosen by; bench generate --quality's measures
    "native": _m("inference/native machine", "test_machine test_fused test_compiled test_kernel_mutants"),
    "quality": _m("bench/quality", "test_int8"),
    "tasks": _m("tasks/items tasks/score tasks/measure tasks/report tasks/harness cli/task_verbs",
                "test_tasks test_harness test_tasks_vs_harness"),
    "reference": _m("reference/naive_gpt reference/naive_adamw reference/library reference/naive_training reference/check "
                    "compiled",
                    "test_reference test_reference_cli test_reference_mutants test_compiled test_reference_edges "
                    "test_fused test_lanes"),  # the builds compiled.py chooses and compiles are tested there
    # issue 49: the fast engine's Python (its rungs' libraries, FastGPT, the masks it draws) and bench metal
    "fast": _m("reference/fast", "test_fast test_fast_engine_cli"),
    "bench.metal": _m("bench/metal", "test_bench_metal"),
    # issue 26: LoRA adapters and PEFT's format
    "lora": _m("lora hf/peft", "test_lora test_lora_chat test_lora_edges test_chunked_loss "
               "test_distributed::test_lora_adapters_train_in_two_processes_like_in_one"),
    "loggers": _m("training/loggers", "test_loggers test_loggers_edges"),
    # issue 27: conversations, the chat template, rows and lessons of conversations, the markers' rows under LoRA
    "chat": _m("chat data/conversations", "test_conversations test_lora_chat test_chat_edges"),
    "chat.tokenizer": _m("tokenizer", "test_tokenizer test_conversations"),
    "chat.cli": _m("cli/chat_verbs", "test_chat_cli test_serve_chat::"
                   "test_the_openai_client_s_answers_equal_gptlab_chat_s_with_the_same_seed_and_settings "
                   "test_structured_api::test_chat_answers_obey_the_constraint test_serve_prefix::"
                   "test_a_chat_continued_turn_by_turn_answers_as_without_the_cache_and_reuses_the_conversation"),
    "bench.chat": _m("bench/chat_finetune", "test_bench_chat"),
    "chat.training": _m("data/batches training/step",
                        "test_conversations test_data test_train "
                        "test_distributed::test_conversations_train_in_two_processes_like_in_one "
                        "test_runtime::test_compiled_training_matches_eager "
                        "test_reference::test_twenty_steps_match_the_torch_path"),
    "memory": _m("bench/memory", "test_activation_checkpointing "
                 "test_lora::test_bench_train_sets_lora_beside_full_fine_tuning_with_memory_split"),
}


def module_config(root: Path, module: Module) -> str:
    """The pyproject.toml of a module's folder: `root`'s (its pytest settings), with this repository's
    [tool.mutmut] narrowed to `module`."""
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    base = tomllib.loads((HERE / "pyproject.toml").read_text(encoding="utf-8")).get("tool", {}).get("mutmut", {})
    kept = [line for line in _without_table(text, "tool.mutmut")]
    table = {**base, "source_paths": ["src"], "only_mutate": list(module.sources),
             "pytest_add_cli_args_test_selection": [t for t in module.tests if (root / t.split("::")[0]).exists()],
             "pytest_add_cli_args": [*base.get("pytest_add_cli_args", []), "-p", "mutmut_plugin"],
             "also_copy": [p for p in LINKED if p not in ("src", "tests")]}
    lines = [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    return "\n".join([*kept, "", "[tool.mutmut]", *lines, ""])


def _without_table(text: str, name: str) -> list[str]:
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("["):
            inside = line.strip() == f"[{name}]"
        if not inside:
            out.append(line)
    return out


def prepare_folder(root: Path, name: str, module: Module) -> Path:
    """.mutants/NAME under `root`, its links to the repository and its pyproject.toml written."""
    top = root / ".mutants"
    folder = top / name
    folder.mkdir(parents=True, exist_ok=True)
    (top / ".gitignore").write_text("*\n")  # the whole folder stays out of git
    for entry in LINKED:
        link = folder / entry
        if (root / entry).exists() and not link.is_symlink():
            link.symlink_to(root / entry)
    (folder / "pyproject.toml").write_text(module_config(root, module), encoding="utf-8")
    return folder


def tests_fingerprint(root: Path, module: Module) -> str:
    """A hash of the module's test files and of every file under tests/ that is not a test file (a conftest, a
    helper or the data a test reads can change what it checks)."""
    digest = hashlib.sha256()
    own = {root / t.split("::")[0] for t in module.tests}
    for path in sorted(p for p in (root / "tests").rglob("*") if p.is_file() and "__pycache__" not in p.parts
                       and (p in own or not p.name.startswith("test_"))):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    digest.update(repr(module).encode())
    return digest.hexdigest()[:16]


def metas(folder: Path, module: Module) -> list[tuple[Path, Path]]:
    """(mutated source, its .meta) for each source of `module` that mutmut has mutated."""
    found = []
    for source in module.sources:
        mutated = folder / "mutants" / source
        if (mutated.parent / (mutated.name + ".meta")).exists():
            found.append((mutated, mutated.parent / (mutated.name + ".meta")))
    return found


def mark_messages(folder: Path, module: Module) -> int:
    """Mark every not-yet-run mutant that only changes a message string as skipped (34); unmark any mark that no
    longer holds. Returns how many are marked."""
    marked = 0
    for mutated, meta in metas(folder, module):
        data = json.loads(meta.read_text())
        funcs = functions(ast.parse(mutated.read_text(encoding="utf-8")))
        codes = data["exit_code_by_key"]
        for key, code in codes.items():
            name = key.rpartition(".")[2]
            original = funcs.get(name.rpartition("__mutmut_")[0] + "__mutmut_orig")
            message = original is not None and name in funcs and only_message_changed(original, funcs[name])
            if message and code is None:
                codes[key] = 34
            elif not message and code == 34:
                codes[key] = None
            marked += codes[key] == 34
        meta.write_text(json.dumps(data, indent=4))
    return marked


def mark_sample(folder: Path, module: Module, size: int | None, seed: int = 0,
                again: frozenset[str] = frozenset()) -> int:
    """With `size`: keep `size` of the mutants not yet run (or marked not sampled), drawn at random with `seed`, and
    the ones in `again` (survivors of an earlier sample to test again: new tests), and mark the others not sampled
    (35); without: unmark every such mark, so that all are run. Returns how many are marked."""
    entries = [(meta, json.loads(meta.read_text())) for _, meta in metas(folder, module)]
    open_keys = sorted(k for _, data in entries for k, c in data["exit_code_by_key"].items()
                       if c in (None, 35) and k not in again)
    keep = set(open_keys) if size is None else set(random.Random(seed).sample(open_keys, min(size, len(open_keys))))
    keep |= again
    marked = 0
    for meta, data in entries:
        codes = data["exit_code_by_key"]
        for key, code in codes.items():
            if code in (None, 35):
                codes[key] = None if key in keep else 35
                marked += codes[key] == 35
        meta.write_text(json.dumps(data, indent=4))
    return marked


GENERATE = """
from mutmut.__main__ import copy_src_dir, copy_also_copy_files, setup_source_paths, create_mutants
import os
os.makedirs("mutants", exist_ok=True)
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(1)
"""


def tool_env(folder: Path) -> dict[str, str]:
    """The environment mutmut runs in: the hooks and the mutated src/ first on PYTHONPATH (so CLI subprocesses
    import the mutants even where tests/conftest.py does not arrange it); where the hooks leave subprocess calls
    and keep the compiled kernel (scripts/mutmut_hooks)."""
    hits = folder / "subprocess-hits"
    hits.mkdir(exist_ok=True)
    path = [str(HERE / "scripts" / "mutmut_hooks"), str(folder / "mutants" / "src")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "MUTMUT_HITS_DIR": str(hits),
            "MUTMUT_FOLDER": str(folder), "MUTMUT_KERNELS": str(folder / "kernels"), "PYTHONDONTWRITEBYTECODE": "1"}


def forget_for_new_tests(folder: Path, module: Module, fingerprint: str) -> frozenset[str]:
    """When the tests changed since the last run began: the stats (which test reaches which function) are
    collected again and the survivors, the untested and the unclassified ("other") mutants are tested again; kills
    stand. Returns those mutants (a sample keeps them)."""
    stamp = folder / "tests-fingerprint"
    if stamp.exists() and stamp.read_text() == fingerprint:
        return frozenset()
    (folder / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    again: set[str] = set()
    for _, meta in metas(folder, module):
        data = json.loads(meta.read_text())
        again |= {k for k, c in data["exit_code_by_key"].items()
                  if STATUS.get(c, "other") in ("survived", "no tests", "other")}
        data["exit_code_by_key"] = {k: None if k in again else c for k, c in data["exit_code_by_key"].items()}
        meta.write_text(json.dumps(data, indent=4))
    return frozenset(again)


def forget_timeouts(folder: Path, module: Module) -> None:
    """Mark the mutants counted as timeouts not checked, so that mutmut tests them again."""
    for _, meta in metas(folder, module):
        data = json.loads(meta.read_text())
        data["exit_code_by_key"] = {k: None if STATUS.get(c) == "timeout" else c
                                    for k, c in data["exit_code_by_key"].items()}
        meta.write_text(json.dumps(data, indent=4))


def refresh_native_sources(root: Path, folder: Path) -> None:
    """Copy the C++ kernel's sources (src/gptlab/inference/csrc) into mutmut's copy of src/: mutmut refreshes the
    Python files it copied, not these, and a kernel built from an older decode.cpp than native.py expects is refused
    (its struct layout), failing every test that decodes with it: a module's stats run fails, its mutants look
    killed."""
    source, copy = root / "src" / "gptlab" / "inference" / "csrc", folder / "mutants" / "src" / "gptlab" / "inference"
    if source.is_dir() and copy.is_dir():
        shutil.copytree(source, copy / "csrc", dirs_exist_ok=True)


def run_module(root: Path, name: str, module: Module, children: int, fresh: bool, retry_timeouts: bool = False,
               sample: int | None = None) -> int:
    """Generate, mark message mutants, run mutmut for one module; mutmut's exit status."""
    folder = prepare_folder(root, name, module)
    if fresh:
        shutil.rmtree(folder / "mutants", ignore_errors=True)
        (folder / "tests-fingerprint").unlink(missing_ok=True)
    if retry_timeouts:
        forget_timeouts(folder, module)
    env = tool_env(folder)
    fingerprint = tests_fingerprint(root, module)
    again = forget_for_new_tests(folder, module, fingerprint)
    (folder / "tests-fingerprint").write_text(fingerprint)  # an interrupted run resumes where it stopped
    subprocess.run([sys.executable, "-c", GENERATE], cwd=folder, env=env, check=True, stdout=subprocess.DEVNULL)
    refresh_native_sources(root, folder)
    print(f"mutants: {name}: {mark_messages(folder, module)} message-only mutants marked skipped", flush=True)
    unsampled = mark_sample(folder, module, sample, again=again)
    if sample is not None:
        print(f"mutants: {name}: {unsampled} mutants left out of the sample of {sample}", flush=True)
    mutmut = Path(sys.executable).with_name("mutmut")
    return subprocess.run([str(mutmut), "run", "--max-children", str(children)], cwd=folder, env=env).returncode


def tally(folder: Path, module: Module, listed: dict[str, list]) -> tuple[dict[str, int], list[str]]:
    """(counts per column, lines describing survivors and stale listings) for one module's kept results. A survivor
    that makes a listed mutation (mutants_ledger.find) counts as equivalent; a listed mutation of the module's
    sources that a run mutant makes but does not survive, or that no mutant makes, is stale."""
    counts = dict.fromkeys(COLUMNS, 0)
    notes, made, modules = [], set(), set()
    for mutated, meta in metas(folder, module):
        modules.add(module_of(mutated.relative_to(folder / "mutants").as_posix()))
        source = mutated.read_text(encoding="utf-8")
        funcs, source_lines = functions(ast.parse(source)), source.splitlines()
        for key, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            status = STATUS.get(code, "other")
            name = key.rpartition(".")[2]
            original = funcs.get(name.rpartition("__mutmut_")[0] + "__mutmut_orig")
            mutation = find(listed, key, original, funcs.get(name))
            made.add(mutation)
            if mutation and status == "survived":
                status = "equivalent"
            elif mutation and status not in ("not sampled", "not checked"):  # run, and killed
                notes.append(f"  stale listing {mutation} ({status}: {key})")
            if status in ("survived", "no tests", "other"):
                lines = changed_lines(source_lines, original, funcs[name]) if original and name in funcs else []
                notes.append(f"  {status:<9} {key}: {' | '.join(lines) or '(a deletion)'}")
            counts["generated"] += 1
            counts[status] += 1
    notes += [f"  stale listing {m} (no mutant makes this change now)" for function, mutations in listed.items()
              if function.partition(":")[0] in modules for m in mutations if m not in made]
    return counts, notes


def score(counts: dict[str, int]) -> str:
    scored = counts["generated"] - counts["message"] - counts["equivalent"] - counts["not sampled"]
    partial = " (so far)" if counts["not checked"] else ""
    partial += f" (sample of {scored})" if counts["not sampled"] else ""
    return f"{100 * (counts['killed'] + counts['timeout']) / scored:.1f} %{partial}" if scored else "-"


def report(root: Path, names: list[str], verbose: bool) -> None:
    equivalents = load_equivalents(HERE / "docs" / "equivalent-mutants.toml")
    print("| module | " + " | ".join(COLUMNS) + " | score |")
    print("| --- " * (len(COLUMNS) + 2) + "|")
    all_notes = []
    for name in names:
        folder = root / ".mutants" / name
        counts, notes = tally(folder, MODULES[name], equivalents)
        print(f"| {name} | " + " | ".join(str(counts[c]) for c in COLUMNS) + f" | {score(counts)} |")
        all_notes += [f"{name}:", *notes] if notes else []
    if verbose and all_notes:
        print("\n".join(["", "not killed (show one: cd .mutants/MODULE && ../../.venv/bin/mutmut show NAME):",
                         *all_notes]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help=f"modules to run (default: all): {', '.join(MODULES)}")
    parser.add_argument("--report", action="store_true", help="print the table from kept results; run nothing")
    parser.add_argument("--list", action="store_true", help="print the modules, their sources and tests")
    parser.add_argument("--fresh", action="store_true", help="forget the kept results of these modules first")
    parser.add_argument("--retry-timeouts", action="store_true",
                        help="test the mutants counted as timeouts again (mutmut's wall limit is (estimate + 1 s) x 15:"
                             " a run on a loaded machine can time out where an idle one would not)")
    parser.add_argument("--sample", type=int, metavar="N",
                        help="run only N mutants drawn at random (seeded) from those not yet run: an estimate")
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once (default: 2)")
    parser.add_argument("--root", type=Path, default=HERE,
                        help="the checkout to mutate (default: this one; e.g. a git worktree of an older commit)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        print(f"mutants: unknown module {', '.join(unknown)}; choose from: {', '.join(MODULES)}", file=sys.stderr)
        return 2
    names = args.modules or list(MODULES)
    if args.list:
        for name in names:
            print(f"{name}: {' '.join(MODULES[name].sources)}\n    tests: {' '.join(MODULES[name].tests)}")
        return 0
    root = args.root.resolve()
    failed = []
    for name in [] if args.report else names:
        if run_module(root, name, MODULES[name], args.max_children, args.fresh, args.retry_timeouts, args.sample) != 0:
            failed.append(name)
    report(root, [n for n in names if (root / ".mutants" / n / "mutants").exists()], verbose=True)
    if failed:
        print(f"mutants: mutmut failed for {', '.join(failed)} (its output above says why)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
