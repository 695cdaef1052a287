"""The explain page in a real headless Chromium (Debian's package, over the DevTools Protocol): load the file,
click a token with real mouse events, check that the chart shows that step's candidates before and after each
processor and its stop decisions; the same page served by the server for a request sent with `trace: true`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

import nexttoken
from support.cdp import Browser, browser_or_skip
from nexttoken.generation.trace.replay import replay
from nexttoken.generation.trace.page import render_page
from nexttoken.pretrained import DEFAULT_MODEL_DIR

openai = pytest.importorskip("openai")

# `NEXTTOKEN_DOCS_SCREENSHOT=docs/tracing.png pytest tests/generation/trace/test_trace_page.py` refreshes the docs' picture.
DOCS_SCREENSHOT = os.environ.get("NEXTTOKEN_DOCS_SCREENSHOT")


@pytest.fixture(scope="module")
def browser():
    b = Browser(browser_or_skip())
    yield b
    b.close()


@pytest.fixture(scope="module")
def trace():
    llm = nexttoken.load()
    trace = llm.generate("Once upon a time", max_new_tokens=16, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                        seed=7, stop_strings=["."], trace=True, trace_top_n=6).trace
    return {**trace, "model": "the packaged default model"}  # the page as the docs show it: no machine path


def _shown(b: Browser) -> dict:
    """What the detail view shows: its step, each card's title and its bars' token ids, the stop table."""
    return b.eval("""(() => ({
        step: document.getElementById('detail').dataset.step,
        cards: [...document.querySelectorAll('#detail .stage')].map(c => ({
            title: c.querySelector('h3').textContent,
            ids: [...c.querySelectorAll('.bar-row')].map(r => +r.dataset.tokenId),
            widths: [...c.querySelectorAll('.bar')].map(x => parseFloat(x.style.width)),
            chosen: [...c.querySelectorAll('.bar-row.chosen')].map(r => +r.dataset.tokenId)})),
        stops: [...document.querySelectorAll('#stops tbody tr')].map(r => [r.cells[0].textContent, r.cells[1].textContent]),
        selected: [...document.querySelectorAll('.tok.sel')].map(t => t.id),
        hash: location.hash}))()""")


def _check_step(shown: dict, trace: dict, i: int) -> None:
    step = trace["steps"][i]
    assert shown["step"] == str(i) and shown["selected"] == [f"tok-{i}"] and shown["hash"] == f"#step={i}"
    expected = [("model (raw)", step["raw"])] + [(f"after {s['name']}", s["top"]) for s in step["stages"]]
    assert [c["title"] for c in shown["cards"]] == [t for t, _ in expected]
    for card, (_, top) in zip(shown["cards"], expected):
        assert card["ids"] == top["ids"]
        assert card["widths"] == pytest.approx([100 * p for p in top["probs"]], abs=0.01)
        assert card["chosen"] == ([step["chosen"]["id"]] if step["chosen"]["id"] in top["ids"] else [])
    assert shown["stops"] == [[d["name"], "stop" if d["stop"] else "no"] for d in step["stop"]]


def test_page_in_chromium_click_a_token(browser, trace, tmp_path) -> None:
    page = tmp_path / "explain.html"
    page.write_text(render_page(trace), encoding="utf-8")
    assert "http" not in page.read_text().replace("http-equiv", "")  # nothing fetched: the page is one file
    n = len(trace["steps"])
    assert n >= 6 and {s["name"] for s in trace["steps"][0]["stages"]} == {"Temperature", "TopK", "TopP"}
    browser.open(page.as_uri())
    _check_step(_shown(browser), trace, 0)  # the first step is selected on load
    strip = browser.eval("[...document.querySelectorAll('#strip .tok')].map(t => t.textContent)")
    assert "".join(strip).startswith(trace["text"])  # each token's text in context (a stop string's cut aside)
    assert strip == [s["text"] or trace["token_texts"][str(s["chosen"]["id"])] for s in trace["steps"]]
    for i in (4, n - 1, 2):
        browser.click(f"#tok-{i}")
        _check_step(_shown(browser), trace, i)
    assert _shown(browser)["stops"][3] == ["stop_strings", "no"]
    browser.click(f"#tok-{n - 1}")
    if trace["stop_reason"] == ".":
        assert ["stop_strings", "stop"] in _shown(browser)["stops"]
    browser.click("#tl-3")  # the latency timeline selects too
    _check_step(_shown(browser), trace, 3)
    browser.key("ArrowRight")
    _check_step(_shown(browser), trace, 4)
    browser.key("ArrowLeft")
    browser.key("ArrowLeft")
    _check_step(_shown(browser), trace, 2)
    browser.eval("document.getElementById('shade').value = 'entropy'; "
                 "document.getElementById('shade').dispatchEvent(new Event('change'))")
    shades = browser.eval("[...document.querySelectorAll('#strip .tok')].map(t => t.style.background)")
    top = max(range(n), key=lambda i: trace["steps"][i]["final"]["entropy"])
    assert shades[top] == "rgba(220, 60, 40, 0.88)"  # the most uncertain step is the darkest
    browser.open(page.as_uri() + "#step=5")  # a link to one step
    _check_step(_shown(browser), trace, 5)
    png = browser.screenshot(tmp_path / "explain.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    if DOCS_SCREENSHOT:
        Path(DOCS_SCREENSHOT).write_bytes(png)


def test_page_shows_token_text_as_text(browser, tmp_path) -> None:
    """A token whose text is markup is shown, never run (the server serves pages of clients' prompts)."""
    step = {"index": 0, "raw": {"ids": [5], "logits": [1.0], "probs": [1.0], "entropy": 0.0}, "stages": [],
            "final": {"ids": [5], "logits": [1.0], "probs": [1.0], "entropy": 0.0},
            "chosen": {"id": 5, "rank": 1, "prob": 1.0, "logit": 1.0, "raw_rank": 1, "raw_prob": 1.0},
            "sampler": {"kind": "Sampler", "greedy": True, "seed": None, "state": None},
            "ms": {"forward": 1.0, "processors": 0.0, "sampling": 0.1, "stop": 0.1},
            "stop": [{"name": "max_tokens", "stop": True, "detail": "1 of 1"}], "text": "<img src=x onerror=alert(1)>",
            "notes": {"speculative": {"drafted": 4, "accepted": 2}}}
    trace = {"version": 1, "prompt_ids": [1], "prompt_text": "</script><b>hi</b>", "options": {}, "top_n": 1,
             "steps": [step], "token_texts": {"5": "<i>x</i>"}, "text": "", "finish_reason": "length",
             "stop_reason": None}
    page = tmp_path / "hostile.html"
    page.write_text(render_page(trace))
    browser.open(page.as_uri())
    assert browser.eval("document.querySelectorAll('#strip img, #strip b, #detail i').length") == 0
    assert browser.eval("document.getElementById('tok-0').textContent") == "<img src=x onerror=alert(1)>"
    assert browser.eval("document.querySelector('#strip .prompt').textContent") == "</script><b>hi</b>"
    rows = browser.eval("[...document.querySelectorAll('#stops tbody tr')].map(r => [...r.cells].map(c => c.textContent))")
    assert rows == [["max_tokens", "stop", "1 of 1"], ["speculative", "note", '{"drafted":4,"accepted":2}']]


# ---- through the server ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    from support.server import start_server, stop_server

    # OpenAI's defaults under the requests' options (the model's own: test_generation_defaults.py)
    proc, url = start_server(Path(DEFAULT_MODEL_DIR), "--generation-config", "vllm")
    yield url
    stop_server(proc)


def test_server_serves_the_page_of_a_traced_request(browser, server) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, seed=3, top_p=0.9,
                                  extra_body={"trace": True, "trace_top_n": 5})
    ref = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, seed=3, top_p=0.9)
    info = r.choices[0].model_extra["trace"]
    assert "trace" not in (ref.choices[0].model_extra or {}) and r.choices[0].text == ref.choices[0].text
    trace = httpx.get(server + info["json_url"]).json()
    assert trace["text"] == r.choices[0].text and len(trace["steps"]) == r.usage.completion_tokens
    assert trace["options"]["seed"] == 3 and [s["name"] for s in trace["steps"][0]["stages"]] == ["TopP"]
    report, _ = replay(trace, nexttoken.load())  # the server's run, again in the library: the same, bit for bit
    assert report.identical, report.summary()
    page = httpx.get(server + info["url"])
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    browser.open(server + info["url"])
    browser.click("#tok-6")
    _check_step(_shown(browser), trace, 6)

    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          stream=True, extra_body={"trace": True})
    chunks = list(chat)
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    streamed = httpx.get(server + last.choices[0].model_extra["trace"]["json_url"]).json()
    assert len(streamed["steps"]) == 4 and streamed["steps"][0]["sampler"]["seed"] is not None

    missing = httpx.get(server + "/v1/traces/trace-nope")
    assert missing.status_code == 404 and "no trace 'trace-nope'" in missing.json()["error"]["message"]
    bad = httpx.post(server + "/v1/completions", json={"model": model, "prompt": "x", "trace_top_n": 0,
                                                       "trace": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "trace_top_n"


def test_the_servers_trace_store_is_bounded() -> None:
    import asyncio

    from nexttoken.server.http.errors import APIError
    from nexttoken.server.api.traces import TraceStore

    store = TraceStore("m", capacity=3, budget_bytes=10_000)
    small = {"steps": [], "padding": "x" * 1000}
    ids = [store.add(small)["id"] for _ in range(4)]
    assert list(store.traces) == ids[1:]  # the count bound
    big = store.add({"steps": [], "padding": "y" * 9_500})["id"]
    assert list(store.traces) == [big] and store.bytes == len(store.traces[big])  # the byte bound keeps the newest
    with pytest.raises(APIError, match="no trace"):
        asyncio.run(store.get(ids[-1]))
    page = asyncio.run(store.get(big + ".json"))
    assert json.loads(page.body)["model"] == "m"
