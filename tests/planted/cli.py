"""Planted bugs of the CLI, config, compare and export (see tests/planted/__init__.py)."""

from planted import Planted

PLANTED = [
    Planted("cli: a verb's unknown flag left to the top-level parser (its message points to `gptlab --help`)",
            "src/gptlab/cli/common.py",
            [("        if rest:\n            self.error(", "        if rest and False:\n            self.error(")],
            "tests/test_cli.py::test_an_unknown_flag_points_to_the_help_of_its_verb"),
]
