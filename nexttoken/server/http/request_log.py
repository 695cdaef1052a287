"""The request log: one line per request on the `nexttoken.server.requests` logger (method, path, status, model,
prompt / completion tokens, duration, request id), with an error's cause (the message of the error body the client
got); a 5xx's traceback is logged where it is caught (guards.InternalErrors). uvicorn's access log has neither the
model nor the tokens. `nexttoken serve --request-log-level` sets the level (warning: errors only; off: none).

A request's record travels in a context variable: the middleware sets it, and the engine streams the handler starts
(streams.run_jobs, in tasks that copy the context) add their tokens to it."""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("nexttoken.server.requests")
QUIET_PATHS = ("/health", "/metrics")  # polled: logged at debug level
_ERROR_BODY_BYTES = 4096  # of an error response, read for its message

# The record of the request being served in this context (None outside a request). A ContextVar, not module
# state: each request's task sees its own.
_CURRENT: ContextVar["RequestRecord | None"] = ContextVar("nexttoken_request_record", default=None)


@dataclass
class RequestRecord:
    """What the log line says of one request, filled in as it runs."""

    request_id: str
    ran: bool = False  # a sequence of it ran on the model
    adapter: str | None = None  # the LoRA adapter it ran under; None: the base model
    prompt_tokens: int = 0
    completion_tokens: int = 0
    sampling: dict | None = None  # the sampling options it ran with (api/serving.py; openai/options.applied)
    _prompts: set[int] = field(default_factory=set)  # id() of the prompts counted (n choices share one list)

    def started(self, prompt_ids: list[int], adapter: str | None) -> None:
        """A sequence of this request started (under `adapter`, or the base model) over `prompt_ids`."""
        self.ran, self.adapter = True, adapter
        if id(prompt_ids) not in self._prompts:
            self._prompts.add(id(prompt_ids))
            self.prompt_tokens += len(prompt_ids)


def current_request() -> RequestRecord | None:
    """The record of the request this code serves (None outside one)."""
    return _CURRENT.get()


class RequestLog:
    """ASGI middleware (the outermost): times the request, watches its status and an error body's message, and
    logs the line when the response is done (a stream: when its last event is sent)."""

    def __init__(self, app: ASGIApp, model_name: str) -> None:
        self.app, self.model_name = app, model_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")[:128]
        record = RequestRecord(given or f"req-{uuid.uuid4().hex[:24]}")
        token = _CURRENT.set(record)
        start, status, error = time.monotonic(), 0, bytearray()

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(error) < _ERROR_BODY_BYTES:
                error.extend(message.get("body", b"")[: _ERROR_BODY_BYTES - len(error)])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            _CURRENT.reset(token)
            self._write(scope, status, record, time.monotonic() - start, bytes(error))

    def _write(self, scope: Scope, status: int, record: RequestRecord, seconds: float, error: bytes) -> None:
        level = (logging.DEBUG if scope["path"] in QUIET_PATHS and status < 400 else logging.INFO if status < 400
                 else logging.WARNING if status < 500 else logging.ERROR)
        if not log.isEnabledFor(level):
            return
        model = record.adapter or (self.model_name if record.ran else "-")
        line = (f"{scope['method']} {scope['path']} {status or '-'} model={model} "
                f"prompt_tokens={record.prompt_tokens} completion_tokens={record.completion_tokens} "
                f"duration_ms={seconds * 1000:.0f} request_id={record.request_id}")
        if record.sampling is not None:
            line += " sampling=" + ",".join(f"{k}={v}" for k, v in record.sampling.items())
        if status >= 400:
            line += f" error={_message(error)!r}"
        log.log(level, "%s", line)


def _message(body: bytes) -> str:
    """An error body's message (OpenAI's `{"error": {"message"}}`, Anthropic's, llama.cpp's), else its text."""
    try:
        data = json.loads(body)
        return str(data["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", errors="replace")[:500]
