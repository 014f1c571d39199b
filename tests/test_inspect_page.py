"""The interactive attention page in a real headless browser: Debian's chromium driven by Playwright (pip's
Playwright cannot download its own browser here). It renders the grid, a click on a token changes the highlighted
weights to that token's attention row, no request leaves the page, and a screenshot is not blank. Where the
browser or Playwright is missing the tests skip, and the summary line says "browser skipped (...)"."""

import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from PIL import Image

from gptlab.config import ModelConfig
from gptlab.errors import GptlabError
from gptlab.inspect import page
from gptlab.inspect.page import attention_html
from gptlab.inspect.trace import trace
from gptlab.model import GPT

LABELS = ["T", "o", "␣", "b", "e", "↵", "o", "r", "</script>", "s", ">", "!"]  # must not end the script early


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=20, block_size=16, n_layer=2, n_head=3, n_embd=24, dropout=0.0)).eval()
    tr = trace(model, torch.randint(20, (len(LABELS),)).tolist())
    return tr, attention_html(tr, LABELS, tmp_path_factory.mktemp("page") / "attention.html", "To be</script>")


def test_the_page_is_one_file_with_no_address_in_it(written):
    text = written[1].read_text(encoding="utf-8")
    assert not re.search(r"(https?:)?//[a-z]", text.replace("http-equiv", ""))  # nothing to fetch
    assert "<script src" not in text and "<link" not in text
    assert text.count("</script>") == 1 and "To be&lt;/script&gt;" in text


def test_a_page_too_big_is_refused(written, monkeypatch):
    monkeypatch.setattr(page, "MAX_NUMBERS", 100)
    with pytest.raises(GptlabError, match="shorter prompt"):
        attention_html(written[0], LABELS, written[1].with_name("big.html"))
    assert not written[1].with_name("big.html").exists()



@pytest.mark.device_path("browser")
def test_the_page_in_a_headless_browser(written, browser):
    tr, path = written
    ctx = browser.new_context(viewport={"width": 1000, "height": 800})
    requests = []
    ctx.on("request", lambda r: requests.append(r.url))
    view = ctx.new_page()
    errors = []
    view.on("pageerror", lambda e: errors.append(str(e)))
    view.goto(path.as_uri())
    assert view.locator("canvas.map").count() == 3  # the grid: one map per head of the layer
    assert view.locator(".tok").count() == len(LABELS)
    assert view.locator(".tok").nth(8).inner_text() == "</script>"

    def weights():
        return [float(w) for w in view.locator(".tok").evaluate_all("(s) => s.map((x) => x.dataset.w)")]

    view.select_option("#layer", "1")
    view.select_option("#head", "2")
    view.locator(".tok").nth(4).dispatch_event("click")  # a click alone, no hover
    after_4 = weights()
    expected = tr.attention[1][0, 2, 4].tolist()
    assert after_4 == pytest.approx(expected, abs=2e-4) and after_4[5:] == [0.0] * 7
    view.locator(".tok").nth(9).dispatch_event("click")
    after_9 = weights()
    assert after_9 != after_4 and after_9 == pytest.approx(tr.attention[1][0, 2, 9].tolist(), abs=2e-4)
    view.locator(".tok").nth(7).hover()  # hovering shows a token too
    assert weights() == pytest.approx(tr.attention[1][0, 2, 7].tolist(), abs=2e-4)
    view.locator(".tok").nth(9).dispatch_event("click")
    bars = view.locator(".bar").evaluate_all("(s) => s.map((x) => [+x.dataset.i, +x.dataset.head, +x.dataset.w])")
    assert len(bars) == len(LABELS) * 3  # one bar per head under every token: each head of layer 1, from token 9
    for i, head, w in bars:
        assert w == pytest.approx(tr.attention[1][0, head, 9, i].item(), abs=2e-4)
    view.check("input[value=to]")  # which tokens look at token 9
    assert weights() == pytest.approx(tr.attention[1][0, 2, :, 9].tolist(), abs=2e-4)
    shot = Image.open(io.BytesIO(view.screenshot(full_page=True))).convert("RGB")
    ctx.close()
    assert not errors, errors
    assert [u for u in requests if not u.startswith("file:")] == [] and len(requests) == 1  # the page itself
    colours = shot.getcolors(1 << 24)
    assert len(colours) > 50 and max(n for n, _ in colours) < 0.95 * shot.width * shot.height  # not blank


