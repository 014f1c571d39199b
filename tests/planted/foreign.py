"""Planted bugs of issue 41's two High defects: folders of someone else's files written over by `prepare --out`
and `export --out`, the hint that sent a user's own folder to `prepare --out`, and special tokens counted as the
characters of their spelling in bits per character and per byte (each edit puts back the old behaviour)."""

from planted import Planted

FOREIGN = "tests/test_foreign_folders.py"
BITS = "tests/test_bits_per_char.py"
PREPARE = "src/gptlab/data/prepare.py"

PLANTED = [
    Planted("foreign: prepare writes into a folder of files it did not write", PREPARE, "_check_out",
            [("    if theirs:\n        shown", "    if False:\n        shown")],
            [f"{FOREIGN}::test_prepare_refuses_a_folder_of_files_it_did_not_write",
             f"{FOREIGN}::test_prepare_refuses_the_users_own_text_folder"]),
    Planted("foreign: another project's meta.json and train.bin taken for prepared data", PREPARE, "is_prepared",
            [('return folder_kind(folder) == "data" and (folder / "tokenizer.json").is_file()',
              'return folder_kind(folder) == "data" or (folder / "tokenizer.json").is_file()')],
            f"{FOREIGN}::test_prepare_refuses_a_folder_of_files_it_did_not_write"),
    Planted("foreign: a stopped prepare's own folder refused (its staging folder not recognised)", PREPARE,
            "_check_out", [("stopped = (out / STAGE).is_dir() or", "stopped = False and")],
            f"{FOREIGN}::test_an_interrupted_prepares_folder_is_its_own"),
    Planted("foreign: the hint prepares into the --data folder itself", "src/gptlab/data/batches.py", "not_prepared",
            [('    if out.resolve() == path.resolve() or out.exists():\n', '    if False:\n')],
            f"{FOREIGN}::test_the_hint_after_a_nanogpt_data_folder_prepares_its_text_into_a_folder_of_its_own"),
    Planted("foreign: the hint ignores nanoGPT's input.txt", "src/gptlab/data/batches.py", "not_prepared",
            [('source = path / "input.txt" if (path / "input.txt").is_file() else path',
              'source = path')],
            f"{FOREIGN}::test_the_hint_after_a_nanogpt_data_folder_prepares_its_text_into_a_folder_of_its_own"),
    Planted("foreign: export writes into a folder of another project's files", "src/gptlab/hf/gpt2_folders.py",
            "check_export_folder", [("theirs = [] if overwrite or", "theirs = [] if True or")],
            f"{FOREIGN}::test_export_refuses_a_folder_of_another_project"),
    Planted("foreign: an export's folder is not marked, so the next export is refused", "src/gptlab/hf/gpt2_folders.py",
            "staged_folder", [("rundir.write_json(staging / EXPORT_MARK,", "(lambda *a: None)(staging / EXPORT_MARK,")],
            f"{FOREIGN}::test_export_replaces_its_own_export_and_with_overwrite_another_folder"),
    Planted("foreign: export --overwrite ignored", "src/gptlab/hf/gpt2_folders.py", "export_hf",
            [("    check_export_folder(out, run_dir, overwrite)\n", "    check_export_folder(out, run_dir)\n")],
            f"{FOREIGN}::test_export_replaces_its_own_export_and_with_overwrite_another_folder"),
    Planted("foreign: compare's bits per byte over the spelled-out special tokens", "src/gptlab/runs.py",
            "val_bits_per_byte", [("len(data.tokenizer.text_of(data.val.tolist())[0].encode())",
              "len(data.tokenizer.decode(data.val.tolist()).encode())")],
            f"{BITS}::test_compare_puts_each_run_on_bits_per_byte_of_its_documents_own_bytes"),
    Planted("foreign: a file's end-of-text markers counted as their 13 characters", "src/gptlab/tokenizer.py",
            "Tokenizer.text_of", [("kept = [i for i in ids if i not in specials] if specials else list(ids)",
              "kept = list(ids)")],
            [f"{BITS}::test_a_files_end_of_text_markers_count_no_characters",
             f"{BITS}::test_a_chat_splits_markers_count_no_characters"]),
]
