"""The boundary rule holds (docs/design.md, "Boundaries"): every size the code cuts work by and every setting a
user can change has an entry in tests/boundaries.toml naming the tests that cross or vary it, each test exists and
names it; a new constant or flag without one fails here, so none slips in unchecked. The finders are tested on
planted sources, so that a finder that finds nothing cannot pass for a listing that is complete."""

import argparse

import pytest

from boundaries import api_fields, constants, flags, listing, mentions, settings, functions_of_tests

LISTED = listing()
TESTS = functions_of_tests()


def test_every_constant_has_an_entry_and_every_entry_a_constant():
    found = constants()
    assert len(found) > 20  # the finder works on today's sources (its own test below)
    assert sorted(found - set(LISTED["constant"])) == [], "add them to tests/boundaries.toml (scripts/boundaries.py)"
    assert sorted(set(LISTED["constant"]) - found) == [], "stale entries: the constant is gone"


def test_every_setting_has_an_entry_and_every_entry_a_setting():
    found = settings()
    assert len(found) > 150
    assert sorted(found - set(LISTED["setting"])) == [], "add them to tests/boundaries.toml (scripts/boundaries.py)"
    assert sorted(set(LISTED["setting"]) - found) == [], "stale entries: the setting is gone"


def entries():
    return [(kind, key, entry) for kind, group in LISTED.items() for key, entry in group.items()]


@pytest.mark.parametrize("kind, key, entry", entries(), ids=[f"{k}:{key}" for k, key, _ in entries()])
def test_each_entry_names_tests_that_exist_and_name_it_or_says_why_it_is_no_edge(kind, key, entry):
    if "not_an_edge" in entry:
        assert kind == "constant" and entry["not_an_edge"].strip() and not entry.get("tests"), \
            "only a constant may be no edge, with its reason and no tests"
        return
    assert entry.get("tests"), f"{key}: name the tests that cross or vary it"
    if kind == "setting":  # what the tests run it at and what they hold the result to (or that it is only refused)
        assert entry.get("varies", "").strip(), f"{key}: say in `varies` the value its tests use and what they compare"
    for node in entry["tests"]:
        assert node in TESTS, f"{key}: no test {node}"
        if kind != "edge":
            assert mentions(TESTS[node], key, entry), f"{key}: {node} does not name it (or `names` in its entry)"


# ---- the finders, on planted sources -----------------------------------------------------------------------------

def test_the_constant_finder_finds_integer_constants_of_modules_and_of_cpp(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("TILE = 32\nBIG: int = 1 << 20\nNAME = 'x'\nFLAG = True\nlower = 3\n"
                                           "RATE = 0.5\nDERIVED = TILE * 2\ndef f():\n    INNER = 4\n")
    (tmp_path / "k.h").write_text("constexpr int LANES = 16;\nconstexpr const char* NAME = \"a\";\n"
                                  "static constexpr int64_t BLOCK = 64;\n")
    assert constants(tmp_path) == {"gptlab.pkg.m.TILE", "gptlab.pkg.m.BIG", "k.h:LANES", "k.h:BLOCK"}


def test_the_flag_finder_finds_every_verbs_flags_and_those_added_on_first_use(tmp_path):
    from gptlab.cli.common import Verbs

    parser = argparse.ArgumentParser()
    parser.add_argument("--top")
    sub = parser.add_subparsers(action=Verbs)
    sub.add_parser("a").add_argument("--alpha")
    sub.add_parser("b", flags=lambda p: p.add_argument("--beta", "-b"))
    assert flags(parser) == {"--top", "--alpha", "--beta"}


def test_the_api_field_finder_finds_fields_read_and_fields_refused(tmp_path):
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "api.py").write_text('x = body.get("temperature")\ny = body["messages"]\n'
                                               'UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, "")}\n')
    assert api_fields(tmp_path) == {"api:temperature", "api:messages", "api:best_of", "api:suffix"}


@pytest.mark.parametrize("key, source, found", [
    ("--top-k", 'main(["sample", "--top-k", "5"])', True), ("--top-k", "cfg = SampleConfig(top_k=5)", True),
    ("--top-k", 'main(["sample", "--top-k-ish"])', False), ("--top", 'main(["sample", "--top-k", "5"])', False),
    ("api:n", 'client.create(n=2)', True), ("api:n", '{"n": 2}', True), ("api:n", "n = 2", False),
    ("gptlab.tasks.measure.ITEMS_PER_CALL", "range(ITEMS_PER_CALL + 1)", True),
    ("gptlab.tasks.measure.ITEMS_PER_CALL", "items_per_call = 3", False)])
def test_a_test_names_a_key_by_its_own_spelling(key, source, found):
    assert mentions(source, key) is found
