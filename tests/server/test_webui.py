"""The chat page at `/` in a real headless Chromium (Debian's, over the DevTools Protocol) against a real server
with an API key (the packaged default model): the key prompt, streaming, stop, regenerate, edit-and-resend, the
options reaching the request (read off the browser's own Network events), a JSON Schema answer, a token's trace
against /v1/traces/{id}.json, tool calls, reload, export, model text rendered as text, the keyboard, a phone's
width, and no request anywhere but the server (the browser's proxy is a closed port: only loopback gets out).

`NEXTTOKEN_DOCS_SCREENSHOTS=docs pytest tests/server/test_webui.py` refreshes docs/webui.png and docs/webui_phone.png.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from support.cdp import Browser, browser_or_skip
from support.webui import (answered, chat_bodies, last_answer, page_messages, page_requests, press, set_option,
                           type_and_send, wait_for)
from nexttoken.pretrained import DEFAULT_MODEL_DIR

KEY = "webui-test-key"
DOCS = os.environ.get("NEXTTOKEN_DOCS_SCREENSHOTS")
HOSTILE = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "ok": {"type": "boolean"}},
          "required": ["mood", "ok"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                                            "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server():
    from support.server import start_server, stop_server

    # OpenAI's defaults under the page's options (the model's own: test_generation_defaults.py)
    proc, url = start_server(Path(DEFAULT_MODEL_DIR), "--api-key", KEY, "--tool-call-parser", "hermes",
                             "--generation-config", "vllm")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def page(server):
    """One browser for the module; every request but loopback goes to a closed proxy port (so nothing leaves)."""
    b = Browser(browser_or_skip(), args=("--proxy-server=http://127.0.0.1:9",))
    b.call("Network.enable")
    b.server = server  # type: ignore[attr-defined]
    yield b
    b.close()


# ---- helpers -------------------------------------------------------------------------------------------------------



















def _api(b: Browser, body: dict) -> dict:
    """The same request straight to the API (not streamed): the reference the page's answer must equal."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    r = httpx.post(b.server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _metrics(b: Browser) -> dict[str, float]:
    """The server's Prometheus samples, name{labels} -> value."""
    lines = httpx.get(b.server + "/metrics").text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and not line.startswith("#")}


def _new_chat(b: Browser, **options) -> None:
    b.click("#new-conv")
    wait_for(b, "document.querySelectorAll('#messages .msg').length === 0")
    defaults = {"temperature": "", "seed": "", "max_tokens": "", "structured": "", "structured_value": "", "tools": "",
                "tool_choice": "", "trace": True, "parallel_tool_calls": True}
    for name, value in {**defaults, **options}.items():
        set_option(b, name, value)


# ---- the tests, in order: one browser session, one server ----------------------------------------------------------

def test_the_page_asks_for_the_key_and_loads_from_the_server_alone(page) -> None:
    assert httpx.get(page.server + "/").status_code == 200  # the page itself is open; the API is not
    assert httpx.get(page.server + "/v1/models").status_code == 401
    page.open(page.server + "/")
    wait_for(page, "!document.getElementById('key-dialog').hidden")
    page.eval("document.getElementById('key-input').value = 'wrong'; document.getElementById('key-form').requestSubmit()")
    wait_for(page, "document.getElementById('key-error').textContent.includes('refused this key')")
    page.eval(f"document.getElementById('key-input').value = {json.dumps(KEY)}; document.getElementById('key-form').requestSubmit()")
    wait_for(page, "document.body.dataset.model === 'default_model'")
    assert page.eval("document.getElementById('key-dialog').hidden") is True
    urls = [r["url"] for r in page_requests(page)]
    assert {u.removeprefix(page.server) for u in urls} == {"/", "/webui/style.css", "/webui/markdown.js", "/webui/app.js",
                                                           "/webui/trace-step.js", "/webui/client.js", "/v1/models"}
    headers = httpx.get(page.server + "/").headers
    assert "default-src 'none'" in headers["content-security-policy"]


