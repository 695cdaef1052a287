"""AsyncEngine: the synchronous LLMEngine stepping on its own thread, fed and drained from an asyncio loop.

Requests and cancellations go in through a thread-safe inbox that the engine thread empties before every step,
so a cancelled request (a client that went away) frees its place and its KV blocks at the next step. Events come
back through one asyncio.Queue per request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator, Callable, TypeVar

from ..errors import NextTokenError
from .embedding import slices
from .llm_engine import EngineStats, LLMEngine
from ..generation.config import GenerationConfig
from .sequence import TokenEvent


log = logging.getLogger("nexttoken.engine")
T = TypeVar("T")


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)


class EngineDeadError(NextTokenError, RuntimeError):
    """The engine thread stopped on an unexpected error; requests cannot be served."""


class EngineClosedError(NextTokenError, RuntimeError):
    """The engine was closed (the server is shutting down): the request was refused, or aborted unfinished."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[EngineStats], None] | None = None) -> None:
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._on_step = on_step
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="nexttoken-engine", daemon=True)
        self._stopping = False
        self._closed: str | None = None  # why new requests are refused (close())
        self._inbox_adds = 0  # sequences put in the inbox that the engine thread has not added yet
        self._adds_lock = threading.Lock()  # the loop's thread adds to it, the engine's subtracts
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def close(self, reason: str) -> None:
        """Refuse new requests and abort the running and waiting ones: each of their streams raises
        EngineClosedError(reason). The end of a graceful shutdown: what did not finish in time stops here."""
        self._closed = reason
        self._inbox.put(("close", reason))

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(("wake", None))
        self._thread.join(timeout=10)

    @property
    def stats(self) -> EngineStats:
        """The engine's numbers as of its last step (a snapshot, safe to read from any thread)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a place in the running batch (and its KV blocks): the engine's queue as of its last
        step, and those on their way to it (the admission bound reads this)."""
        return self._stats.num_waiting + self._inbox_adds

    def reserve(self, count: int, limit: int) -> bool:
        """Count `count` sequences as waiting now, before their streams start, if the waiting queue stays within
        `limit` (a queue with nothing waiting takes any count); False: refused, nothing counted. Each reserved
        sequence's stream is then started with reserved=True, or handed back with `release`."""
        with self._adds_lock:
            waiting = self._stats.num_waiting + self._inbox_adds
            free = max(0, self._stats.num_slots - self._stats.num_running - waiting)  # taken at once, no wait
            if waiting and waiting + count - free > limit:
                return False
            self._inbox_adds += count
            return True

    def release(self, count: int) -> None:
        """Hand back reserved sequences whose streams never started."""
        with self._adds_lock:
            self._inbox_adds -= count

    async def stream(
        self, request_id: str, prompt_ids: list[int], params: GenerationConfig, arrival_time: float | None = None,
        group: str | None = None, reserved: bool = False, priority: int = 0, lora: str | None = None,
        images: tuple = (),
    ) -> AsyncIterator[TokenEvent]:
        """Events of one request until it finishes (under LoRA adapter `lora`, None: the base model; `images`: its
        placed images, LLMEngine.add_request's). Closing the iterator early cancels the request. `reserved`:
        `reserve` counted it already."""
        if self.error is not None or self._closed is not None:
            if reserved:
                self.release(1)
            if self.error is not None:
                raise EngineDeadError(f"the engine stopped: {self.error!r}")
            raise EngineClosedError(self._closed)
        events: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), events)
        if not reserved:
            with self._adds_lock:
                self._inbox_adds += 1
        self._inbox.put(("add", (request_id, prompt_ids, params, arrival_time, group, priority, lora, images)))
        finished = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                finished = event.finished
                yield event
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """fn(engine) run on the engine thread between two steps (loading or unloading a LoRA adapter): its result,
        or its exception raised here."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(("call", (fn, loop, future)))
        return await future

    # ---- the engine thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                self._stats = self.engine.stats()
                if self._on_step is not None:
                    self._on_step(self._stats)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request, then the thread ends
            log.exception("the engine thread stopped")
            self.error = e
            for rid in list(self._streams):
                self._send(rid, EngineDeadError(f"the engine stopped: {e!r}"))

    async def embed(self, prompts: list[list[int]], pooling: str, normalize: bool = True,
                    dimensions: int | None = None) -> list:
        """LLMEngine.embed, run on the engine thread between two steps (the model is the engine's to run), a slice
        of similar-length prompts at a time (embedding.slices): the next slice is sent when one is done, so the
        engine steps its running requests in between and their streams keep flowing."""
        out: list = [None] * len(prompts)
        for group in slices(prompts):
            if self._closed is not None:
                raise EngineClosedError(self._closed)
            if self.error is not None:
                raise EngineDeadError(f"the engine stopped: {self.error!r}")
            rows = [prompts[i] for i in group]
            vectors = await self.call(lambda engine: engine.embed(rows, pooling, normalize, dimensions))
            for i, vector in zip(group, vectors):
                out[i] = vector
        return out

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                with self._adds_lock:
                    self._inbox_adds -= 1
                request_id, prompt_ids, params, arrival, group, priority, lora, images = item
                try:
                    self.engine.add_request(prompt_ids, params, request_id, arrival_time=arrival, group=group,
                                            priority=priority, lora=lora, images=images)
                except Exception as e:  # noqa: BLE001 - a bad request fails alone
                    self._send(request_id, e)
            elif kind == "call":  # work on the engine's model between steps (embeddings, LoRA loading)
                fn, loop, future = item
                try:
                    result = fn(self.engine)
                except Exception as e:  # noqa: BLE001 - the caller's error, raised where it awaits
                    loop.call_soon_threadsafe(_settle, future, None, e)
                else:
                    loop.call_soon_threadsafe(_settle, future, result, None)
            elif kind == "abort":
                self.engine.abort(item)
            elif kind == "close":
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
                    self._send(request_id, EngineClosedError(item))

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            self._send(event.request_id, event)

    def _send(self, request_id: str, item: object) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, events = target
            loop.call_soon_threadsafe(events.put_nowait, item)
