"""Planted bugs of run handling and training (src/gptlab/runs.py, rundir.py, checkpoint.py, optim.py,
training/preflight.py, training/train.py, training/resume.py)."""

from planted import Planted

RUNS = "src/gptlab/runs.py"
PREFLIGHT = "src/gptlab/training/preflight.py"
CHECKPOINT = "src/gptlab/checkpoint.py"
TRAIN = "src/gptlab/training/train.py"
RESUME = "src/gptlab/training/resume.py"
OPTIM = "src/gptlab/optim.py"
T_RUNS = "tests/test_runs.py"
T_TRAIN = "tests/test_train.py"
T_LOST = "tests/test_nothing_lost.py"
T_OPTIM = "tests/test_optim.py"

PLANTED = [
    Planted("runs: the default run folder may be one being trained (its lock not asked)", RUNS, "pick_run_dir",
            [("while not resume and (rundir.RunLock.held(candidate) or any(",
              "while not resume and (any(")],
            f"{T_RUNS}::test_the_default_run_folder_is_never_one_being_trained_nor_one_with_checkpoints"),
    Planted("runs: the default run folder may hold best checkpoints alone", RUNS, "pick_run_dir",
            [('any((candidate / rundir.CKPTS).glob("[sb]*-*"))', 'any((candidate / rundir.CKPTS).glob("step-*"))')],
            f"{T_RUNS}::test_the_default_run_folder_is_never_one_being_trained_nor_one_with_checkpoints"),
    Planted("runs: the latest run by name, not by when it was trained", RUNS, "latest_run",
            [("return max(runs, key=lambda p: (p / rundir.CONFIG).stat().st_mtime)", "return max(runs)")],
            f"{T_RUNS}::test_sample_and_eval_default_to_the_most_recently_trained_run"),
    Planted("runs: a run whose checkpoints are all damaged shows as new", RUNS, "summarize",
            [("    elif ckpt is None and (ck.list_checkpoints(", "    elif False and (ck.list_checkpoints(")],
            f"{T_RUNS}::test_runs_lists_every_run_and_says_which_are_damaged"),
    Planted("runs: one damaged config.json fails the whole listing", RUNS, "list_runs",
            [("return [_summary_or_damaged(p) for p in runs]", "return [summarize(p) for p in runs]")],
            f"{T_RUNS}::test_runs_lists_every_run_and_says_which_are_damaged"),
    Planted("runs: a resume's tokenizer compared by vocabulary size only", PREFLIGHT, "check_resume",
            [("if dataset.tokenizer.to_dict() != load_tokenizer(run / rundir.TOKENIZER).to_dict():",
              "if dataset.tokenizer.vocab_size != load_tokenizer(run / rundir.TOKENIZER).vocab_size:")],
            f"{T_TRAIN}::test_resume_refuses_data_whose_tokenizer_is_not_the_runs"),
    Planted("runs: a new run may start over best checkpoints alone", PREFLIGHT, "check_new_run",
            [('if any((run / rundir.CKPTS).glob("step-*")) or any((run / rundir.CKPTS).glob("best-*")):',
              'if any((run / rundir.CKPTS).glob("step-*")):')],
            f"{T_LOST}::test_a_new_run_never_starts_over_best_checkpoints_alone"),
    Planted("runs: a resume checks the vocabulary before the data (a wrong reason given)", TRAIN, "train",
            [("    if not resume:  # a resume checks first", "    if True:  # a resume checks first")],
            f"{T_LOST}::test_a_refused_resume_leaves_the_run_resumable"),
    Planted("runs: a resume with the other optimizer not refused", PREFLIGHT, "check_resume",
            [("    if was != cfg.optimizer:", "    if False:")],
            f"{T_OPTIM}::test_a_resume_with_the_other_optimizer_is_one_line_and_changes_nothing"),
    Planted("runs: checkpoint files keep the mode safetensors gives them", CHECKPOINT, "save_checkpoint",
            [("            os.chmod(file, mode)  #", "            pass  #")],
            f"{T_TRAIN}::test_every_file_of_a_run_honours_the_umask"),
    Planted("runs: checkpoint files made 0644 whatever the umask", CHECKPOINT, "save_checkpoint",
            [("            os.chmod(file, mode)  #", "            os.chmod(file, 0o644)  #")],
            f"{T_TRAIN}::test_every_file_of_a_run_honours_the_umask"),
    Planted("runs: a loaded run left in training mode (dropout on)", CHECKPOINT, "_load_checkpoint",
            [("return LoadedRun(model.to(device).eval(),", "return LoadedRun(model.to(device),")],
            f"{T_TRAIN}::test_checkpoint_round_trip_gives_the_trained_models_logits"),
    Planted("runs: a resume does not restore the random generators", RESUME, "resume_state",
            [('    ck.restore_rng(ck.load_tensors(ckpt.path / "rng.safetensors"))\n', "")],
            f"{T_TRAIN}::test_resume_continues_exactly"),
    Planted("runs: pruning counts damaged checkpoints as kept", CHECKPOINT, "prune",
            [("        elif ckpt.path == newest or verify_cached(ckpt.path) is None:", "        else:")],
            f"{T_LOST}::test_pruning_keeps_valid_checkpoints_not_damaged_ones"),
    Planted("runs: biases and LayerNorm gains left out of the optimizer", OPTIM, "param_groups",
            [("no_decay = [p for p in params if p.dim() < 2]", "no_decay = [p for p in params if p.dim() < 1]")],
            f"{T_TRAIN}::test_weight_decay_only_on_matrices"),
    Planted("runs: Muon's Newton-Schulz with a mistyped coefficient", OPTIM, "zeropower",
            [("a, b, c = 3.4445, -4.7750, 2.0315", "a, b, c = 3.4445, -4.7500, 2.0315")],
            [f"{T_OPTIM}::test_zeropower_orthogonalises",
             f"{T_OPTIM}::test_muon_updates_match_a_written_out_reference"]),
]
