"""`gptlab inspect patch`, `gptlab inspect heads` and the two interpretability benches from the command line: what
they print and write (tables, heat maps, the page, checked in a real browser), the shares worked out by hand from
the sweeps' values, and one clear line for each bad input."""

import re

import pytest
import torch
from helpers import one_torch_thread, run_bad, run_ok, tiny_run  # noqa: F401  (one_torch_thread: autouse)

from gptlab.checkpoint import load_run
from gptlab.heads import head_scores
from gptlab.inspect.heatmaps import patch_page, shares
from gptlab.inspect.patching import activation_patch, attribution_patch, logit_diff

pytest.importorskip("transformer_lens", reason="pip install -e '.[test]' (transformer-lens 3.9)")

FLAGS = ["--n-layer", "2", "--n-head", "3", "--n-embd", "24", "--block-size", "32", "--batch-size", "4",
         "--eval-interval", "10", "--eval-batches", "1", "--log-interval", "10", "--precision", "fp32", "--quiet"]
CLEAN, CORRUPT = "All:\nSpeak, sp", "All:\nSpeak, re"  # the same length in characters



@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("patch"), 30, FLAGS)


@pytest.fixture(scope="module")
def patched(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("pictures")
    import contextlib
    import io

    from gptlab.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["inspect", "patch", "--run", str(run), "--out", str(out), "--clean", CLEAN, "--corrupt",
                     CORRUPT, "--answer", "e", "--wrong", "a", "--attribution", "--sweep", "resid_pre",
                     "--sweep", "head_out"]) == 0
    return out, printed.getvalue()


def test_patch_prints_each_sweep_and_writes_the_pictures_and_the_page(patched):
    out, text = patched
    assert sorted(p.name for p in out.iterdir()) == ["attribution.png", "logit-attribution.png", "patch.html",
                                                    "patch.png"]
    assert text.count("activation patching, ") == 2 and text.count("attribution patching, ") == 2
    assert "direct logit attribution: the parts of logit difference" in text
    header = re.search(r"clean (-?[\d.]+), corrupted (-?[\d.]+)", text)
    assert header and header.group(1) != header.group(2)


def test_the_table_shows_each_share_of_the_gap_as_worked_out_by_hand(run, patched):
    loaded = load_run(run)
    ids = [torch.tensor([loaded.tokenizer.encode(t)]) for t in (CLEAN, CORRUPT)]
    e, a = loaded.tokenizer.encode("e")[0], loaded.tokenizer.encode("a")[0]
    result = activation_patch(loaded.model, *ids, logit_diff(e, a), "resid_pre")
    by_hand = (result.values - result.corrupt) / (result.clean - result.corrupt)
    assert torch.allclose(shares(result)[0], by_hand)
    text = patched[1].split("activation patching, residual stream")[1].split("\n\n")[1]
    rows = [line.split()[1:] for line in text.splitlines() if line.startswith("L")]
    assert [[float(v) for v in row] for row in rows] == [[round(float(v), 2) + 0.0 for v in row]
                                                         for row in by_hand.tolist()]


def test_a_gap_of_nothing_shows_the_raw_change(run):
    loaded = load_run(run)
    ids = torch.tensor([loaded.tokenizer.encode(CLEAN)])
    result = attribution_patch(loaded.model, ids, ids, logit_diff(3, 4), "attn_out")
    matrix, is_share = shares(result)
    assert not is_share and torch.equal(matrix, result.values)
    assert "change of the metric" in patch_page([result], None, list(CLEAN), "same")


@pytest.mark.device_path("browser")
def test_the_page_in_a_headless_browser(patched, browser):
    out, _ = patched
    ctx = browser.new_context(viewport={"width": 1200, "height": 900})
    requests, errors = [], []
    ctx.on("request", lambda r: requests.append(r.url))
    view = ctx.new_page()
    view.on("pageerror", lambda e: errors.append(str(e)))
    view.goto((out / "patch.html").as_uri())
    assert view.locator("h3.sweep").count() == 4 and view.locator("h3.dla").count() == 1
    assert view.locator("table").count() == 5
    first = view.locator("table").first.locator("tr").nth(1).locator("td").first
    assert re.fullmatch(r"-?[\d.e+-]+", first.get_attribute("title"))
    assert requests == [(out / "patch.html").as_uri()] and errors == []
    ctx.close()


