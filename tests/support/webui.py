"""Driving the chat page in a real browser as a user does (support/cdp.py's Browser): waiting, typing, pressing
keys, the options panel, and what the page sent (no tests here)."""

from __future__ import annotations

import json
import time

from support.cdp import Browser

def wait_for(b: Browser, expression: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := b.eval(expression)):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {expression}: {b.eval('document.body.innerText')[-2000:]!r}")
        time.sleep(0.02)
    return value


def page_requests(b: Browser) -> list[dict]:
    """Every request the page has sent so far (the browser's own Network.requestWillBeSent events)."""
    b.eval("1")  # collects the events that arrived meanwhile
    return [e["params"]["request"] for e in b.events if e.get("method") == "Network.requestWillBeSent"]


def chat_bodies(b: Browser) -> list[dict]:
    return [json.loads(r["postData"]) for r in page_requests(b) if r["url"].endswith("/v1/chat/completions")]


def set_option(b: Browser, name: str, value) -> None:
    """Set a field of the options panel as a user does (its input / change event)."""
    b.eval(f"""(() => {{ const e = document.getElementById('opt-' + {json.dumps(name)});
        if (e.type === 'checkbox') e.checked = {json.dumps(bool(value))}; else e.value = {json.dumps(str(value))};
        e.dispatchEvent(new Event(e.tagName === 'SELECT' || e.type === 'checkbox' ? 'change' : 'input')); }})()""")


def press(b: Browser, key: str, shift: bool = False) -> None:
    """A real key press; Enter carries its text, so the textarea's default (a new line) applies when not prevented."""
    extra = {"windowsVirtualKeyCode": 13, "text": "\r"} if key == "Enter" else {"windowsVirtualKeyCode": 27} if key == "Escape" else {}
    b.call("Input.dispatchKeyEvent", type="keyDown", key=key, code=key, modifiers=8 if shift else 0, **extra)
    b.call("Input.dispatchKeyEvent", type="keyUp", key=key, code=key, modifiers=8 if shift else 0)


def answered(b: Browser, action) -> None:
    """Do `action` (a send, a regenerate ...) and wait until its answer has ended (the page counts them)."""
    before = int(b.eval("document.body.dataset.answers || 0"))
    action()
    wait_for(b, f"+(document.body.dataset.answers || 0) > {before}")


def type_and_send(b: Browser, text: str) -> None:
    b.eval("document.getElementById('input').focus()")
    b.call("Input.insertText", text=text)
    answered(b, lambda: press(b, "Enter"))


def page_messages(b: Browser) -> list[dict]:
    """The current conversation as the page keeps it (its localStorage)."""
    return b.eval("""(() => { const s = JSON.parse(localStorage.getItem('nexttoken.webui.conversations'));
        return s.conversations.find(c => c.id === s.current).messages; })()""")


def last_answer(b: Browser) -> str:
    return ".msg.assistant:last-child"
