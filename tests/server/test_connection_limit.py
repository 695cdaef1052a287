"""The connection limit (server/http/connections.py) on a real uvicorn server on loopback, with the protocol class
`nexttoken serve` uses: clients that send headers and one byte of body cannot lock everyone out (the stalled ones
make room), and when every connection holds a whole request the newcomer gets the documented 503 in OpenAI's error
body with Retry-After, not a reset. The app is a stand-in that answers after a delay: the limit is under test."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from nexttoken.server.http.connections import protocol
from support.server import free_port

LIMIT = 4


async def slow_app(scope, receive, send) -> None:  # noqa: ANN001 - an ASGI app that answers after 2 s
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(2.0 if scope["path"] == "/slow" else 0.0)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture()
def url():
    port = free_port()
    config = uvicorn.Config(slow_app, host="127.0.0.1", port=port, http=protocol(30.0, LIMIT), log_level="error",
                            lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _stalled_body(url: str) -> socket.socket:
    """A connection that sends a request's headers and one byte of its 100-byte body, then nothing."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
    return s


def test_stalled_bodies_make_room_for_a_prompt_client(url) -> None:
    held = [_stalled_body(url) for _ in range(LIMIT + 3)]
    time.sleep(0.5)
    try:
        for _ in range(3):  # each newcomer closes the longest-stalled one and is answered at once
            start = time.monotonic()
            r = httpx.get(url + "/fast", timeout=10)
            assert r.status_code == 200 and r.text == "ok" and time.monotonic() - start < 5
    finally:
        for s in held:
            s.close()


def test_a_newcomer_past_busy_connections_gets_503_with_retry_after(url) -> None:
    busy = [threading.Thread(target=httpx.get, args=(url + "/slow",), kwargs={"timeout": 10}) for _ in range(LIMIT)]
    for t in busy:
        t.start()
    time.sleep(0.5)  # every connection now holds a whole request the app works on for 2 s
    r = httpx.post(url + "/fast", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "--max-connections" in error["message"]
    for t in busy:
        t.join(10)
    assert httpx.get(url + "/fast", timeout=10).status_code == 200  # served again once they finish
