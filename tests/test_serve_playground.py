"""The playground page of `gptlab serve` in a real headless browser (Debian's chromium driven by Playwright): it
loads, streams a completion into the page, shows each token's probability and alternatives on hover, opens the
attention view of the text, asks nothing of any address but the server's, and a screenshot is not blank. Where
the browser or Playwright is missing the tests skip ("browser skipped (...)" in the summary line)."""

import io
import re
import time
from importlib import resources

import pytest
from helpers import tiny_run
from PIL import Image

from gptlab.serve.api import Limits
from gptlab.serve.app import make_app
from gptlab.serve.server import load_served, start_server

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "64", "--batch-size", "4",
        "--eval-interval", "10", "--eval-batches", "2", "--log-interval", "10", "--precision", "fp32", "--quiet"]


def test_the_page_is_one_file_with_no_address_in_it():
    text = resources.files("gptlab.serve").joinpath("playground.html").read_text(encoding="utf-8")
    assert not re.search(r"(https?:)?//[a-z]", text.replace("http-equiv", ""))  # nothing to fetch elsewhere
    assert "<script src" not in text and "<link" not in text and text.count("</script>") == 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):

    run = tiny_run(tmp_path_factory.mktemp("playground"), 10, TINY)
    running = start_server(make_app(load_served(run, "fp32", "cpu"), Limits()))
    yield running
    running.stop()


@pytest.mark.device_path("browser")
def test_the_playground_streams_colours_tokens_and_opens_the_attention_view(server, browser):
    ctx = browser.new_context(viewport={"width": 1100, "height": 800})
    requests, errors = [], []
    ctx.on("request", lambda r: requests.append(r.url))
    view = ctx.new_page()
    view.on("pageerror", lambda e: errors.append(str(e)))
    view.goto(server.url + "/")
    assert view.locator("#model").inner_text() == "run"
    view.fill("#prompt", "All:")
    view.fill("#max_tokens", "40")
    view.fill("#seed", "3")
    view.click("#go")
    # polled from here: the page's Content-Security-Policy forbids the eval behind wait_for_function's polling
    deadline = time.monotonic() + 30
    while not view.locator("#status").inner_text().startswith("done"):
        assert time.monotonic() < deadline, view.locator("#status").inner_text()
        time.sleep(0.05)
    tokens = view.locator("#out .tok")
    assert tokens.count() >= 30  # one span per streamed chunk (a char model: one token each)
    probs = [float(p) for p in tokens.evaluate_all("(s) => s.map((x) => x.dataset.p)")]
    assert all(0 < p <= 1 for p in probs)
    assert view.locator("#status").inner_text() == "done: length, 40 tokens"
    tokens.nth(2).hover()
    tip = view.locator("#tip")
    assert tip.is_visible() and "%" in tip.inner_text() and len(tip.inner_text().splitlines()) == 6  # it + top 5
    with ctx.expect_page() as popup:
        view.click("#attn")
    attention = popup.value
    attention.wait_for_load_state()
    assert attention.locator("canvas.map").count() == 2  # one map per head of the first layer
    assert attention.locator(".tok").count() == 44  # "All:" and the 40 generated characters
    shot = Image.open(io.BytesIO(view.screenshot(full_page=True))).convert("RGB")
    ctx.close()
    assert not errors, errors
    assert requests and all(u.startswith((server.url + "/", "about:")) for u in requests), requests
    colours = shot.getcolors(1 << 24)
    assert len(colours) > 50 and max(n for n, _ in colours) < 0.95 * shot.width * shot.height  # not blank
