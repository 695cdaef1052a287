"""The request log: one line per request on the `nexttoken.server.requests` logger (method, path, status, model,
API, prompt / completion tokens, time to first token, duration, finish reason, request id), with an error's cause
(the message of the error body the client got); a 5xx's traceback is logged where it is caught
(guards.InternalErrors). uvicorn's access log has neither the model nor the tokens. `nexttoken serve
--request-log-level` sets the level (warning: errors only; off: none), `--log-format json` makes each line a JSON
object (log_format.py). The same middleware hands each finished request to the tracer (tracing.py), when traces
are exported.

A request's record travels in a context variable: the middleware sets it, and the engine streams the handler starts
(streams.run_jobs, in tasks that copy the context) add their tokens to it."""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...engine.sequence import TokenEvent

log = logging.getLogger("nexttoken.server.requests")
QUIET_PATHS = ("/health", "/metrics")  # polled: logged at debug level
_ERROR_BODY_BYTES = 4096  # of an error response, read for its message
# The API a path belongs to, as the log and the traces name it (a path not here: "-"; /api/...: Ollama's)
APIS = {"/v1/chat/completions": "openai.chat", "/v1/completions": "openai.completions",
        "/v1/responses": "openai.responses", "/responses": "openai.responses", "/v1/embeddings": "openai.embeddings",
        "/v1/messages": "anthropic.messages", "/v1/messages/count_tokens": "anthropic.count_tokens",
        "/infill": "llamacpp.infill", "/tokenize": "tokenize", "/detokenize": "detokenize", "/v1/models": "models"}

# The record of the request being served in this context (None outside a request). A ContextVar, not module
# state: each request's task sees its own.
_CURRENT: ContextVar["RequestRecord | None"] = ContextVar("nexttoken_request_record", default=None)


@dataclass
class RequestRecord:
    """What the log line says of one request, filled in as it runs."""

    request_id: str
    api: str = "-"  # APIS' name of its path
    start: float = field(default_factory=time.monotonic)  # arrival (monotonic seconds, the engine's clock)
    start_ns: int = field(default_factory=time.time_ns)  # arrival, wall clock (a trace's start)
    ran: bool = False  # a sequence of it ran on the model
    model: str | None = None  # the served model it ran on
    adapter: str | None = None  # the LoRA adapter it ran under; None: the base model
    prompt_tokens: int = 0
    completion_tokens: int = 0
    sequences: int = 0  # sequences started (n choices x prompts)
    first_token: float | None = None  # when its first token came (monotonic)
    queue_s: float | None = None  # arrival to its first sequence's first scheduling
    finish_reasons: list[str] = field(default_factory=list)  # one per finished sequence, in finishing order
    sampling: dict | None = None  # the sampling options it ran with (api/serving.py; openai/options.applied)
    _prompts: set[int] = field(default_factory=set)  # id() of the prompts counted (n choices share one list)

    def started(self, prompt_ids: list[int], adapter: str | None, model: str | None = None) -> None:
        """A sequence of this request started (under `adapter`, or the base model `model`) over `prompt_ids`."""
        self.ran, self.adapter, self.model = True, adapter, model or self.model
        self.sequences += 1
        if id(prompt_ids) not in self._prompts:
            self._prompts.add(id(prompt_ids))
            self.prompt_tokens += len(prompt_ids)

    def add(self, event: TokenEvent) -> None:
        """One engine event of one of its sequences: its tokens, first token, queue time and finish."""
        self.completion_tokens += len(event.token_ids)
        if event.token_ids and self.first_token is None:
            self.first_token = event.time
        if self.queue_s is None and event.scheduled_time is not None:
            self.queue_s = max(0.0, event.scheduled_time - event.arrival_time)
        if event.finished:
            self.finish_reasons.append(str(event.finish_reason))

    @property
    def ttft_s(self) -> float | None:
        """Arrival to the first token (None: no token came)."""
        return None if self.first_token is None else max(0.0, self.first_token - self.start)

    def fields(self, method: str, path: str, status: int, seconds: float, error: str | None,
               default_model: str) -> dict[str, Any]:
        """The log line's fields, in its order (a JSON line's keys)."""
        ttft = self.ttft_s
        return {"method": method, "path": path, "status": status,
                "model": self.adapter or ((self.model or default_model) if self.ran else None), "api": self.api,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "ttft_ms": None if ttft is None else round(ttft * 1000, 1), "duration_ms": round(seconds * 1000, 1),
                "finish_reason": ",".join(self.finish_reasons) or None, "request_id": self.request_id,
                "sampling": self.sampling, "error": error}


class RequestTracer(Protocol):
    """What the middleware hands a finished request to (tracing.py's): one span per request."""

    def record(self, scope: Scope, record: RequestRecord, status: int, seconds: float, error: str | None) -> None:
        ...


def api_of(path: str) -> str:
    """The API `path` belongs to: APIS' name, Ollama's under /api/, else "-"."""
    if path in APIS:
        return APIS[path]
    if path.startswith(("/v1/responses/", "/responses/")):
        return "openai.responses"
    return "ollama." + path[len("/api/"):] if path.startswith("/api/") else "-"


def current_request() -> RequestRecord | None:
    """The record of the request this code serves (None outside one)."""
    return _CURRENT.get()


class RequestLog:
    """ASGI middleware (the outermost): times the request, watches its status and an error body's message, and
    logs the line when the response is done (a stream: when its last event is sent)."""

    def __init__(self, app: ASGIApp, model_name: str, tracer: RequestTracer | None = None) -> None:
        self.app, self.model_name, self.tracer = app, model_name, tracer  # tracer None: no traces, no cost

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")[:128]
        record = RequestRecord(given or f"req-{uuid.uuid4().hex[:24]}", api_of(scope["path"]))
        token = _CURRENT.set(record)
        start, status, error = record.start, 0, bytearray()

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
            seconds = time.monotonic() - start
            cause = _message(bytes(error)) if status >= 400 else None
            self._write(scope, status, record, seconds, cause)
            if self.tracer is not None and scope["path"] not in QUIET_PATHS:
                self.tracer.record(scope, record, status, seconds, cause)

    def _write(self, scope: Scope, status: int, record: RequestRecord, seconds: float, error: str | None) -> None:
        level = (logging.DEBUG if scope["path"] in QUIET_PATHS and status < 400 else logging.INFO if status < 400
                 else logging.WARNING if status < 500 else logging.ERROR)
        if not log.isEnabledFor(level):
            return
        f = record.fields(scope["method"], scope["path"], status, seconds, error, self.model_name)
        ttft = "-" if f["ttft_ms"] is None else f"{f['ttft_ms']:.0f}"
        line = (f"{f['method']} {f['path']} {status or '-'} model={f['model'] or '-'} "
                f"prompt_tokens={f['prompt_tokens']} completion_tokens={f['completion_tokens']} "
                f"duration_ms={seconds * 1000:.0f} request_id={f['request_id']} api={f['api']} ttft_ms={ttft} "
                f"finish_reason={f['finish_reason'] or '-'}")
        if record.sampling is not None:
            line += " sampling=" + ",".join(f"{k}={v}" for k, v in record.sampling.items())
        if error is not None:
            line += f" error={error!r}"
        log.log(level, "%s", line, extra={"request": f})  # log_format.JsonFormatter writes the fields


def _message(body: bytes) -> str:
    """An error body's message (OpenAI's `{"error": {"message"}}`, Anthropic's, llama.cpp's), else its text."""
    try:
        data = json.loads(body)
        return str(data["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", errors="replace")[:500]
