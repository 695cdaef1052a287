"""The explain page: one self-contained HTML file (inline script and style, nothing fetched) for one trace.

The output is a strip of tokens shaded by the chosen token's probability or by the entropy of its step; clicking
a token (or opening the page at `#step=N`, or the arrow keys) shows that step's candidates before and after each processor as bars,
the draw and each stop decision; a timeline shows every step's forward, processor, sampling and stop times.
Token texts are set as text, never as markup, so a trace served by the server cannot inject script.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .recorder import to_json

# One step's cards, draw and stop rows, in JavaScript: this page inlines it, the server's chat page serves it.
STEP_JS = (Path(__file__).parent / "step.js").read_text(encoding="utf-8")


def render_page(trace: dict[str, Any], title: str = "nexttoken trace") -> str:
    """The page for `trace` (a TraceRecorder.to_dict result, or the JSON of one read back)."""
    data = to_json(trace).replace("</", "<\\/")  # the JSON cannot close its script element
    step = STEP_JS.replace("</", "<\\/")  # nor can the script (it has no "</" today)
    return _PAGE.replace("__STEP__", step).replace("__TITLE__", _escape(title)).replace("__TRACE__", data)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>__TITLE__</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #1d1d1f; background: #fff; }
h1 { font-size: 18px; margin: 0 0 4px; } h2 { font-size: 15px; margin: 18px 0 6px; }
.meta { color: #555; font-size: 12px; white-space: pre-wrap; word-break: break-all; }
#strip { line-height: 2.1; padding: 8px; border: 1px solid #ddd; border-radius: 6px; }
#strip .prompt { color: #777; white-space: pre-wrap; }
.tok { cursor: pointer; padding: 2px 1px; border-radius: 3px; white-space: pre-wrap; border: 1px solid transparent; }
.tok.sel { border-color: #d00; outline: 2px solid #d00; }
.controls { margin: 6px 0; font-size: 12px; }
#detail { display: flex; flex-wrap: wrap; gap: 14px; }
.stage { border: 1px solid #ddd; border-radius: 6px; padding: 8px; width: 300px; }
.stage h3 { font-size: 13px; margin: 0 0 4px; }
.stage .stats { font-size: 11px; color: #555; margin-bottom: 6px; }
.bar-row { display: flex; align-items: center; font-size: 12px; margin: 1px 0; }
.bar-row .label { width: 96px; overflow: hidden; text-overflow: ellipsis; white-space: pre; font-family: monospace; }
.bar-row .track { flex: 1; background: #f1f1f1; height: 14px; position: relative; }
.bar-row .bar { background: #4a7bd0; height: 14px; }
.bar-row.chosen .bar { background: #d04a4a; }
.bar-row .value { width: 58px; text-align: right; font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; font-size: 12px; } td, th { border: 1px solid #ddd; padding: 2px 6px; text-align: left; }
.yes { color: #b00; font-weight: bold; }
#timeline { display: flex; align-items: flex-end; gap: 2px; height: 120px; border-bottom: 1px solid #aaa; }
.tl-step { display: flex; flex-direction: column-reverse; width: 14px; cursor: pointer; }
.tl-step.sel { outline: 2px solid #d00; }
.seg-forward { background: #7a9cd6; } .seg-processors { background: #e0a040; }
.seg-sampling { background: #6bb36b; } .seg-stop { background: #b07ad6; }
.legend span { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 10px; }
</style></head>
<body>
<h1>__TITLE__</h1>
<div class="meta" id="meta"></div>
<div class="controls">shade by <select id="shade"><option value="prob">probability of the chosen token</option>
<option value="entropy">entropy of the step (after the processors)</option></select></div>
<div id="strip"></div>
<h2 id="detail-title">click a token</h2>
<div id="draw" class="meta"></div>
<div id="detail"></div>
<h2>stop decisions</h2>
<table id="stops"><thead><tr><th>condition</th><th>stops?</th><th>detail</th></tr></thead><tbody></tbody></table>
<h2>latency per step (ms)</h2>
<div class="legend"><span class="seg-forward"></span>forward (the batch's)<span class="seg-processors"></span>processors<span class="seg-sampling"></span>sampling<span class="seg-stop"></span>stop checks</div>
<div id="timeline"></div>
<script type="application/json" id="trace-data">__TRACE__</script>
<script>__STEP__</script>
<script>
"use strict";
const trace = JSON.parse(document.getElementById("trace-data").textContent);
const texts = trace.token_texts || {};
const tokText = id => (String(id) in texts) ? texts[String(id)] : "#" + id;
const fmt = (x, d) => (x === null || x === undefined) ? "-" : Number(x).toFixed(d === undefined ? 4 : d);
const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e; };
let selected = -1;

function meta() {
  const opts = JSON.stringify(trace.options || {});
  const lines = ["model: " + (trace.model || "?"), "options: " + opts,
    "steps: " + trace.steps.length + ", finish: " + trace.finish_reason +
    (trace.stop_reason !== null && trace.stop_reason !== undefined ? " (" + trace.stop_reason + ")" : ""),
    "top-N kept per stage: " + trace.top_n];
  document.getElementById("meta").textContent = lines.join("\\n");
}

function shade() {
  const by = document.getElementById("shade").value;
  const maxH = Math.max(1e-9, ...trace.steps.map(s => (s.final && s.final.entropy) || 0));
  trace.steps.forEach((s, i) => {
    const t = document.getElementById("tok-" + i);
    const v = by === "prob" ? 1 - s.chosen.prob : ((s.final.entropy || 0) / maxH);  // 0: certain, 1: unsure
    t.style.background = "rgba(220, 60, 40, " + (0.08 + 0.8 * v).toFixed(3) + ")";
    t.title = "step " + i + ": p=" + fmt(s.chosen.prob) + ", rank " + s.chosen.rank + ", entropy " + fmt(s.final.entropy);
  });
}

function strip() {
  const box = document.getElementById("strip");
  const prompt = (trace.prompt_text !== null && trace.prompt_text !== undefined) ? trace.prompt_text
    : (trace.prompt_ids || []).map(tokText).join("");
  box.appendChild(el("span", "prompt", prompt));
  trace.steps.forEach((s, i) => {
    const shown = (s.text !== undefined && s.text !== null && s.text !== "") ? s.text : tokText(s.chosen.id);
    const t = el("span", "tok", shown);
    t.id = "tok-" + i; t.dataset.step = i;
    t.addEventListener("click", () => select(i));
    box.appendChild(t);
  });
  shade();
}

function select(i) {
  const s = trace.steps[i];
  if (!s) return;
  if (selected >= 0) {
    document.getElementById("tok-" + selected).classList.remove("sel");
    document.getElementById("tl-" + selected).classList.remove("sel");
  }
  selected = i;
  document.getElementById("tok-" + i).classList.add("sel");
  document.getElementById("tl-" + i).classList.add("sel");
  document.getElementById("detail-title").textContent = TraceStep.title(trace, i);
  document.getElementById("draw").textContent = TraceStep.draw(s);
  const detail = document.getElementById("detail");
  detail.replaceChildren(...TraceStep.cards(trace, i));
  detail.dataset.step = i;
  document.querySelector("#stops tbody").replaceChildren(...TraceStep.stopRows(trace, i));
  if (location.hash !== "#step=" + i) history.replaceState(null, "", "#step=" + i);
}

function timeline() {
  const box = document.getElementById("timeline");
  const total = s => ["forward", "processors", "sampling", "stop"].reduce((a, k) => a + ((s.ms || {})[k] || 0), 0);
  const most = Math.max(1e-9, ...trace.steps.map(total));
  trace.steps.forEach((s, i) => {
    const col = el("div", "tl-step");
    col.id = "tl-" + i; col.dataset.step = i;
    col.title = "step " + i + ": " + ["forward", "processors", "sampling", "stop"]
      .map(k => k + " " + fmt((s.ms || {})[k], 3)).join(", ") + " ms";
    ["forward", "processors", "sampling", "stop"].forEach(k => {
      const seg = el("div", "seg-" + k);
      seg.style.height = (110 * ((s.ms || {})[k] || 0) / most).toFixed(2) + "px";
      col.appendChild(seg);
    });
    col.addEventListener("click", () => select(i));
    box.appendChild(col);
  });
}

meta(); strip(); timeline();
document.getElementById("shade").addEventListener("change", shade);
function fromHash() {
  const m = /step=(\\d+)/.exec(location.hash);
  if (trace.steps.length) select(m ? Math.min(+m[1], trace.steps.length - 1) : 0);
}
window.addEventListener("hashchange", fromHash);  // a link to another step of the same page
document.addEventListener("keydown", e => {  // left / right: the previous / next token
  if (e.target.tagName === "SELECT") return;
  if (e.key === "ArrowRight" && selected + 1 < trace.steps.length) select(selected + 1);
  if (e.key === "ArrowLeft" && selected > 0) select(selected - 1);
});
fromHash();
document.body.dataset.ready = "1";
</script>
</body></html>
"""