def test_send_streams_with_enter_and_shift_enter(page) -> None:
    set_option(page, "max_tokens", 100)  # the model's context is 512 tokens: room for the next turns
    page.eval("document.getElementById('input').focus()")
    page.call("Input.insertText", text="Tell me a story")
    press(page, "Enter", shift=True)  # a new line, nothing sent
    page.call("Input.insertText", text="about a cat.")
    assert page.eval("document.getElementById('input').value") == "Tell me a story\nabout a cat."
    assert chat_bodies(page) == []
    # Watch the answer grow: each repaint of the streaming message records how much text it shows.
    page.eval("""window.__partial = []; new MutationObserver(() => {
        const m = document.querySelector('.msg.assistant[data-state="streaming"] .content');
        if (m) window.__partial.push(m.textContent.length); }).observe(document.getElementById('messages'),
        {childList: true, subtree: true});""")
    answered(page, lambda: press(page, "Enter"))
    assert page.eval("document.getElementById('input').value") == ""
    (body,) = chat_bodies(page)
    assert body["messages"] == [{"role": "user", "content": "Tell me a story\nabout a cat."}]
    assert body["stream"] is True and body["trace"] is True and body["model"] == "default_model"
    assert body["max_tokens"] == 100 and body["stream_options"] == {"include_usage": True}
    partial = [n for n in page.eval("window.__partial") if n > 0]
    final = page_messages(page)[-1]
    assert final["state"] == "done" and final["content"] and final["deltas"] > 3
    assert len(set(partial)) >= 3 and max(partial) <= len(final["content"].strip()) + 1  # it grew, chunk by chunk
    stats = page.eval(f"document.querySelector('{last_answer(page)} .stats').textContent")
    assert f"{final['stats']['tokens']} tokens" in stats and "tokens/s" in stats and "first token" in stats
    assert f"finish: {final['finish_reason']}" in stats and final["finish_reason"] in ("stop", "length")


def test_options_reach_the_request_and_the_answer_is_the_apis(page) -> None:
    set_option(page, "temperature", 0.7)
    set_option(page, "seed", 42)
    set_option(page, "max_tokens", 30)
    set_option(page, "top_k", 40)
    set_option(page, "stop", "zzz\nqqq")
    set_option(page, "system", "You tell short stories.")
    type_and_send(page, "Tell me about a dog.")
    body = chat_bodies(page)[-1]
    assert (body["temperature"], body["seed"], body["max_tokens"], body["top_k"], body["stop"]) == (0.7, 42, 30, 40, ["zzz", "qqq"])
    assert body["messages"][0] == {"role": "system", "content": "You tell short stories."}
    assert body["messages"][-1] == {"role": "user", "content": "Tell me about a dog."} and len(body["messages"]) == 4
    shown = page_messages(page)[-1]
    assert shown["content"] == _api(page, body)["message"]["content"]  # the seed went through: the same draw


def test_regenerate_asks_again_without_the_old_answer(page) -> None:
    before = page_messages(page)
    answered(page, lambda: page.click(f"{last_answer(page)} .regenerate"))
    first, again = chat_bodies(page)[-2:]
    assert again == first  # the same conversation (the old answer is not sent), the same options
    after = page_messages(page)
    assert len(after) == len(before) and after[-1]["content"] == before[-1]["content"]  # seed 42: the same answer
    set_option(page, "seed", 43)
    answered(page, lambda: page.click(f"{last_answer(page)} .regenerate"))
    body = chat_bodies(page)[-1]
    assert body["seed"] == 43 and page_messages(page)[-1]["content"] == _api(page, body)["message"]["content"]


def test_copy_puts_the_message_on_the_clipboard(page) -> None:
    page.call("Browser.grantPermissions", origin=page.server, permissions=["clipboardReadWrite", "clipboardSanitizedWrite"])
    page.click(f"{last_answer(page)} .actions .copy")
    wait_for(page, f"document.querySelector('{last_answer(page)} .actions .copy').textContent === 'copied'")
    read = page.call("Runtime.evaluate", expression="navigator.clipboard.readText()", awaitPromise=True, returnByValue=True)
    assert read["result"]["value"] == page_messages(page)[-1]["content"]


def test_edit_and_resend_a_user_message(page) -> None:
    page.click(".msg.user[data-index='2'] .edit")
    page.eval("document.querySelector('.msg.user[data-index=\"2\"] .edit-box').value = 'Tell me about a bird.'")
    answered(page, lambda: page.click(".msg.user[data-index='2'] .save-send"))
    body = chat_bodies(page)[-1]
    assert [m["content"] for m in body["messages"]][1:] == [
        "Tell me a story\nabout a cat.", page_messages(page)[1]["content"], "Tell me about a bird."]
    msgs = page_messages(page)
    assert len(msgs) == 4 and msgs[2]["content"] == "Tell me about a bird."
    assert msgs[3]["content"] == _api(page, body)["message"]["content"]


