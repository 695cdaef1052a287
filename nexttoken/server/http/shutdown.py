"""Graceful shutdown with a deadline.

On SIGTERM / SIGINT the server stops accepting connections and the requests in flight get `timeout_s` seconds
(`--shutdown-timeout`) to finish. Then the rest is ended on purpose, in OpenAI's shape: the engine is closed, so
unfinished generations are aborted and their clients get a 503 body (a stream: an error event, then [DONE]), and
bodies still being sent get a 503 too. Every connection then closes and the process exits. uvicorn's own
graceful-shutdown timeout, a few seconds later (`BACKSTOP_S`), only cancels what is still running after that.
"""

from __future__ import annotations

import asyncio
from typing import Callable

BACKSTOP_S = 3.0  # after the deadline, how long uvicorn waits for the aborted requests' answers to go out
MESSAGE = "the server is shutting down: this request did not finish within its shutdown timeout; send it again"


class Drain:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.expired = asyncio.Event()  # set at the deadline; request-body readers watch it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_expire: list[Callable[[], None]] = []
        self._begun = False

    def attach(self, loop: asyncio.AbstractEventLoop, on_expire: Callable[[], None]) -> None:
        """At start-up, on the server's loop: what to call at the deadline (close the engine)."""
        self._loop = loop
        self._on_expire.append(on_expire)

    def begin(self) -> None:
        """The shutdown signal arrived (called from the signal handler): start the clock, once."""
        if self._begun or self._loop is None:
            return
        self._begun = True
        self._loop.call_soon_threadsafe(self._loop.call_later, self.timeout_s, self._expire)

    def _expire(self) -> None:
        self.expired.set()
        for callback in self._on_expire:
            callback()
