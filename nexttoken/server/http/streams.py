"""Running a request's choices on the engine, and noticing when its client goes away.

Every way a client can leave (closing a stream, dropping a plain request) ends up cancelling the engine
streams, whose cleanup tells the engine to abort: the slot is free at the next step.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ...engine.async_engine import AsyncEngine
from ...engine.sequence import TokenEvent
from ...generation.config import GenerationConfig
from ...errors import NextTokenError
from ..metrics import SequenceClock, ServerMetrics
from .request_log import current_request


@dataclass(frozen=True)
class Job:
    index: int  # the choice's index in the response
    request_id: str
    prompt_ids: list[int]
    params: GenerationConfig  # one sequence's options
    group: str = ""  # the client request: its sequences share turns for free places with other requests
    priority: int = 0  # lower runs first under --scheduling-policy priority
    lora: str | None = None  # the LoRA adapter the request's `model` chose; None: the base model
    images: tuple = ()  # the prompt's images (images/prepared.py's PromptImage, placed in prompt_ids)


def run_jobs(
    engine: AsyncEngine, jobs: list[Job], metrics: ServerMetrics, arrival: float, reserved: bool = False,
    model: str | None = None,
) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(choice index, event) from all jobs as they come; closing this iterator cancels the unfinished ones. The
    jobs start now (their streams on the next turn of the loop); `reserved`: engine.reserve counted them, and a
    job whose stream never starts (cancelled first) is handed back. `model`: the served model the metrics and the
    request log name (default: the server's)."""
    merged: asyncio.Queue = asyncio.Queue()
    started = [False] * len(jobs)
    record = current_request()  # the request log's line for this request: its tokens
    label = model or metrics.model_name

    async def pump(k: int, job: Job) -> None:
        clock, finished = SequenceClock(), False
        started[k] = True
        if record is not None:
            record.started(job.prompt_ids, job.lora, label)
        try:
            async for event in engine.stream(job.request_id, job.prompt_ids, job.params, arrival, job.group or None,
                                           priority=job.priority, reserved=reserved, lora=job.lora,
                                           images=job.images):
                metrics.observe(event, clock, label)
                if record is not None:
                    record.add(event)
                finished = event.finished
                await merged.put((job.index, event))
        except asyncio.CancelledError:
            if not finished:
                metrics.aborted(label)  # the client left: engine.stream's cleanup aborted it
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, who decides the response
            await merged.put((job.index, e))

    def never_started(k: int) -> Callable[[asyncio.Task], None]:
        return lambda task: engine.release(1) if reserved and not started[k] else None

    tasks = []
    for k, job in enumerate(jobs):
        tasks.append(asyncio.create_task(pump(k, job)))
        tasks[-1].add_done_callback(never_started(k))
    return _merge(tasks, merged)


async def _merge(tasks: list[asyncio.Task], merged: asyncio.Queue) -> AsyncIterator[tuple[int, TokenEvent]]:
    try:
        remaining = len(tasks)
        while remaining:
            index, event = await merged.get()
            if isinstance(event, Exception):
                raise event
            yield index, event
            if event.finished:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientGone(NextTokenError):
    """The client closed the connection before the response was ready."""


async def collect(request: Request, events: AsyncIterator[tuple[int, TokenEvent]]) -> list[tuple[int, TokenEvent]]:
    """All events of a non-streaming request; raises ClientGone (after cancelling) if the client leaves first."""

    async def consume() -> list[tuple[int, TokenEvent]]:
        return [item async for item in events]

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(_disconnected(request.receive))
    done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if consumer in done:
        watcher.cancel()
        return consumer.result()
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    await events.aclose()  # type: ignore[attr-defined]
    raise ClientGone()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Server-sent events that stop (and close their source, cancelling the request) when the client leaves,
    whatever ASGI version the server speaks."""

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})},
                         **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.create_task(self.stream_response(send))
        watcher = asyncio.create_task(_disconnected(receive))
        try:
            done, _ = await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if streaming in done:
                exc = streaming.exception()
                if exc is not None and not isinstance(exc, OSError):
                    raise exc
        finally:
            for task in (streaming, watcher):
                task.cancel()
            await asyncio.gather(streaming, watcher, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def sse(data: str | dict[str, Any], event: str | None = None) -> str:
    """One server-sent event: `data` (a dict is sent as its JSON), named `event` when given (Responses and
    Messages name each event by its type; OpenAI's chunks and llama.cpp's are unnamed)."""
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n" if event is None else f"event: {event}\ndata: {text}\n\n"