def test_why_this_token_opens_the_trace_inline(page) -> None:
    msg = page_messages(page)[-1]
    trace = httpx.get(page.server + msg["trace"]["json_url"], headers={"Authorization": f"Bearer {KEY}"}).json()
    page.click(f"{last_answer(page)} .why-toggle")
    wait_for(page, f"document.querySelectorAll('{last_answer(page)} .why .tok').length > 0")
    strip = page.eval(f"[...document.querySelectorAll('{last_answer(page)} .why .tok')].map(t => t.textContent)")
    assert strip == [s["text"] or trace["token_texts"][str(s["chosen"]["id"])] for s in trace["steps"]]
    assert "".join(strip).startswith(msg["content"]) and len(strip) == msg["stats"]["tokens"]
    for i in (0, len(strip) // 2, len(strip) - 1):
        page.click(f"{last_answer(page)} .why .tok[data-step='{i}']")
        shown = page.eval(f"""(() => {{ const d = document.querySelector('{last_answer(page)} .why .detail');
            return {{step: d.dataset.step, title: d.querySelector('.step-title').textContent,
              cards: [...d.querySelectorAll('.stage')].map(c => ({{title: c.querySelector('h3').textContent,
                ids: [...c.querySelectorAll('.bar-row')].map(r => +r.dataset.tokenId),
                widths: [...c.querySelectorAll('.bar')].map(x => parseFloat(x.style.width)),
                chosen: [...c.querySelectorAll('.bar-row.chosen')].map(r => +r.dataset.tokenId)}})),
              stops: [...d.querySelectorAll('.stops tr')].slice(1).map(r => [r.cells[0].textContent, r.cells[1].textContent]),
              draw: d.querySelector('.draw').textContent}}; }})()""")
        step = trace["steps"][i]
        assert shown["step"] == str(i) and f"(id {step['chosen']['id']}, rank {step['chosen']['rank']}" in shown["title"]
        expected = [("model (raw)", step["raw"])] + [(f"after {s['name']}", s["top"]) for s in step["stages"]]
        assert [c["title"] for c in shown["cards"]] == [t for t, _ in expected] == \
            ["model (raw)", "after Temperature", "after TopK"]  # temperature 0.7 and top_k 40, in that order
        for card, (_, top) in zip(shown["cards"], expected):
            assert card["ids"] == top["ids"]
            assert card["widths"] == pytest.approx([100 * p for p in top["probs"]], abs=0.01)
            assert card["chosen"] == ([step["chosen"]["id"]] if step["chosen"]["id"] in top["ids"] else [])
        assert shown["stops"] == [[d["name"], "stop" if d["stop"] else "no"] for d in step["stop"]]
        assert f"seed {step['sampler']['seed']}" in shown["draw"] and "(a draw)" in shown["draw"]
    if DOCS:
        page.click(f"{last_answer(page)} .why .tok[data-step='3']")
        page.eval("document.querySelector('#messages .msg:nth-last-child(2)').scrollIntoView({block: 'start'})")
        page.screenshot(Path(DOCS) / "webui.png")


def test_errors_are_shown_and_the_page_goes_on(page) -> None:
    """A bad option is caught before sending (the options panel says why); one the server refuses comes back in
    the API's own error body, shown on the answer; the next message works."""
    _new_chat(page, structured="json_schema", structured_value="{not json")
    page.eval("document.getElementById('input').focus()")
    page.call("Input.insertText", text="Hi")
    sent = len(chat_bodies(page))
    press(page, "Enter")
    wait_for(page, "!document.getElementById('options-error').hidden")
    assert "the JSON Schema is not valid JSON" in page.eval("document.getElementById('options-error').textContent")
    assert len(chat_bodies(page)) == sent and page.eval("document.querySelectorAll('#messages .msg').length") == 0
    assert page.eval("document.getElementById('input').value") == "Hi"  # kept, to send once the options are right
    set_option(page, "structured", "")
    set_option(page, "top_p", 5)
    page.eval("document.getElementById('input').value = ''")
    type_and_send(page, "Hi")
    msg = page_messages(page)[-1]
    assert msg["state"] == "error" and "top_p" in msg["error"]
    assert "top_p" in page.eval(f"document.querySelector('{last_answer(page)} .error').textContent")
    set_option(page, "top_p", "")
    answered(page, lambda: page.click(f"{last_answer(page)} .regenerate"))
    assert page_messages(page)[-1]["state"] == "done" and "top_p" not in chat_bodies(page)[-1]


def test_reasoning_is_shown_folded_above_the_answer(page) -> None:
    """A stored answer with reasoning (what a reasoning model's `reasoning_content` deltas build) shows it in a
    closed fold before the answer."""
    page.eval("""(() => { const s = JSON.parse(localStorage.getItem('nexttoken.webui.conversations'));
        s.conversations.find(c => c.id === s.current).messages.push({role: 'assistant', state: 'done',
          reasoning: 'First, <think> about it.', content: 'The answer.', finish_reason: 'stop'});
        localStorage.setItem('nexttoken.webui.conversations', JSON.stringify(s)); })()""")
    page.open(page.server + "/")
    fold = page.eval(f"""(() => {{ const m = document.querySelector('{last_answer(page)}'); const f = m.querySelector('details.reasoning');
        return {{open: f.open, summary: f.querySelector('summary').textContent, text: f.querySelector('.reasoning-text').textContent,
                 before: !!(f.compareDocumentPosition(m.querySelector('.content')) & Node.DOCUMENT_POSITION_FOLLOWING)}}; }})()""")
    assert fold == {"open": False, "summary": "reasoning", "text": "First, <think> about it.", "before": True}
    page.click(f"{last_answer(page)} .reasoning summary")
    assert page.eval(f"document.querySelector('{last_answer(page)} details.reasoning').open") is True


def test_stop_mid_answer_with_escape(page) -> None:
    # Letters one at a time (200 of them, 200-400 tokens): long enough to stop mid-way on a fast machine too.
    _new_chat(page, structured="regex", structured_value="([a-z] ){200}", max_tokens=480, trace=False)
    page.eval("document.getElementById('input').focus()")
    page.call("Input.insertText", text="Write a long line.")
    generated = _metrics(page)["nexttoken_generation_tokens_total"]
    press(page, "Enter")
    wait_for(page, "(document.querySelector('.msg.assistant[data-state=\"streaming\"] .content') || {}).textContent")
    press(page, "Escape")
    wait_for(page, "document.body.dataset.running === ''")
    body, msg = chat_bodies(page)[-1], page_messages(page)[-1]
    assert body["structured_outputs"] == {"regex": "([a-z] ){200}"} and "trace" not in body
    assert msg["state"] == "stopped" and msg["finish_reason"] == "stopped" and 0 < len(msg["content"]) < 400
    assert "finish: stopped" in page.eval(f"document.querySelector('{last_answer(page)} .stats').textContent")
    deadline = time.monotonic() + 30  # the server saw the client leave: the request was aborted, its slot freed
    while (metrics := _metrics(page)).get('nexttoken_requests_finished_total{finish_reason="abort"}') != 1.0 \
            or metrics["nexttoken_num_requests_running"] != 0.0:
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)
    assert metrics["nexttoken_generation_tokens_total"] - generated < 200


