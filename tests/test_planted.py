"""The catalogue of planted bugs (tests/planted) stays true to today's code: every edit applies exactly once, every
test it names exists. Running the catalogue itself (each bug against its tests) is `make planted`."""

from pathlib import Path

import pytest

from planted import ROOT, catalogue

BUGS = catalogue()


def test_the_catalogue_is_not_empty_and_names_are_unique():
    names = [bug.name for bug in BUGS]
    assert names and len(names) == len(set(names))


@pytest.mark.parametrize("bug", BUGS, ids=lambda bug: bug.name)
def test_every_planted_edit_applies_to_todays_code(bug):
    text = (ROOT / bug.path).read_text(encoding="utf-8")
    assert bug.apply(text) != text


@pytest.mark.parametrize("bug", BUGS, ids=lambda bug: bug.name)
def test_every_named_test_exists(bug):
    for node in bug.tests:
        file, _, name = node.partition("::")
        source = (ROOT / file).read_text(encoding="utf-8")
        assert Path(ROOT / file).is_file() and (not name or f"def {name.split('[')[0]}(" in source), node
