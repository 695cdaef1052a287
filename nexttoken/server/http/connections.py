"""Connections that cannot be held: a header timeout, a connection limit, and accept errors logged once.

uvicorn bounds an idle keep-alive connection (timeout_keep_alive) but not a client that connects and sends its
headers a byte at a time, or nothing at all (slowloris): each holds a file descriptor until the process runs
out, and then the accept loop logs a traceback per attempt. `protocol()` is uvicorn's h11 protocol with

- a header timeout: from the connection (or the end of the previous response) to the end of the request's
  headers; past it the connection is closed. The body has its own limit (guards.BodyLimit: 408).
- a connection limit: past `max_connections` open ones, the connection that has waited longest for its
  headers is closed to make room (or the newcomer, when every connection is inside a request).

`AcceptErrors` logs a run of identical accept errors (EMFILE: out of file descriptors) once a minute with a count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("nexttoken.server")


def protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with the header timeout and connection limit (uvicorn.Config(http=...))."""

    class GuardedH11Protocol(H11Protocol):
        refused = 0  # connections closed on arrival (over the limit), for the log

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            self._since = time.monotonic()  # connected, or its last response ended
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                # At the limit: the connection that has waited longest for headers makes room (slow-header
                # clients cannot keep prompt ones out); when every one is inside a request, the newcomer goes.
                victim = min((c for c in self.connections if c is not self and c.conn.their_state is h11.IDLE
                              and not c.transport.is_closing()), key=lambda c: c._since, default=self)
                GuardedH11Protocol.refused += 1
                if GuardedH11Protocol.refused in (1, 10, 100) or GuardedH11Protocol.refused % 1000 == 0:
                    log.warning("%d connections closed at the limit of %d (--max-connections): the longest "
                                "waiting for headers, or the newest", GuardedH11Protocol.refused, max_connections)
                victim.transport.close()
                if victim is self:
                    return
            self._arm()

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
                self._since = time.monotonic()
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