def test_a_json_schema_answer_parses(page) -> None:
    _new_chat(page, structured="json_schema", structured_value=json.dumps(SCHEMA), max_tokens=60, seed=1)
    type_and_send(page, "How do you feel?")
    body, msg = chat_bodies(page)[-1], page_messages(page)[-1]
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)
    assert msg["finish_reason"] == "stop"


def test_tool_calls_are_shown_with_their_arguments(page) -> None:
    _new_chat(page, tools=json.dumps(WEATHER), tool_choice="required", parallel_tool_calls=False, max_tokens=80, seed=3)
    type_and_send(page, "What is the weather in Paris?")
    body, msg = chat_bodies(page)[-1], page_messages(page)[-1]
    assert body["tools"] == WEATHER and body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    calls = msg["tool_calls"]
    assert len(calls) == 1
    args = [json.loads(c["function"]["arguments"]) for c in calls]
    assert calls and {c["function"]["name"] for c in calls} == {"get_weather"} and msg["finish_reason"] == "tool_calls"
    assert all(set(a) == {"city"} for a in args)
    shown = page.eval(f"""[...document.querySelectorAll('{last_answer(page)} .tool-call')].map(c =>
        [c.querySelector('.call-name').textContent, c.querySelector('.call-args').textContent])""")
    assert [name for name, _ in shown] == ["get_weather(...)"] * len(calls)
    assert [json.loads(text) for _, text in shown] == args
    reference = _api(page, body)["message"]["tool_calls"]  # seed 3: the API's own calls
    assert [json.loads(c["function"]["arguments"]) for c in reference] == args


