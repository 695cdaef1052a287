"""Connections that cannot be held: a header timeout, a connection limit, and accept errors logged once.

uvicorn bounds an idle keep-alive connection (timeout_keep_alive) but not a client that connects and sends its
headers a byte at a time, or nothing at all (slowloris): each holds a file descriptor until the process runs
out, and then the accept loop logs a traceback per attempt. `protocol()` is uvicorn's h11 protocol with

- a header timeout: from the connection (or the end of the previous response) to the end of the request's
  headers; past it the connection is closed. The body has its own limit (guards.BodyLimit: 408).
- a connection limit: past `max_connections` open ones, the connection whose request has made no progress for
  longest (waiting for its headers, or for the rest of its body: a client that sends headers and one byte of body
  holds a slot as surely as one that sends nothing) is closed to make room. When every connection holds a whole
  request (the server is working on all of them), the newcomer is answered 503 in OpenAI's error body with
  Retry-After, as the docs promise, rather than reset.

`AcceptErrors` logs a run of identical accept errors (EMFILE: out of file descriptors) once a minute with a count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("nexttoken.server")

# The answer to a connection past the limit when none can make room; read by the client after it sends its request
# (the read side stays open a moment, so that the request is not met with a reset).
_BUSY_BODY = json.dumps({"error": {
    "message": "the server is at its connection limit (--max-connections) and working on every open connection's "
               "request; retry after Retry-After seconds", "type": "server_error", "param": None,
    "code": "max_connections"}}).encode()
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        b"connection: close\r\ncontent-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)
BUSY_LINGER_S = 2.0  # how long a refused connection's request is read (and dropped) before it is closed
# A request that can still make room: waiting for its headers, or for the rest of its body.
_WAITING = (h11.IDLE, h11.SEND_BODY)


def protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with the header timeout and connection limit (uvicorn.Config(http=...))."""

    class GuardedH11Protocol(H11Protocol):
        refused = 0  # connections closed on arrival (over the limit), for the log

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            self._since = time.monotonic()  # connected, or its last response ended
            self._progress = self._since  # the last bytes of a request that arrived
            self._busy = False  # refused with 503: what it sends is dropped
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                # At the limit: the connection whose request has stalled longest makes room (slow-header and
                # slow-body clients cannot keep prompt ones out); when every one holds a whole request, the
                # newcomer is told so (503).
                victim = min((c for c in self.connections if c is not self and not c._busy
                              and c.conn.their_state in _WAITING and not c.transport.is_closing()),
                             key=lambda c: c._progress, default=self)
                GuardedH11Protocol.refused += 1
                if GuardedH11Protocol.refused in (1, 10, 100) or GuardedH11Protocol.refused % 1000 == 0:
                    log.warning("%d connections closed at the limit of %d (--max-connections): the one whose "
                                "request stalled longest, or the newest with a 503", GuardedH11Protocol.refused,
                                max_connections)
                if victim is self:
                    self._refuse()
                    return
                victim.transport.close()
            self._arm()

        def _refuse(self) -> None:
            """503 with Retry-After, then the request that arrives meanwhile is read and dropped for a moment."""
            self._busy = True
            self.transport.write(BUSY)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(BUSY_LINGER_S, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if self._busy:
                return  # a refused connection's request: dropped
            self._progress = time.monotonic()
            super().data_received(data)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # its headers did not arrive in time: the descriptor is freed

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._since = self._progress = time.monotonic()
                self._arm()  # the next request's headers get the same time

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


class AcceptErrors:
    """An asyncio exception handler: accept() failing for want of resources (asyncio retries after a second) is
    logged once a minute with how many times it happened, not with a traceback each time; anything else goes to
    the loop's default handler."""

    PERIOD_S = 60.0

    def __init__(self) -> None:
        self.count, self.last = 0, -self.PERIOD_S

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        # asyncio's accept loop: "socket.accept() out of system resource", and its retries (_start_serving, once
        # per backlog slot) failing on a listening socket that shutdown closed meanwhile
        if "accept" not in message and "_start_serving" not in message:
            return loop.default_exception_handler(context)
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.PERIOD_S:
            log.error("accepting connections failed %d times (%s: %s): out of file descriptors? Lower "
                      "--max-connections or raise the open-files limit (ulimit -n)", self.count,
                      context.get("message"), context.get("exception"))
            self.count, self.last = 0, now
