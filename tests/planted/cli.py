"""Planted bugs of the CLI, config, compare and export (see tests/planted/__init__.py)."""

from planted import Planted

PLANTED = [
    Planted("cli: the verb parser's override misspelt, so a verb's unknown flag is left to the top level (`gptlab "
            "--help`)", "src/gptlab/cli/common.py",
            [("    def parse_known_args(self, args=None", "    def parse_known_arg(self, args=None")],
            "tests/test_cli.py::test_an_unknown_flag_points_to_the_help_of_its_verb"),
    Planted("cli: compare's bits per byte counted per character (the same for ASCII text only)",
            "src/gptlab/cli/verbs.py",
            [("len(data.tokenizer.decode(data.val.tolist()).encode())", "len(data.tokenizer.decode(data.val.tolist()))")],
            "tests/test_cli.py::test_compare_puts_runs_with_different_tokenizers_on_bits_per_byte"),
    Planted("cli: compare's bits per byte from the mean loss as if it were the total",
            "src/gptlab/cli/verbs.py",
            [("Score(run, tokens, 0, text_bytes, loss * tokens)", "Score(run, tokens, 0, text_bytes, loss)")],
            "tests/test_cli.py::test_compare_puts_runs_with_different_tokenizers_on_bits_per_byte"),
    Planted("cli: compare converts to bits per byte when the tokenizers agree, not when they differ",
            "src/gptlab/cli/verbs.py",
            [("    if unit == plots.BITS_PER_BYTE:\n        curves", "    if unit != plots.BITS_PER_BYTE:\n        curves")],
            "tests/test_cli.py::test_compare_puts_runs_with_different_tokenizers_on_bits_per_byte"),
    Planted("cli: a picture's name checked for having a suffix only (.json reaches matplotlib: a traceback)",
            "src/gptlab/plots.py",
            [("    if path.suffix.lower() not in PICTURE_SUFFIXES:", "    if not path.suffix:")],
            "tests/test_cli.py::test_compare_refuses_a_picture_format_it_cannot_write_in_one_line"),
    Planted("cli: a config file's data path taken as it is written (relative to the working folder)",
            "src/gptlab/config.py",
            [("rest.update({k: str(path.parent / v) for k, v", "rest.update({k: str(v) for k, v")],
            ["tests/test_config.py::test_a_config_file_reads_its_paths_relative_to_its_own_folder",
             "tests/test_cli.py::test_a_config_files_data_path_is_relative_to_its_folder"]),
    Planted("cli: a config file's tables checked for [model] only (train = 3 is a traceback)",
            "src/gptlab/config.py",
            [("    for table in CONFIG_TABLES:\n        if not isinstance", "    for table in (\"model\",):\n        if not isinstance")],
            "tests/test_cli.py::test_a_config_file_of_the_wrong_shape_is_one_line"),
    Planted("cli: a config file's preset, data and run checked for being given, not for being text",
            "src/gptlab/config.py",
            [("_check(isinstance(value, str), f\"config file", "_check(value is not None, f\"config file")],
            "tests/test_cli.py::test_a_config_file_of_the_wrong_shape_is_one_line"),
]
