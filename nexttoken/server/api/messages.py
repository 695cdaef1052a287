"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what the `anthropic` SDK and Claude
Code speak, pointed here with ANTHROPIC_BASE_URL), over the chat request path: the request translated by
anthropic/protocol.py, the answer written by anthropic/events.py. Errors on these routes are Anthropic's body
(app.py picks it by path)."""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...chat import ToolCallDelta
from ...chat.answer import Thinking
from ..anthropic.events import ContentBlocks, message_id, message_object, sse_event, stop_reason
from ..anthropic.protocol import CountTokensRequest, MessagesRequest, chat_body
from ..http.errors import APIError, anthropic_error_body
from ..http.streams import SSEResponse
from ..openai.protocol import ChatCompletionRequest
from .chat import Chat, ChatRun
from .serving import collect_choices, parse_body
from .streaming import EventEncoder, Step, Tally, drive


class Messages(Chat):
    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_body(MessagesRequest, await request.body())
        chat = _chat_request(chat_body(req, self.vision))
        run = await self.start_chat(chat, arrival, "msg")
        mid, model = message_id(), self._reported(req.model, run.lora)
        if req.stream:
            return SSEResponse(self._stream(mid, run, model))
        choices = await collect_choices(request, 1, run.events)
        if choices is None:
            return Response(status_code=499)
        c = choices[0]
        blocks = ContentBlocks()
        _add(blocks, run.answer().parse(c.text, cut=c.finish_reason == "length"))
        blocks.close()
        stop = stop_reason(c.finish_reason, c.stop_reason, blocks.calls)
        return JSONResponse(message_object(mid, model, blocks.blocks, stop, len(run.prompt_ids),
                                           len(c.token_ids)))

    async def count_tokens(self, request: Request) -> Response:
        req = parse_body(CountTokensRequest, await request.body())
        prompt = await self.render(_chat_request(chat_body(req, self.vision)))
        return JSONResponse({"input_tokens": len(prompt.ids)})

    def _stream(self, mid: str, run: ChatRun, model: str) -> AsyncIterator[str]:
        return drive(run.events, _MessageEvents(model, mid, run), run.answer)


class _MessageEvents(EventEncoder):
    """Anthropic's stream: message_start and a ping, the content blocks' events as the answer's pieces come, then
    message_delta (the stop reason, the output tokens) and message_stop; a failure is an error event."""

    def __init__(self, model: str, mid: str, run: ChatRun) -> None:
        self.model, self.mid, self.run, self.blocks = model, mid, run, ContentBlocks()

    def start(self) -> list[str]:
        return [sse_event({"type": "message_start", "message": message_object(
            self.mid, self.model, [], None, len(self.run.prompt_ids), 0)}), sse_event({"type": "ping"})]

    def step(self, step: Step, tally: Tally) -> list[str]:
        _add(self.blocks, step.pieces or [])
        return [sse_event(e) for e in self.blocks.drain()]

    def failed(self, error: APIError, tally: Tally) -> list[str]:
        return [_error(error)]

    def end(self, tally: Tally) -> list[str]:
        self.blocks.close()
        frames = [sse_event(e) for e in self.blocks.drain()]
        reason, sequence = stop_reason(*tally.finish.get(0, (None, None)), self.blocks.calls)
        return frames + [sse_event({"type": "message_delta", "delta": {"stop_reason": reason,
                                                                       "stop_sequence": sequence},
                                    "usage": {"output_tokens": tally.tokens}}), sse_event({"type": "message_stop"})]


def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, json.dumps(body).encode())


def _add(blocks: ContentBlocks, pieces: list[Any]) -> None:
    for piece in pieces:
        if isinstance(piece, Thinking):
            blocks.thinking(piece.text)
        elif isinstance(piece, ToolCallDelta):
            blocks.call(piece)
        else:
            blocks.text(piece)


def _error(error: APIError) -> str:
    return sse_event(anthropic_error_body(error.status, error.message))
