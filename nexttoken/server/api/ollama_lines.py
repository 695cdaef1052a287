"""Ollama's streams and timings: NDJSON lines (one JSON object a line) for /api/chat and /api/generate, and the
durations of the last object, in nanoseconds."""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import datetime, timezone
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse

from ...chat import ToolCallDelta
from ...chat.answer import Thinking
from ...chat.tools.parser import ToolCall
from ..http.errors import APIError
from ..http.streams import SSEResponse
from ..ollama.protocol import ollama_tool_calls
from .chat import ChatRun
from .streaming import EventEncoder, Step, Tally


class NDJSONResponse(SSEResponse):
    """Ollama's stream: one JSON object a line (application/x-ndjson), stopping (and cancelling the request) when
    the client leaves, as SSEResponse does."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        StreamingResponse.__init__(self, content, media_type="application/x-ndjson")


def line(body: dict[str, Any]) -> str:
    return json.dumps(body) + "\n"


def now() -> str:
    """Ollama's created_at: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclasses.dataclass
class Clock:
    """A request's times in nanoseconds (Ollama's durations): arrival, its first generated token, the end."""

    start: int = dataclasses.field(default_factory=time.monotonic_ns)
    first: int | None = None

    async def timed(self, events: AsyncIterator) -> AsyncIterator:
        """`events` as they come, the first token's time noted."""
        try:
            async for index, event in events:
                if self.first is None and event.token_ids:
                    self.first = time.monotonic_ns()
                yield index, event
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    def final(self, done_reason: str | None, prompt_tokens: int, tokens: int) -> dict[str, Any]:
        """The last body's fields: why it ended, the counts and durations (the model is loaded: no load time)."""
        end = time.monotonic_ns()
        first = self.first or end
        return {"done": True, "done_reason": {"length": "length"}.get(done_reason or "stop", "stop"),
                "total_duration": end - self.start, "load_duration": 0, "prompt_eval_count": prompt_tokens,
                "prompt_eval_duration": first - self.start, "eval_count": tokens, "eval_duration": end - first}


class OllamaLines(EventEncoder):
    """Ollama's NDJSON stream: a line per event with text (thinking and content apart), a line with the calls
    once the answer is done, then the last line with done, the counts and durations (and /api/generate's
    context); a failure is an {"error"} line."""

    def __init__(self, head: dict, run: ChatRun, clock: Clock, kind: str) -> None:
        self.head, self.run, self.clock, self.kind = head, run, clock, kind
        self.ids: list[int] = []
        self.calls: dict[int, list[str]] = {}  # call index -> [id, name, argument text]

    def _body(self, content: str, thinking: str, **more: Any) -> dict[str, Any]:
        if self.kind == "generate":
            return {**self.head, "created_at": now(), "response": content,
                    **({"thinking": thinking} if thinking else {}), **more}
        message = {"role": "assistant", "content": content, **({"thinking": thinking} if thinking else {})}
        return {**self.head, "created_at": now(), "message": message, **more}

    def step(self, step: Step, tally: Tally) -> list[str]:
        self.ids += step.event.token_ids
        content, thinking = [], []
        for piece in step.pieces or []:
            if isinstance(piece, Thinking):
                thinking.append(piece.text)
            elif isinstance(piece, ToolCallDelta):
                call = self.calls.setdefault(piece.index, [piece.id or "", piece.name or "", ""])
                call[2] += piece.arguments
            else:
                content.append(piece)
        lines = [line(self._body("".join(content), "".join(thinking), done=False))] if content or thinking else []
        if step.event.finished and self.calls:
            calls = ollama_tool_calls([ToolCall(*self.calls[k]) for k in sorted(self.calls)])
            if calls:
                lines.append(line({**self.head, "created_at": now(), "message": {
                    "role": "assistant", "content": "", "tool_calls": calls}, "done": False}))
        return lines

    def failed(self, error: APIError, tally: Tally) -> list[str]:
        return [line({"error": error.message})]

    def end(self, tally: Tally) -> list[str]:
        final = self.clock.final(tally.finish.get(0, (None, None))[0], len(self.run.prompt_ids), tally.tokens)
        if self.kind == "generate":
            final["context"] = self.run.prompt_ids + self.ids
        return [line(self._body("", "", **final))]
