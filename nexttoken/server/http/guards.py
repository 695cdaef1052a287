"""ASGI guards in front of the app: unexpected errors as OpenAI's 500 body, the optional API key (401, checked before
the body is read), the Host header (421: DNS rebinding), JSON bodies only (415: a web page's form or text/plain
post), and a request-body size and time limit (413, 408, 503 at shutdown)."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import OLLAMA_PATHS, error_body_for
from .shutdown import MESSAGE as SHUTTING_DOWN, Drain

# The API's paths: what the key guards (with the API's description) and what must be sent as JSON; /health and
# /metrics stay open for probes and scrapers.
API_PATHS = ("/v1/", "/api/", "/tokenize", "/detokenize", "/infill", "/responses")
_PROTECTED = (*API_PATHS, "/openapi.json", "/admin/")  # the admin routes: server/router.py
# The one path that takes a multipart body (a file upload, as OpenAI's): a page may store a file there without a
# preflight, but it cannot start a batch on it (POST /v1/batches is JSON only).
UPLOADS = ("/v1/files",)


async def _send_error(send: Send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class InternalErrors:
    """An exception no handler expected becomes OpenAI's 500 body, without its text (it can name files, addresses
    or internal state: it goes to the server's log). Caught here, not re-raised to the server, so a keep-alive
    connection stays usable (Starlette's own error middleware re-raises, and uvicorn then drops the connection)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            logging.getLogger("nexttoken.server").exception("internal error on %s %s", scope["method"], scope["path"])
            if started:
                raise  # half a response is out: only closing the connection can say it failed
            body = error_body_for(scope["path"], 500, "internal error: the server could not complete this request",
                                  "internal_server_error")
            await _send_error(send, 500, body)


class BodyLimit:
    """Read the whole body first (refusing more than max_bytes with 413, and a body not sent within timeout_s
    with 408, so a slow or stalled client cannot hold a connection), then replay it to the app. A body still
    arriving when a graceful shutdown runs out of time (`drain.expired`) gets 503.

    After the replay, `receive` is the server's own again, so the app still hears `http.disconnect`.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0, drain: Drain | None = None) -> None:
        self.app, self.max_bytes, self.timeout_s, self.drain = app, max_bytes, timeout_s, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, send)
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        stopping = asyncio.ensure_future(self.drain.expired.wait()) if self.drain is not None else None
        try:
            while True:
                receiving = asyncio.ensure_future(receive())
                waits = {receiving} if stopping is None else {receiving, stopping}
                await asyncio.wait(waits, timeout=max(0.0, deadline - loop.time()), return_when=asyncio.FIRST_COMPLETED)
                if not receiving.done():
                    receiving.cancel()
                    if stopping is not None and stopping.done():
                        body = error_body_for(scope["path"], 503, SHUTTING_DOWN, "service_unavailable_error",
                                              "server_shutting_down")
                        return await _send_error(send, 503, body)
                    message = f"the request body did not arrive within {self.timeout_s:g} s"
                    body = error_body_for(scope["path"], 408, message, "invalid_request_error", "timeout")
                    return await _send_error(send, 408, body)
                message = receiving.result()
                if message["type"] == "http.disconnect":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_bytes:
                    return await self._too_large(scope, send)
                if not message.get("more_body", False):
                    break
        finally:
            if stopping is not None:
                stopping.cancel()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, send: Send) -> None:
        message = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        await _send_error(send, 413, error_body_for(scope["path"], 413, message, "invalid_request_error",
                                                    "request_too_large"))


class ApiKeyGuard:
    """With an API key set, API paths need `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's
    header, which its SDK and Claude Code send)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key and scope["type"] == "http" and scope["path"].startswith(_PROTECTED):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, key = auth.strip().partition(" ")
            if scheme.lower() != "bearer":  # the scheme is case-insensitive (RFC 7235)
                key = headers.get(b"x-api-key", b"").decode("latin-1")
            if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):  # in constant time
                body = error_body_for(scope["path"], 401, "invalid or missing API key: send Authorization: Bearer "
                                      "<key> (or x-api-key: <key>)", "invalid_request_error", "invalid_api_key")
                return await _send_error(send, 401, body)
        await self.app(scope, receive, send)


class JsonOnly:
    """POSTs to the API must say `Content-Type: application/json` (415 otherwise, in OpenAI's body; UPLOADS take
    multipart/form-data too). A web page can
    send text/plain, form and multipart bodies to any address without asking (no CORS preflight): refusing them
    keeps pages from starting generations on a server without a key."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith(API_PATHS)
                and _posts_to_a_route(scope)):  # a POST to a GET-only path is the router's 405, not a 415
            declared = dict(scope.get("headers") or []).get(b"content-type", b"").decode("latin-1")
            media = declared.split(";", 1)[0].strip().lower()
            upload = media == "multipart/form-data" and scope["path"] in UPLOADS
            if media != "application/json" and not upload and not _ollama_client(scope):
                message = (f"the request body must be JSON, sent with Content-Type: application/json (got "
                           f"{declared[:100]!r})")
                body = error_body_for(scope["path"], 415, message, "invalid_request_error", "unsupported_media_type")
                return await _send_error(send, 415, body)
        await self.app(scope, receive, send)


def _ollama_client(scope: Scope) -> bool:
    """A POST to Ollama's routes from no web page: Ollama takes any media type, and its clients send none (litellm)
    or a form's (`curl -d`, Ollama's own examples). A page cannot pass for one: browsers send an Origin header with
    every cross-origin POST."""
    return scope["path"].startswith(OLLAMA_PATHS) and b"origin" not in dict(scope.get("headers") or [])


def _posts_to_a_route(scope: Scope) -> bool:
    """Whether some route of the app takes this request's path and method (Starlette sets scope["app"] before its
    middleware runs); True when there is no app to ask."""
    from starlette.routing import Match

    router = getattr(scope.get("app"), "router", None)
    if router is None:
        return True
    return any(route.matches(scope)[0] == Match.FULL for route in router.routes)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


class HostCheck:
    """The Host header must name this server: an IP address (DNS rebinding always goes through a name), localhost,
    the address it is bound to, or one of `allowed` (`--allowed-hosts`; "*" turns the check off). A page on
    attacker.example whose name is re-pointed at 127.0.0.1 sends Host: attacker.example and gets 421."""

    LOCAL = ("localhost", "localhost.")

    def __init__(self, app: ASGIApp, bound: str, allowed: tuple[str, ...] = ()) -> None:
        self.app = app
        self.any = "*" in allowed
        self.allowed = {h.lower().rstrip(".") for h in (*allowed, *self.LOCAL, bound) if h != "*"}

    def permits(self, host_header: str) -> bool:
        host = host_header.strip().lower()
        if host.startswith("["):  # [v6]:port
            host = host[: host.find("]") + 1]
        elif host.count(":") == 1:
            host = host.split(":", 1)[0]
        host = host.rstrip(".")
        return self.any or _is_ip(host) or host in self.allowed or host.endswith(".localhost")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.any:
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            if not self.permits(host):
                message = (f"this server does not answer to the host {host[:100]!r}: add it with --allowed-hosts "
                           "(a web page whose name was re-pointed at this server sends its own name here)")
                return await _send_error(send, 421, error_body_for(scope["path"], 421, message, "invalid_request_error",
                                                                   "misdirected_request"))
        await self.app(scope, receive, send)