@pytest.mark.parametrize("argv, message", [
    (["--clean", "Spe", "--corrupt", "Spea"], "--clean is 3 tokens and --corrupt 4"),
    (["--answer", "ee"], r"--answer 'ee' is 2 tokens \(e \| e\)"),
    (["--wrong", "e"], "--answer and --wrong are the same token"),
    (["--clean", "e" * 33, "--corrupt", "a" * 33], "the prompts are 33 tokens, longer than the model's context of 32"),
    (["--answer", ""], r"--answer '' is 0 tokens \(nothing\)"),
])
def test_bad_input_is_one_line(run, capsys, argv, message):
    base = {"--clean": CLEAN, "--corrupt": CORRUPT, "--answer": "e", "--wrong": "a"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    flat = [x for pair in base.items() for x in pair]
    line = run_bad(capsys, "inspect", "patch", "--run", str(run), *flat)
    assert re.search(message, line), line


def test_heads_prints_every_head_s_scores_and_writes_its_picture(run, capsys, tmp_path):
    text = run_ok(capsys, "inspect", "heads", "--run", str(run), "--out", str(tmp_path), "--half", "8",
                  "--batch", "3", "--seed", "4")
    loaded = load_run(run)
    scores = head_scores(loaded.model, loaded.tokenizer.vocab_size, 8, 3, 4)
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in text.splitlines()
            if re.match(r"L\dH\d ", line)}
    assert len(rows) == 6
    for layer in range(2):
        for head in range(3):
            expected = [scores.previous_token[layer, head], scores.duplicate_token[layer, head],
                        scores.induction[layer, head]]
            assert rows[f"L{layer}H{head}"] == [round(float(v), 3) + 0.0 for v in expected]
    assert (tmp_path / "heads.png").stat().st_size > 5000
    assert "--batch must be >= 1" in run_bad(capsys, "inspect", "heads", "--run", str(run), "--batch", "0")


def test_bench_hooks_prints_every_hook_within_tolerance(capsys):
    text = run_ok(capsys, "bench", "hooks", "--model", "tiny", "--tokens", "9", "--rounds", "1")
    diffs = re.findall(r"^  (\S+)\s+(\d\.\d\de[-+]\d\d)$", text, re.M)
    assert len(diffs) == 21 and all(float(d) <= 1e-5 for _, d in diffs)
    for name in ("plain forward (no tap)", "Hooked, no hook attached", "TransformerLens run_with_cache"):
        assert re.search(re.escape(name) + r"\s+[\d.]+ \([\d.]+ \.\. [\d.]+\)\s+[\d.]+x", text)


def test_bench_patching_checks_both_sweeps_against_transformer_lens(capsys):
    text = run_ok(capsys, "bench", "patching", "--model", "tiny", "--tokens", "5", "--rounds", "1")
    rows = re.findall(r"^(resid_pre|head_out_by_pos)\s+(\d+)\s+(\S+)\s", text, re.M)
    assert [(k, int(n)) for k, n, _ in rows] == [("resid_pre", 20), ("head_out_by_pos", 80)]
    assert all(float(d) <= 1e-5 for _, _, d in rows)


def test_the_command_line_s_lists_are_the_library_s():
    from gptlab.bench.interp import MODELS
    from gptlab.cli import inspect_verbs
    from gptlab.inspect.circuit import DEFAULT_SWEEPS
    from gptlab.inspect.patching import PATCH_KINDS

    assert inspect_verbs.PATCH_SWEEPS == tuple(PATCH_KINDS)
    assert inspect_verbs.DEFAULT_PATCH_SWEEPS == DEFAULT_SWEEPS
    assert inspect_verbs.LENS_BENCH_MODELS == tuple(MODELS)


def test_prompts_of_exactly_the_context_are_patched(run, capsys, tmp_path):
    text = run_ok(capsys, "inspect", "patch", "--run", str(run), "--out", str(tmp_path), "--clean", "e" * 32,
                  "--corrupt", "a" + "e" * 31, "--answer", "e", "--wrong", "a", "--sweep", "mlp_out")
    rows = [line for line in text.split("MLP output of each block")[1].split("\n\n")[1].splitlines()
            if line.startswith("L")]
    assert len(rows) == 2 and all(len(r.split()) == 1 + 32 for r in rows)


def test_a_sweep_the_library_lacks_or_none_is_one_line_listing_them():
    from gptlab.errors import GptlabError
    from gptlab.inspect.circuit import check_sweeps

    with pytest.raises(GptlabError, match=r"^unknown sweep bogus: choose from resid_pre, attn_out, mlp_out, head_out, "
                                          r"head_out_by_pos$"):
        check_sweeps(["resid_pre", "bogus"])
    with pytest.raises(GptlabError, match=r"^unknown sweep \(none\)"):
        check_sweeps([])
    assert check_sweeps(["mlp_out", "resid_pre", "mlp_out"]) == ["mlp_out", "resid_pre"]
