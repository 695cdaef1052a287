"""The Responses API's output: items (reasoning, message, function_call) built from a choice's pieces, the typed
stream events that build them, and the response object.

One builder serves both ways of answering: a non-streaming response is the builder's items at the end; a stream
sends each event as the builder makes it. So the streamed items are the plain response's items by construction.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ...chat import ToolCallDelta


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """Pieces of one answer in (`reasoning`, `text`, `call`, then `close`); `items` the output so far, `events`
    the stream events since the last `drain` (each `{"type": ..., ...}`, numbered by the writer)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the last item while it is still being written

    def reasoning(self, delta: str) -> None:
        if self._open != "reasoning":
            self._start({"id": _id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                         "content": [{"type": "reasoning_text", "text": ""}]}, "reasoning")
            self._event("response.content_part.added", content_index=0, part={"type": "reasoning_text", "text": ""})
        self._item["content"][0]["text"] += delta
        self._event("response.reasoning_text.delta", content_index=0, delta=delta)

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> None:
        if self._open != "message":
            self._start({"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                         "content": []}, "message")
            self._item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            self._event("response.content_part.added", content_index=0, part=self._part(text=""))
        part = self._item["content"][0]
        part["text"] += delta
        part["logprobs"] += logprobs or []
        self._event("response.output_text.delta", content_index=0, delta=delta, logprobs=logprobs or [])

    def call(self, piece: ToolCallDelta) -> None:
        if piece.id is not None:  # a new call: its id and name first
            self._start({"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": piece.id,
                         "name": piece.name, "arguments": ""}, "function_call")
        if piece.arguments:
            self._item["arguments"] += piece.arguments
            self._event("response.function_call_arguments.delta", delta=piece.arguments)

    def close(self) -> None:
        """The end of the item being written: its closing events."""
        if self._open is None:
            return
        item = self._item
        if self._open == "reasoning":
            text = item["content"][0]["text"]
            self._event("response.reasoning_text.done", content_index=0, text=text)
            self._event("response.content_part.done", content_index=0, part={"type": "reasoning_text", "text": text})
        elif self._open == "message":
            part = item["content"][0]
            self._event("response.output_text.done", content_index=0, text=part["text"], logprobs=part["logprobs"])
            self._event("response.content_part.done", content_index=0, part=self._part(**part))
        else:
            self._event("response.function_call_arguments.done", name=item["name"], arguments=item["arguments"])
        item["status"] = "completed"
        self._open = None
        self.events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                            "item": _copy(item)})

    def drain(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    @property
    def _item(self) -> dict[str, Any]:
        return self.items[-1]

    def _start(self, item: dict[str, Any], kind: str) -> None:
        self.close()
        self.items.append(item)
        self._open = kind
        self.events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                            "item": _copy(item)})

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "item_id": self._item["id"], "output_index": len(self.items) - 1,
                            **fields})

    @staticmethod
    def _part(**part: Any) -> dict[str, Any]:
        return {"type": "output_text", "annotations": [], "logprobs": [], **part}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))  # the item as it is now: later deltas must not change a sent event


def response_object(rid: str, req: Any, model: str, output: list[dict[str, Any]], status: str,
                    usage: dict[str, Any] | None, finish_reason: str | None = None, created: int | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response object, echoing the request's settings as OpenAI does."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": created or int(time.time()), "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": bool(req.store), "temperature": req.temperature, "top_p": req.top_p,
        "text": {"format": fmt}, "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "truncation": req.truncation or "disabled", "usage": usage,
        "user": req.user, "metadata": req.metadata or {},
    }


def response_usage(prompt_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def output_text(output: list[dict[str, Any]]) -> str:
    return "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer as the chat message a later turn (previous_response_id) continues from."""
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    text = output_text(output)
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    thinking = "".join(c.get("text", "") for item in output if item["type"] == "reasoning" for c in item["content"])
    if thinking:
        message["reasoning_content"] = thinking
    return message