def test_model_text_is_shown_as_text_never_run(page) -> None:
    """The model's answer is forced (structured `choice`) to be markup; the page shows it, runs nothing, and
    fetches nothing for it (an <img src=x> would be a request to the server)."""
    _new_chat(page, structured="choice", structured_value=HOSTILE, max_tokens=100)
    type_and_send(page, "<b>bold?</b> <img src=y onerror=\"window.pwned = 3\">")
    msg = page_messages(page)[-1]
    assert msg["content"] == HOSTILE
    assert page.eval(f"document.querySelector('{last_answer(page)} .content').textContent") == HOSTILE
    assert page.eval("document.querySelector('.msg.user .content').textContent") == \
        "<b>bold?</b> <img src=y onerror=\"window.pwned = 3\">"
    # Markdown still renders, from an edited answer: code blocks keep markup as text.
    page.click(f"{last_answer(page)} .edit")
    page.eval(f"""document.querySelector('{last_answer(page)} .edit-box').value =
        '**bold** and `code`\\n\\n```html\\n<script>window.pwned = 4</script>\\n```\\n- one\\n- [two](javascript:alert(1))';""")
    page.click(f"{last_answer(page)} .save-send")
    rendered = page.eval(f"""(() => {{ const c = document.querySelector('{last_answer(page)} .content');
        return {{strong: c.querySelector('strong').textContent, code: c.querySelector('p code').textContent,
                pre: c.querySelector('pre code').textContent, items: [...c.querySelectorAll('li')].map(l => l.textContent),
                links: c.querySelectorAll('a').length}}; }})()""")
    assert rendered == {"strong": "bold", "code": "code", "pre": "<script>window.pwned = 4</script>",
                        "items": ["one", "[two](javascript:alert(1))"], "links": 0}
    assert page.eval("document.querySelectorAll('#messages script, #messages img, #messages b').length") == 0
    assert page.eval("window.pwned === undefined") is True
    assert not [r for r in page_requests(page) if r["url"].endswith(("/x", "/y"))]


MARKDOWN = [  # text -> the nodes the page builds for it (read back as HTML here; the page never writes HTML)
    ("**bold** *em* _em_ `a<b>` ``x`y``",
     "<p><strong>bold</strong> <em>em</em> <em>em</em> <code>a&lt;b&gt;</code> <code>x`y</code></p>"),
    ("```py\nif a < b:\n    print('<i>')\n```",
     ("""<pre class="code" data-lang="py"><code class="language-py">if a &lt; b:\n    print('&lt;i&gt;')</code>"""
      """<button class="copy-code" type="button">copy</button></pre>""")),
    ("```\nstill streaming",
     '<pre class="code"><code>still streaming</code><button class="copy-code" type="button">copy</button></pre>'),
    ("- a\n- **b**\n\n3. x\n4. y", '<ul><li>a</li><li><strong>b</strong></li></ul><ol start="3"><li>x</li><li>y</li></ol>'),
    ("# T\n> q\n---\nline one\nline two", "<h3>T</h3><blockquote>q</blockquote><hr><p>line one<br>line two</p>"),
    ("[ok](https://example.com/a) [no](javascript:alert(1)) <a href=x>",
     ('<p><a href="https://example.com/a" rel="noopener noreferrer nofollow" target="_blank">ok</a> '
      "[no](javascript:alert(1)) &lt;a href=x&gt;</p>")),
]


def test_markdown_renderer(page) -> None:
    for text, html in MARKDOWN:
        built = page.eval(f"(() => {{ const d = document.createElement('div'); "
                          f"d.appendChild(Markdown.render({json.dumps(text)})); return d.innerHTML; }})()")
        assert built == html, text


def test_reload_keeps_the_conversations_and_their_options(page) -> None:
    before = page_messages(page)
    titles = page.eval("[...document.querySelectorAll('#conv-list .open')].map(b => b.textContent)")
    fields = "[...document.querySelectorAll('#options textarea, #options input, #options select')].map(e => e.type === 'checkbox' ? e.checked : e.value)"
    options = page.eval(fields)
    page.open(page.server + "/")
    wait_for(page, "document.body.dataset.model === 'default_model'")  # the key was kept: no prompt this time
    assert page.eval("document.getElementById('key-dialog').hidden") is True
    assert page_messages(page) == before and len(titles) == 6
    assert page.eval("[...document.querySelectorAll('#conv-list .open')].map(b => b.textContent)") == titles
    assert page.eval(fields) == options
    shown = page.eval("[...document.querySelectorAll('#messages .msg')].map(m => m.querySelector('.content').textContent)")
    assert shown[0] == before[0]["content"] and len(shown) == len(before)
    page.click(f"#conv-list li:nth-child({titles.index('Tell me a story about a cat.') + 1}) .open")  # the first one, its options
    wait_for(page, "document.getElementById('opt-seed').value === '43'")
    assert page.eval("document.getElementById('opt-temperature').value") == "0.7"
    assert page.eval("document.querySelectorAll('#messages .msg').length") == 4


