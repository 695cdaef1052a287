"""A real headless Chromium (Debian's `chromium`), driven over the Chrome DevTools Protocol for page tests.

`Browser` starts chromium with a throwaway profile, opens one page target and speaks CDP to it over its websocket
(the `websockets` package's synchronous client): navigate, evaluate JavaScript, click with real mouse events
(`Input.dispatchMouseEvent`), take a screenshot. `browser_or_skip` fails loudly where the browser could be
installed (root with apt-get: `scripts/setup.sh test` installs it) and skips only where it cannot.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


def browser_or_skip() -> str:
    path = chromium_path()
    if path is not None:
        return path
    if shutil.which("apt-get") and os.geteuid() == 0:
        pytest.fail("chromium is missing but installable here: run `scripts/setup.sh test` (it installs Debian's "
                    "chromium), or apt-get install -y chromium")
    pytest.skip("needs Debian's chromium (apt-get install -y chromium), and this machine cannot install it")


class Browser:
    def __init__(self, executable: str, width: int = 1280, height: int = 1000, args: tuple[str, ...] = ()) -> None:
        from websockets.sync.client import connect

        self.profile = tempfile.mkdtemp(prefix="nexttoken-chromium-")
        self.proc = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
             *args, "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=30).__enter__()  # held for the browser's life
        self.next_id = 0
        self.events: list[dict] = []
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method: str, **params: Any) -> dict:
        """One CDP command; its result (events that arrive meanwhile are kept in self.events)."""
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def open(self, url: str) -> None:
        """Navigate and wait until the page's script has run (it sets body[data-ready])."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 30
        while self.eval("document.readyState === 'complete' && document.body && document.body.dataset.ready") != "1":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not finish loading: {self.eval('document.body.innerText')!r}")
            time.sleep(0.05)

    def eval(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click (press and release) at the centre of the element, as a user's."""
        self.eval(f"document.querySelector({json.dumps(selector)}).scrollIntoView({{block: 'center'}})")
        box = self.eval(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect(); "
                        "return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def key(self, name: str) -> None:
        """A real key press and release (e.g. "ArrowRight")."""
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=name, code=name)

    def screenshot(self, path: Path) -> bytes:
        png = base64.b64decode(self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"])
        path.write_bytes(png)
        return png

    def close(self) -> None:
        try:
            if hasattr(self, "ws"):
                self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            shutil.rmtree(self.profile, ignore_errors=True)
