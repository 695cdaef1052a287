"""ASGI guards in front of the app: a request-body size and time limit (413, 408) and the optional API key (401)."""

from __future__ import annotations

import asyncio
import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body

_PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # /health and /metrics stay open for probes and scrapers


async def _send_error(send: Send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class BodyLimit:
    """Read the whole body first (refusing more than max_bytes with 413, and a body not sent within timeout_s
    with 408, so a slow or stalled client cannot hold a connection), then replay it to the app.

    After the replay, `receive` is the server's own again, so the app still hears `http.disconnect`.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                message = f"the request body did not arrive within {self.timeout_s:g} s"
                return await _send_error(send, 408, error_body(message, "invalid_request_error", None, "timeout"))
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        message = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        await _send_error(send, 413, error_body(message, "invalid_request_error", None, "request_too_large"))


class ApiKeyGuard:
    """With an API key set, API paths need `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key and scope["type"] == "http" and scope["path"].startswith(_PROTECTED):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            scheme, _, key = auth.strip().partition(" ")
            # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
                body = error_body("invalid or missing API key: send Authorization: Bearer <key>",
                                  "invalid_request_error", None, "invalid_api_key")
                return await _send_error(send, 401, body)
        await self.app(scope, receive, send)