def page_data(text):
    """The page's DATA object, read back as JSON."""
    return json.loads(text.split("const DATA = ", 1)[1].split(";\nconst T = ", 1)[0])


def test_the_page_holds_the_first_rows_causal_attention_and_the_tokens_as_written(tmp_path):
    torch.manual_seed(1)
    model = GPT(ModelConfig(vocab_size=20, block_size=16, n_layer=2, n_head=3, n_embd=24, dropout=0.0)).eval()
    tr = trace(model, torch.randint(20, (2, 4)))  # two rows: the page shows the first
    labels = ["中", "a", "</b>", "é"]
    path = attention_html(tr, labels, tmp_path / "new" / "folder" / "a.html")
    text = path.read_text(encoding="utf-8")
    data = page_data(text)
    assert data["tokens"] == labels and '"tokens":["中","a","<\\/b>","é"],"attention":[[[' in text
    assert len(data["attention"]) == 2 and all(len(layer) == 3 for layer in data["attention"])
    for layer, probs in zip(data["attention"], tr.attention):
        for h, rows in enumerate(layer):
            assert [len(row) for row in rows] == [1, 2, 3, 4]  # row i: keys 0..i
            for i, row in enumerate(rows):
                assert row == [round(v, 4) for v in probs[0, h, i, :i + 1].tolist()]
                assert all(v == round(v, 4) for v in row) and abs(sum(row) - 1) <= 1e-3
    assert "<title>attention: 中a&lt;/b&gt;é</title>" in text and "<h2>attention: 中a&lt;/b&gt;é</h2>" in text
    assert "__TITLE__" not in text and "__DATA__" not in text



def test_the_page_is_utf8_under_a_locale_that_is_not(tmp_path):
    """A machine whose locale encoding is ASCII (or Windows' cp1252) still gets the page, non-ASCII tokens and all,
    as UTF-8, the charset the page declares: the C locale with Python's UTF-8 mode and locale coercion off."""
    script = ("import torch; from gptlab.config import ModelConfig; from gptlab.model import GPT; "
              "from gptlab.inspect.trace import trace; from gptlab.inspect.page import attention_html; "
              "torch.manual_seed(0); "
              "m = GPT(ModelConfig(vocab_size=20, block_size=8, n_layer=1, n_head=1, n_embd=8, dropout=0.0)).eval(); "
              "attention_html(trace(m, [1, 2, 3]), ['\\u4e2d', '\\xe9', 'a'], r'%s')" % (tmp_path / "a.html"))
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    out = subprocess.run([sys.executable, "-X", "utf8=0", "-c", script], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = (tmp_path / "a.html").read_bytes().decode("utf-8")
    assert '"tokens":["\u4e2d","\xe9","a"]' in text and 'charset="utf-8"' in text.lower()

def test_a_pages_default_title_is_the_first_80_characters_of_its_tokens():
    torch.manual_seed(2)
    model = GPT(ModelConfig(vocab_size=20, block_size=100, n_layer=1, n_head=1, n_embd=8, dropout=0.0)).eval()
    tr = trace(model, torch.randint(20, (90,)))
    text = page.attention_page(tr, [str(i % 10) for i in range(90)])
    title = "".join(str(i % 10) for i in range(80))
    assert f"<title>attention: {title}</title>" in text
    assert page.attention_page(tr, ["x"] * 90, "mine").count("attention: mine<") == 2


def test_a_page_of_exactly_the_most_numbers_is_allowed(written, monkeypatch):
    tr = written[0]  # 2 layers × 3 heads × 12 tokens: 6 · 12·13/2 = 468 probabilities
    monkeypatch.setattr(page, "MAX_NUMBERS", 468)
    page.check_page_size(tr)
    monkeypatch.setattr(page, "MAX_NUMBERS", 467)
    with pytest.raises(GptlabError, match="2 layers x 3 heads over 12 tokens are 468 probabilities, too many for "
                                          r"one page \(at most 467\)"):
        page.check_page_size(tr)
