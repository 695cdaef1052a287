"""OpenAI's Responses API request (`POST /v1/responses`), and its translation into a Chat Completions request.

The Responses API is a chat API with other names: `input` items are messages, `function_call` items are an
assistant's `tool_calls`, `function_call_output` items are `tool` messages, `instructions` is the system message,
`text.format` is `response_format`, the tools are flat. `chat_body` writes the request as the chat body the one
request path takes (server/api/chat.py), so every option means what it means there, checked there.
"""

from __future__ import annotations

import base64
from typing import Any, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator, model_validator

from ..http.errors import APIError, bad_request
from .protocol import PASSED_THROUGH, NullIsAbsent
_TEXT_PARTS = ("input_text", "output_text", "text")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextFormat(_Strict):
    """text.format: "text", "json_object", or "json_schema" with the schema inline (flat, unlike chat's)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> "TextFormat":
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError('a "json_schema" format needs its name and schema')
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint for OpenAI's models: no effect here


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summarizer here: the thinking is sent whole
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class _ResponsesFields(_Strict, NullIsAbsent):
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no padding is added here
    store: bool | None = None  # stateless unless true: then kept (bounded) for previous_response_id and GET
    previous_response_id: str | None = None
    include: list[str] | None = None
    # OpenAI's fields with no effect on a local model: accepted so that clients sending them work.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    # Refused when used (in _not_offered): server-side state and modalities this server does not have.
    background: bool | None = None
    conversation: Union[str, dict[str, Any], None] = None
    prompt: dict[str, Any] | None = None


    @field_validator("input")
    @classmethod
    def _input(cls, v: str | list) -> str | list:
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty: send a string or a list of items")
        return v

    @field_validator("background", "conversation", "prompt")
    @classmethod
    def _not_offered(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in (None, False):
            raise ValueError(f"{info.field_name} (OpenAI's stored state and background runs) is not offered by this "
                             "server: send the input items themselves, or previous_response_id")
        return v


ResponsesRequest = create_model(
    "ResponsesRequest", __base__=_ResponsesFields, **{name: (Any, None) for name in PASSED_THROUGH}  # type: ignore[call-overload]
)


def chat_body(req: Any, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The Chat Completions body that asks for the same thing; `conversation`: the messages (a stored earlier
    conversation, then `input_messages(req.input)`), under the request's own instructions."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict[str, Any] = {"messages": system + conversation}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "stream"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    for name in PASSED_THROUGH:
        if name in req.model_fields_set:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort  # a thinking budget (chat/reasoning.py EFFORT_BUDGETS)
    if req.top_logprobs or "message.output_text.logprobs" in (req.include or []):
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
                                                   **({"description": fmt.description} if fmt.description else {})}}
    return body


def input_messages(given: str | list[dict[str, Any]], images: bool = False,
                   files: Callable[[str, str], bytes] | None = None) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; items become messages, a run of function_call
    items one assistant message with those tool_calls (after the assistant's text, when it came first); a
    reasoning item is the next assistant message's reasoning_content (templates that show past thinking read it:
    gpt-oss's before a call, Qwen3's within a tool loop; the others leave it out). `images`: the model takes
    images (`input_image` parts become chat `image_url` parts; otherwise they are a 400); `files(file_id, param)`:
    an uploaded file's bytes (/v1/files), for an input_image given by file_id."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    thinking: str | None = None  # a reasoning item's text, for the assistant message that follows it
    for i, item in enumerate(given):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                                  f"{where}.role")
            messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content", images,
                                                               files)})
            if role == "assistant" and thinking:
                messages[-1]["reasoning_content"] = thinking
            thinking = None
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if thinking:
                    messages[-1]["reasoning_content"] = thinking
            thinking = None
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": output if isinstance(output, str) else _content(output, f"{where}.output", False)})
        elif kind == "reasoning":
            thinking = (thinking or "") + reasoning_text(item)
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not offered by this server; send message, "
                              "function_call, function_call_output or reasoning items", f"{where}.type")
    return messages


def reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its reasoning_text parts (what this server and vLLM send), else its summary's."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(p.get("text") or "" for p in parts if isinstance(p, dict))


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string, got {value!r}", f"{where}.{key}")
    return value


def _content(content: Any, where: str, images: bool,
             files: Callable[[str, str], bytes] | None = None) -> str | list[dict[str, Any]]:
    """A message's content (a string, or parts) as chat content: its text, or (with `input_image` parts, to a
    model that takes images) chat parts in order, each image an `image_url` part; other parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts, got {content!r}", where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and images:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(part, f"{where}[{j}]", files)}})
        elif kind != "refusal":
            why = "this model takes no images" if kind == "input_image" else "this server reads text and images"
            raise bad_request(f"{where}[{j}]: content parts of type {kind!r} are not supported: {why}; send "
                              "input_text parts", f"{where}[{j}].type")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _image_url(part: dict[str, Any], where: str, files: Callable[[str, str], bytes] | None = None) -> str:
    """An input_image part's image: its image_url (a data: URL, or an http(s) URL the server fetches only with
    --allow-remote-images), or an uploaded file's bytes by file_id (as a data: URL); `detail` is accepted (the
    model's processor decides the resolution)."""
    unknown = set(part) - {"type", "image_url", "file_id", "detail"}
    if unknown:
        raise bad_request(f"{where}: unknown field(s) {sorted(unknown)} in an input_image part", where)
    file_id = part.get("file_id")
    if file_id is not None:
        if files is None or not isinstance(file_id, str) or part.get("image_url") is not None:
            raise bad_request(f"{where}.file_id: send either an uploaded image's file id (POST /v1/files) or "
                              "image_url, a data:image/...;base64 URL", f"{where}.file_id")
        return "data:;base64," + base64.b64encode(files(file_id, f"{where}.file_id")).decode()
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}.image_url must be a data:image/...;base64 URL (or an http(s) URL), got "
                          f"{str(url)[:100]!r}", f"{where}.image_url")
    if part.get("detail") not in (None, "auto", "low", "high"):
        raise bad_request(f"{where}.detail must be auto, low or high, got {part['detail']!r}", f"{where}.detail")
    return url


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A flat Responses function tool as a chat tool: {"type": "function", "function": {...}}."""
    if tool.get("type") != "function":
        raise bad_request(f"tools[{i}]: tools of type {tool.get('type')!r} are not offered by this server (it runs "
                          "no hosted tools); send function tools", f"tools[{i}].type")
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise bad_request(f"tools[{i}]: unknown field(s) {sorted(unknown)}: a function tool is {{type, name, "
                          "description, parameters, strict}}", f"tools[{i}]")
    # OpenAI's key order: templates render the tool as JSON, so the order is part of the prompt
    function = {k: tool.get(k) for k in ("name", "description", "parameters", "strict")}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice {choice!r} is not offered: send \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"name\": ...}", "tool_choice")
