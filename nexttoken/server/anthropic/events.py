"""Anthropic's Messages output: content blocks (thinking, text, tool_use) built from a choice's pieces, the stream
events that build them (content_block_start / _delta / _stop), and the message object.

As with the Responses API, one builder serves both answers: the message's blocks are what the events built."""

from __future__ import annotations

import json
import uuid
from typing import Any

from ...chat import ToolCallDelta
from ..http.streams import sse

# (finish_reason, whether calls were made) -> Anthropic's stop_reason
def stop_reason(finish_reason: str | None, stop: int | str | None, calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a stop string that matched is a "stop_sequence", named."""
    if finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic writes them (toolu_...)."""
    return "toolu_" + call_id.removeprefix("call_")


class ContentBlocks:
    """Pieces of one answer in (`thinking`, `text`, `call`, then `close`); `blocks` the content, `events` the
    stream events since the last `drain`."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open: str | None = None
        self._arguments = ""  # the open tool_use block's input, as JSON text so far

    def thinking(self, delta: str) -> None:
        if self._open != "thinking":
            self._start({"type": "thinking", "thinking": "", "signature": ""})
        self.blocks[-1]["thinking"] += delta
        self._delta({"type": "thinking_delta", "thinking": delta})

    def text(self, delta: str) -> None:
        if self._open != "text":
            self._start({"type": "text", "text": ""})
        self.blocks[-1]["text"] += delta
        self._delta({"type": "text_delta", "text": delta})

    def call(self, piece: ToolCallDelta) -> None:
        if piece.id is not None:
            self._start({"type": "tool_use", "id": tool_use_id(piece.id), "name": piece.name, "input": {}})
        if piece.arguments:
            self._arguments += piece.arguments
            self._delta({"type": "input_json_delta", "partial_json": piece.arguments})

    def close(self) -> None:
        if self._open is None:
            return
        if self._open == "tool_use":
            self.blocks[-1]["input"] = json.loads(self._arguments) if self._arguments.strip() else {}
            self._arguments = ""
        self.events.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
        self._open = None

    def drain(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    @property
    def calls(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def _start(self, block: dict[str, Any]) -> None:
        self.close()
        self.blocks.append(block)
        self._open = block["type"]
        self.events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                            "content_block": json.loads(json.dumps(block))})

    def _delta(self, delta: dict[str, Any]) -> None:
        self.events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})


def message_object(mid: str, model: str, content: list[dict[str, Any]], stop: tuple[str, str | None] | None,
                   input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0] if stop else None, "stop_sequence": stop[1] if stop else None,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def sse_event(event: dict[str, Any]) -> str:
    """An event as Anthropic streams it: named by its type."""
    return sse(event, event["type"])
