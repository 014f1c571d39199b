"""The interactive attention page in a real headless browser: Debian's chromium driven by Playwright (pip's
Playwright cannot download its own browser here). It renders the grid, a click on a token changes the highlighted
weights to that token's attention row, no request leaves the page, and a screenshot is not blank. Where the
browser or Playwright is missing the tests skip, and the summary line says "browser skipped (...)"."""

import io
import re

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
