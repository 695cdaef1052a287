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
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...chat import ToolCallDelta
from ...chat.answer import Thinking
from ..http.errors import APIError, bad_request
from ..http.streams import SSEResponse, sse
from ..openai.protocol import ChatCompletionRequest
from ..openai.response_items import OutputItems, assistant_message, response_object, response_usage
from ..openai.responses import ResponsesRequest, chat_body, input_messages
from .chat import Chat, ChatRun
from .serving import collect_choices, parse_body
from .streaming import EventEncoder, Step, Tally, drive
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
        conversation = history + input_messages(req.input, self.vision, _uploaded(request))
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

    def _stream(self, req: Any, chat: ChatCompletionRequest, run: ChatRun,
                conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        return drive(run.events, _ResponseEvents(self, req, chat, run, conversation), run.answer)


class _ResponseEvents(EventEncoder):
    """The Responses API's stream: created and in_progress, the output items' events as the answer's pieces come,
    then the response completed (or incomplete); a failure is an error event (and, for a server error of this
    request, the response failed)."""

    def __init__(self, api: Responses, req: Any, chat: ChatCompletionRequest, run: ChatRun,
                 conversation: list[dict[str, Any]]) -> None:
        self.api, self.req, self.chat, self.run, self.conversation = api, req, chat, run, conversation
        self.items, self.numbered = OutputItems(), _Numbered()

    def start(self) -> list[str]:
        start = response_object(self.run.id, self.req, self.api.settings.model_name, [], "in_progress", None)
        return [self.numbered({"type": "response.created", "response": start}),
                self.numbered({"type": "response.in_progress", "response": start})]

    def step(self, step: Step, tally: Tally) -> list[str]:
        event = step.event
        lp = self.api.logprobs.chat(event.token_ids, event.logprobs, event.top_logprobs, event.hidden_stop)["content"] \
            if self.chat.logprobs else None
        _add(self.items, step.pieces or [], lp)
        return [self.numbered(e) for e in self.items.drain()]

    def failed(self, error: APIError, tally: Tally) -> list[str]:
        frames = [self.numbered(_error_event(error))]
        if error.status == 500:  # generation (or reading its answer) failed for this request
            body = self.api._body(self.run, self.req, self.items, None, tally.tokens, "failed")
            frames.append(self.numbered({"type": "response.failed", "response": body | {
                "error": {"code": "server_error", "message": "generation failed"}}}))
        return frames

    def end(self, tally: Tally) -> list[str]:
        self.items.close()
        frames = [self.numbered(e) for e in self.items.drain()]
        finish_reason = tally.finish.get(0, (None, None))[0]
        body = self.api._body(self.run, self.req, self.items, finish_reason, tally.tokens)
        self.api._keep(self.req, body, self.conversation)
        return frames + [self.numbered({"type": f"response.{body['status']}", "response": body})]


def _uploaded(request: Request) -> Callable[[str, str], bytes] | None:
    """An uploaded file's bytes by id (/v1/files: an input_image's file_id); an unknown id is a 400 naming it."""
    store = getattr(request.app.state, "files", None)
    if store is None:
        return None

    def read(file_id: str, param: str) -> bytes:
        if file_id not in store.files:
            raise bad_request(f"{param}: no file {file_id!r} (upload the image with POST /v1/files first)", param)
        return store.files[file_id].data

    return read


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
        return sse(event, event["type"])
