"""Running a batch's requests through the server's own routes, in this process: each line's body goes to its
route as an HTTP request would (the same validation, handlers, error bodies and engine), so a line's answer is
exactly the server's. Many requests are in flight at once, so the engine runs full batches; each answer is handed
on as soon as it is ready (the caller writes and flushes it)."""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Iterable

import httpx
from starlette.types import ASGIApp

from .lines import BatchRequest, output_line, refusal

MAX_RETRIES = 1000  # a 429 (the engine's queue full of other traffic) is retried after its Retry-After


@asynccontextmanager
async def started(app: Any) -> AsyncIterator[None]:
    """The app's lifespan (its engine thread) around a batch run in a process that serves no HTTP."""
    async with app.router.lifespan_context(app):
        yield


async def run_requests(app: ASGIApp, requests: Iterable[BatchRequest], on_answer: Callable[[dict[str, Any]], None],
                       concurrency: int, headers: dict[str, str] | None = None) -> None:
    """Answer every request through `app`, `concurrency` at once; on_answer(output line) as each is done.
    `headers`: sent with each (the server's API key, for a batch the server runs on itself)."""
    pending = iter(requests)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=None,
                                 headers=headers) as client:

        async def worker() -> None:
            for request in pending:  # the workers share the one iterator: each line is taken once
                on_answer(refusal(request) if request.error is not None else await answer(client, request))

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def answer(client: httpx.AsyncClient, request: BatchRequest) -> dict[str, Any]:
    """One request through its route: its status and JSON body as the output line."""
    request_id = f"req-{uuid.uuid4().hex[:24]}"  # the server's request log names it
    headers = {"content-type": "application/json", "x-request-id": request_id}
    for _ in range(MAX_RETRIES):
        response = await client.post(request.url or "", content=request.body, headers=headers)
        if response.status_code != 429:
            break
        await asyncio.sleep(float(response.headers.get("retry-after", 1)))
    try:
        body = json.loads(response.content)
    except json.JSONDecodeError:  # every API answers JSON: kept as text, should one not
        body = response.text
    return output_line(request, response.status_code, body, request_id)
