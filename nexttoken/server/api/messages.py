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

from ...engine.async_engine import EngineClosedError, EngineDeadError
from ...errors import NextTokenError
from ...tools import ToolCallDelta
from ...tools.answer import Thinking
from ..anthropic.events import ContentBlocks, message_id, message_object, sse_event, stop_reason
from ..anthropic.protocol import CountTokensRequest, MessagesRequest, chat_body
from ..http.errors import APIError, anthropic_error_body, bad_request
from ..http.streams import SSEResponse
from ..openai.protocol import ChatCompletionRequest
from .chat import Chat, ChatRun
from .serving import collect_choices, engine_failure, parse_body, unavailable


class Messages(Chat):
    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_body(MessagesRequest, await request.body())
        chat = _chat_request(chat_body(req))
        run = await self.start_chat(chat, arrival, "msg")
        mid = message_id()
        if req.stream:
            return SSEResponse(self._stream(mid, run))
        choices = await collect_choices(request, 1, run.events)
        if choices is None:
            return Response(status_code=499)
        c = choices[0]
        blocks = ContentBlocks()
        _add(blocks, run.answer().parse(c.text, cut=c.finish_reason == "length"))
        blocks.close()
        stop = stop_reason(c.finish_reason, c.stop_reason, blocks.calls)
        return JSONResponse(message_object(mid, self.settings.model_name, blocks.blocks, stop, len(run.prompt_ids),
                                           len(c.token_ids)))

    async def count_tokens(self, request: Request) -> Response:
        req = parse_body(CountTokensRequest, await request.body())
        prompt = await self.render(_chat_request(chat_body(req)))
        return JSONResponse({"input_tokens": len(prompt.ids)})

    async def _stream(self, mid: str, run: ChatRun) -> AsyncIterator[str]:
        blocks, answer = ContentBlocks(), run.answer()
        yield sse_event({"type": "message_start", "message": message_object(
            mid, self.settings.model_name, [], None, len(run.prompt_ids), 0)})
        yield sse_event({"type": "ping"})
        tokens, finish = 0, (None, None)
        try:
            async for _, event in run.events:
                if event.finish_reason == "error":
                    yield _error(engine_failure(event))
                    return
                tokens += len(event.token_ids)
                _add(blocks, answer.feed(event.text) + (answer.finish(cut=event.finish_reason == "length") if event.finished else []))
                for e in blocks.drain():
                    yield sse_event(e)
                finish = (event.finish_reason, event.stop_reason)
        except NextTokenError as e:
            yield _error(bad_request(str(e)))
            return
        except (EngineClosedError, EngineDeadError) as e:
            yield _error(unavailable(e))
            return
        blocks.close()
        for e in blocks.drain():
            yield sse_event(e)
        reason, sequence = stop_reason(*finish, blocks.calls)
        yield sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": {"output_tokens": tokens}})
        yield sse_event({"type": "message_stop"})


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
