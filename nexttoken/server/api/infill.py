"""POST /infill: llama.cpp's fill-in-the-middle endpoint (llama.vim, llama.vscode), over the completions request
path: the FIM prompt laid out by nexttoken/text/infill.py (context files, prefix, suffix, the middle's start), sampled
as a Completions request would be, answered in llama.cpp's body (`content`, `stop`, `stop_type`, token counts)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...engine import expand
from ..http.errors import APIError
from ..http.streams import Job, SSEResponse, run_jobs, sse
from ..llamacpp.protocol import InfillRequest, completion_body, stop_type
from ..openai.protocol import CompletionRequest
from .completions import Completions
from .serving import collect_choices, parse_body
from .streaming import EventEncoder, Step, Tally, drive


class Infill(Completions):
    async def infill(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: InfillRequest = parse_body(InfillRequest, await request.body())
        self._check_model(req.model)
        extra = [(chunk.filename, chunk.text) for chunk in req.input_extra]
        ids = self._fim(req.input_prefix, req.input_suffix, extra, req.prompt, "input_prefix")
        creq: CompletionRequest = parse_body(CompletionRequest, json.dumps(completion_body(req, ids)).encode())
        cfg = self._options(creq, [ids], creq.max_tokens, "input_prefix")  # None: all the context has room for
        rid = f"infill-{uuid.uuid4().hex}"
        jobs = [Job(0, rid, p, c, rid) for p, c in expand([ids], cfg)]
        events = run_jobs(self.engine, jobs, self.metrics, arrival, model=self.settings.model_name)
        if req.stream:
            return SSEResponse(self._stream(len(ids), events))
        choices = await collect_choices(request, 1, events)
        if choices is None:
            return Response(status_code=499)
        c = choices[0]
        return JSONResponse(self._body(c.text, True, len(ids), len(c.token_ids), c.finish_reason, c.stop_reason))

    def _body(self, content: str, stop: bool, prompt: int, predicted: int, finish_reason: str | None,
              stop_reason: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"index": 0, "content": content, "stop": stop, "model": self.settings.model_name}
        if stop:
            body.update(stop_type=stop_type(finish_reason, stop_reason),
                        stopping_word=stop_reason if isinstance(stop_reason, str) else "",
                        tokens_predicted=predicted, tokens_evaluated=prompt)
        return body

    def _stream(self, prompt: int, events: AsyncIterator) -> AsyncIterator[str]:
        return drive(events, _InfillChunks(self, prompt))


class _InfillChunks(EventEncoder):
    """llama.cpp's /infill stream: a body per event with text (or the end), the last one with the counts."""

    def __init__(self, api: Infill, prompt: int) -> None:
        self.api, self.prompt = api, prompt

    def step(self, step: Step, tally: Tally) -> list[str]:
        event = step.event
        if not (event.text or event.finished):
            return []
        return [sse(self.api._body(event.text, event.finished, self.prompt, tally.tokens, event.finish_reason,
                                   event.stop_reason))]

    def failed(self, error: APIError, tally: Tally) -> list[str]:
        return [sse(error.body())]
