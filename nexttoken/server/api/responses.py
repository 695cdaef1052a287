"""POST /v1/responses: OpenAI's Responses API, over the chat request path (the request translated by
openai/responses.py, the output built by openai/response_items.py); GET and DELETE /v1/responses/{id} for the
responses a client asked to `store`.

Stateless by default: a response is kept only with `store: true`, in a bounded in-memory store (the newest 64,
64 MiB at most, as traces are), for `previous_response_id` and GET.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...engine.async_engine import EngineClosedError, EngineDeadError
from ...errors import NextTokenError
from ...chat import ToolCallDelta
from ...chat.answer import Thinking
from ..http.errors import APIError, client_error
from ..http.streams import SSEResponse
from ..openai.protocol import ChatCompletionRequest
from ..openai.response_items import OutputItems, assistant_message, response_object, response_usage
from ..openai.responses import ResponsesRequest, chat_body, input_messages
from .chat import Chat, ChatRun
from .serving import collect_choices, engine_failure, parse_body, unavailable
from .traces import DEFAULT_BUDGET_BYTES, DEFAULT_CAPACITY


class ResponseStore:
    """Stored responses (the object, and the conversation a next turn continues), newest kept, bounded in count
    and bytes like the trace store."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.capacity, self.budget_bytes = capacity, budget_bytes
        self.kept: OrderedDict[str, tuple[str, list[dict[str, Any]]]] = OrderedDict()
        self.bytes = 0

    def add(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        text = json.dumps(body)
        self.kept[body["id"]] = (text, conversation)
        self.bytes += len(text) + len(json.dumps(conversation))
        while len(self.kept) > 1 and (len(self.kept) > self.capacity or self.bytes > self.budget_bytes):
            self._drop(next(iter(self.kept)))

    def get(self, rid: str, param: str = "response_id") -> tuple[str, list[dict[str, Any]]]:
        if rid not in self.kept:
            raise APIError(404, f"no stored response {rid!r}: responses are kept only when sent with \"store\": "
                                f"true, and this server keeps the newest {self.capacity}", param,
                           type="invalid_request_error", code="response_not_found")
        return self.kept[rid]

    def _drop(self, rid: str) -> None:
        text, conversation = self.kept.pop(rid)
        self.bytes -= len(text) + len(json.dumps(conversation))


class Responses(Chat):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stored = ResponseStore()

    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_body(ResponsesRequest, await request.body())
        history = self.stored.get(req.previous_response_id, "previous_response_id")[1] if req.previous_response_id else []
        conversation = history + input_messages(req.input)
        chat: ChatCompletionRequest = parse_body(ChatCompletionRequest, json.dumps(chat_body(req, conversation)).encode())
        run = await self.start_chat(chat, arrival, "resp")
        if req.stream:
            return SSEResponse(self._stream(req, chat, run, conversation))
        choices = await collect_choices(request, 1, run.events)
        if choices is None:
            return Response(status_code=499)
        c = choices[0]
        items = OutputItems()
        lp = self.logprobs.chat(c.token_ids, c.logprobs, c.top_logprobs, c.hidden_stop)["content"] if chat.logprobs else None
        _add(items, run.answer().parse(c.text, cut=c.finish_reason == "length"), lp)
        items.close()
        body = self._body(run, req, items, c.finish_reason, len(c.token_ids))
        self._keep(req, body, conversation)
        return JSONResponse(body)

    async def get(self, response_id: str) -> Response:
        return Response(self.stored.get(response_id)[0], media_type="application/json")

    async def delete(self, response_id: str) -> Response:
        self.stored.get(response_id)
        self.stored._drop(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def _body(self, run: ChatRun, req: Any, items: OutputItems, finish_reason: str | None, tokens: int,
              status: str | None = None) -> dict[str, Any]:
        status = status or ("incomplete" if finish_reason == "length" else "completed")
        thinking = "".join(c["text"] for item in items.items if item["type"] == "reasoning" for c in item["content"])
        reasoning = len(self.tokenizer.encode(thinking, add_special_tokens=False)) if thinking else 0
        return response_object(run.id, req, self.settings.model_name, items.items, status,
                               response_usage(len(run.prompt_ids), tokens, reasoning))

    def _keep(self, req: Any, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if req.store:
            self.stored.add(body, conversation + [assistant_message(body["output"])])

    async def _stream(self, req: Any, chat: ChatCompletionRequest, run: ChatRun,
                      conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        numbered = _Numbered()
        items, answer = OutputItems(), run.answer()
        start = response_object(run.id, req, self.settings.model_name, [], "in_progress", None)
        yield numbered({"type": "response.created", "response": start})
        yield numbered({"type": "response.in_progress", "response": start})
        tokens, finish_reason = 0, None
        try:
            async for _, event in run.events:
                if event.finish_reason == "error":
                    yield numbered(_error_event(engine_failure(event)))
                    yield numbered({"type": "response.failed", "response": self._body(
                        run, req, items, None, tokens, "failed") | {"error": {"code": "server_error",
                                                                               "message": "generation failed"}}})
                    return
                tokens += len(event.token_ids)
                lp = self.logprobs.chat(event.token_ids, event.logprobs, event.top_logprobs, event.hidden_stop)["content"] \
                    if chat.logprobs else None
                _add(items, answer.feed(event.text) + (answer.finish(cut=event.finish_reason == "length") if event.finished else []), lp)
                for e in items.drain():
                    yield numbered(e)
                finish_reason = event.finish_reason
        except (EngineClosedError, EngineDeadError) as e:  # before NextTokenError, their base: a 503
            yield numbered(_error_event(unavailable(e)))
            return
        except NextTokenError as e:
            yield numbered(_error_event(client_error(e)))
            return
        items.close()
        for e in items.drain():
            yield numbered(e)
        body = self._body(run, req, items, finish_reason, tokens)
        self._keep(req, body, conversation)
        yield numbered({"type": f"response.{body['status']}", "response": body})


def _add(items: OutputItems, pieces: list[Any], logprobs: list | None) -> None:
    """A choice's pieces into the output items; the event's log-probs go with its first text."""
    for piece in pieces:
        if isinstance(piece, Thinking):
            items.reasoning(piece.text)
        elif isinstance(piece, ToolCallDelta):
            items.call(piece)
        else:
            items.text(piece, logprobs)
            logprobs = None


def _error_event(error: APIError) -> dict[str, Any]:
    return {"type": "error", "code": error.code or error.type, "message": error.message, "param": error.param}


class _Numbered:
    """Each event as SSE, named by its type and numbered in order (`sequence_number`), as OpenAI sends them."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, event: dict[str, Any]) -> str:
        event["sequence_number"], self.next = self.next, self.next + 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
