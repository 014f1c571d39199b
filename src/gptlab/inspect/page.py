"""The interactive attention page: one self-contained HTML file (the data, the script and the styles inline; no CDN,
no font, no request of any kind) where clicking or hovering a token shows where each head of the chosen layer looks
from it (or which tokens look at it), beside a grid of the layer's attention maps."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from pathlib import Path

from gptlab.errors import GptlabError
from gptlab.inspect.trace import Trace

MAX_NUMBERS = 8_000_000  # probabilities a page may hold (~50 MB of JSON); beyond it a browser struggles

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy"
 content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>attention: __TITLE__</title>
<style>
body { font-family: sans-serif; margin: 1.5em; color: #222; }
#controls { margin-bottom: 1em; }
#controls label { margin-right: 1.5em; }
#tokens { display: flex; flex-wrap: wrap; font-family: monospace; font-size: 18px; max-width: 70em; }
.cell { display: inline-flex; flex-direction: column; align-items: center; margin: 3px 1px; }
.tok { padding: 2px 3px; border: 1px solid #ccc; border-radius: 3px; cursor: pointer; white-space: pre; }
.heads { display: flex; gap: 1px; margin-top: 2px; }
.bar { width: 5px; height: 10px; border: 1px solid #eee; }
.tok.selected { outline: 2px solid #d62728; }
#grid { display: flex; flex-wrap: wrap; gap: 12px; margin-top: 1.5em; }
#grid figure { margin: 0; text-align: center; font-size: 12px; }
canvas { border: 1px solid #999; image-rendering: pixelated; }
#note { color: #666; font-size: 13px; }
</style></head><body>
<h2>attention: __TITLE__</h2>
<div id="controls">
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
<label><input type="radio" name="dir" value="from" checked> where the token looks</label>
<label><input type="radio" name="dir" value="to"> which tokens look at it</label>
</div>
<div id="note">Click or hover a token. Shading: attention probability (the chosen head, or the mean of the
layer's heads); under each token one bar per head of the layer, in the head's colour, as dark as its weight.
Below: each head of the layer, query rows down, key columns across; the chosen token's row (or column) is marked
in red.</div>
<div id="tokens"></div>
<div id="grid"></div>
<script>
const DATA = __DATA__;
const T = DATA.tokens.length, L = DATA.attention.length, H = DATA.attention[0].length;
let selected = T - 1;
const $ = (id) => document.getElementById(id);
const COLOURS = ["31,119,180", "255,127,14", "44,160,44", "214,39,40", "148,103,189", "140,86,75", "227,119,194",
                 "127,127,127", "188,189,34", "23,190,207"];
for (let l = 0; l < L; l++) $("layer").add(new Option("layer " + l, l));
$("head").add(new Option("all heads (mean)", -1));
for (let h = 0; h < H; h++) $("head").add(new Option("head " + h, h));
// rows hold only the causal part: row i has i + 1 numbers (keys 0..i)
const p = (l, h, i, j) => (j <= i ? DATA.attention[l][h][i][j] : 0);
const dir = () => document.querySelector("input[name=dir]:checked").value;
function weight(l, h, j) {
  const one = (hh) => (dir() === "from" ? p(l, hh, selected, j) : p(l, hh, j, selected));
  if (h >= 0) return one(h);
  let s = 0; for (let hh = 0; hh < H; hh++) s += one(hh); return s / H;
}
DATA.tokens.forEach((text, i) => {
  const cell = document.createElement("span"), span = document.createElement("span");
  cell.className = "cell";
  span.className = "tok"; span.textContent = text; span.dataset.i = i;
  span.title = "position " + i;
  span.addEventListener("click", () => { selected = i; draw(); });
  span.addEventListener("mouseenter", () => { selected = i; draw(); });
  const bars = document.createElement("span");
  bars.className = "heads";
  for (let h = 0; h < H; h++) {
    const bar = document.createElement("span");
    bar.className = "bar"; bar.dataset.i = i; bar.dataset.head = h; bars.appendChild(bar);
  }
  cell.appendChild(span); cell.appendChild(bars);
  $("tokens").appendChild(cell);
});
function drawGrid(l) {
  const grid = $("grid"); grid.innerHTML = "";
  const cell = Math.max(2, Math.min(12, Math.floor(360 / T)));
  for (let h = 0; h < H; h++) {
    const fig = document.createElement("figure"), canvas = document.createElement("canvas");
    canvas.width = canvas.height = cell * T; canvas.className = "map"; canvas.dataset.head = h;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cell * T, cell * T);
    for (let i = 0; i < T; i++) for (let j = 0; j <= i; j++) {
      const v = p(l, h, i, j);
      ctx.fillStyle = "rgba(31, 87, 180," + v + ")"; ctx.fillRect(j * cell, i * cell, cell, cell);
    }
    ctx.strokeStyle = "#d62728"; ctx.lineWidth = 1;
    if (dir() === "from") ctx.strokeRect(0.5, selected * cell + 0.5, cell * T - 1, cell - 1);
    else ctx.strokeRect(selected * cell + 0.5, 0.5, cell - 1, cell * T - 1);
    fig.appendChild(canvas);
    const cap = document.createElement("figcaption"); cap.textContent = "head " + h;
    cap.style.color = "rgb(" + COLOURS[h % COLOURS.length] + ")"; fig.appendChild(cap);
    grid.appendChild(fig);
  }
}
function draw() {
  const l = +$("layer").value, h = +$("head").value;
  document.querySelectorAll(".tok").forEach((span) => {
    const j = +span.dataset.i, w = weight(l, h, j);
    span.dataset.w = w.toFixed(4);
    span.style.background = "rgba(31, 87, 180," + Math.min(1, w) + ")";
    span.style.color = w > 0.5 ? "#fff" : "#222";
    span.classList.toggle("selected", j === selected);
  });
  document.querySelectorAll(".bar").forEach((bar) => {
    const hh = +bar.dataset.head, w = weight(l, hh, +bar.dataset.i);
    bar.dataset.w = w.toFixed(4);
    bar.style.background = "rgba(" + COLOURS[hh % COLOURS.length] + "," + Math.min(1, w) + ")";
  });
  drawGrid(l);
}
$("layer").addEventListener("change", draw);
$("head").addEventListener("change", draw);
document.querySelectorAll("input[name=dir]").forEach((r) => r.addEventListener("change", draw));
draw();
</script></body></html>
"""