def test_export_downloads_the_conversation(page, tmp_path) -> None:
    page.call("Page.setDownloadBehavior", behavior="allow", downloadPath=str(tmp_path))
    page.click("#export")
    deadline = time.monotonic() + 10
    while not (files := [p for p in tmp_path.glob("*.json")]) and time.monotonic() < deadline:
        time.sleep(0.05)
    (file,) = files
    exported = json.loads(file.read_text())
    assert exported["messages"] == page_messages(page) and exported["model"] == "default_model"
    assert exported["options"]["seed"] == "43"


def test_phone_width(page) -> None:
    page.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=2, mobile=True)
    try:
        page.open(page.server + "/")
        wait_for(page, "document.body.dataset.model === 'default_model'")
        assert page.eval("document.documentElement.scrollWidth") <= 390  # nothing wider than the screen
        assert page.eval("getComputedStyle(document.getElementById('options')).display") == "none"
        composer = page.eval("(() => { const r = document.getElementById('composer').getBoundingClientRect(); "
                             "return [r.left, r.right, r.bottom]; })()")
        assert composer[0] >= 0 and composer[1] <= 390 and composer[2] <= 844
        page.click("#toggle-options")
        box = page.eval("(() => { const r = document.getElementById('options').getBoundingClientRect(); return [r.left, r.right]; })()")
        assert box[0] >= 0 and box[1] <= 390
        page.click("#toggle-options")
        assert page.eval("getComputedStyle(document.getElementById('options')).display") == "none"
        page.click(f"{last_answer(page)} .why-toggle")  # the tokens and a step's cards fit too
        wait_for(page, f"document.querySelectorAll('{last_answer(page)} .why .tok').length > 0")
        page.click(f"{last_answer(page)} .why .tok[data-step='2']")
        assert page.eval("document.documentElement.scrollWidth") <= 390
        if DOCS:
            page.eval("document.querySelector('#messages .msg:nth-last-child(2)').scrollIntoView({block: 'start'})")
            page.screenshot(Path(DOCS) / "webui_phone.png")
    finally:
        page.call("Emulation.clearDeviceMetricsOverride")


def test_nothing_was_fetched_but_the_server_and_no_script_failed(page) -> None:
    others = [r["url"] for r in page_requests(page) if not r["url"].startswith((page.server + "/", "blob:", "data:"))]
    assert others == []
    failed = [e["params"] for e in page.events if e.get("method") == "Network.loadingFailed"
              and e["params"].get("errorText") != "net::ERR_ABORTED"]  # the stopped stream is the one abort
    assert failed == []
    thrown = [e["params"]["exceptionDetails"] for e in page.events if e.get("method") == "Runtime.exceptionThrown"]
    assert thrown == []  # and the page's script never failed


def test_no_webui_turns_the_page_off() -> None:
    """`serve --no-webui` sets the setting that leaves the routes out: `/` and its files are then 404s in the API's
    error body, and the API is unchanged (the app in-process: no second server to start)."""
    from fastapi.testclient import TestClient

    from nexttoken.cli import build_parser
    from nexttoken.engine import EngineConfig, LLMEngine
    from nexttoken.pretrained import load_pretrained
    from nexttoken.server.app import build_app
    from nexttoken.server.settings import ServerSettings

    assert build_parser().parse_args(["serve", "--no-webui"]).webui is False
    assert build_parser().parse_args(["serve"]).webui is True
    loaded = load_pretrained(None)
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(), loaded.generation_config)
    off = TestClient(build_app(engine, ServerSettings("m", webui=False)), base_url="http://127.0.0.1")
    r = off.get("/")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert off.get("/webui/app.js").status_code == 404
    on = TestClient(build_app(engine, ServerSettings("m")), base_url="http://127.0.0.1")
    for path, kind in (("/", "text/html"), ("/webui/app.js", "text/javascript"), ("/webui/style.css", "text/css")):
        r = on.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert r.headers["content-security-policy"].startswith("default-src 'none'; script-src 'self'")