def check_page_size(tr: Trace) -> None:
    """GptlabError when the trace's probabilities are too many for one page (a shorter prompt fits)."""
    L, H, T = tr.n_layer, tr.attention[0].size(1), tr.ids.size(1)
    numbers = L * H * T * (T + 1) // 2
    if numbers > MAX_NUMBERS:
        raise GptlabError(f"{L} layers x {H} heads over {T} tokens are {numbers:,} probabilities, too many for one "
                          f"page (at most {MAX_NUMBERS:,}); give a shorter prompt")


def attention_html(tr: Trace, labels: Sequence[str], out: str | Path, title: str = "") -> Path:
    """Write the interactive page for the first row of the trace to `out`; returns the path. Raises GptlabError
    when the probabilities are too many for a page (a shorter prompt fits)."""
    page = attention_page(tr, labels, title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def attention_page(tr: Trace, labels: Sequence[str], title: str = "") -> str:
    """The interactive page for the first row of the trace, as text (`gptlab serve` answers /inspect with it).
    Raises GptlabError when the probabilities are too many for a page."""
    check_page_size(tr)
    H, T = tr.attention[0].size(1), tr.ids.size(1)
    attention = [[[[round(v, 4) for v in probs[0, h, i, :i + 1].tolist()] for i in range(T)] for h in range(H)]
                 for probs in tr.attention]
    data = json.dumps({"tokens": list(labels), "attention": attention}, ensure_ascii=False, separators=(",", ":"))
    values = {"TITLE": html.escape(title or "".join(labels)[:80]),
              "DATA": data.replace("</", "<\\/")}  # no "</script>" inside the script
    return re.sub("__(TITLE|DATA)__", lambda m: values[m.group(1)], _PAGE)  # one pass: inserted text stays as is
