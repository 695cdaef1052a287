"""Anthropic's Messages request (`POST /v1/messages`, `/v1/messages/count_tokens`), and its translation into a
Chat Completions request: the one request path serves both APIs.

The field table: `system` -> a system message; content blocks -> messages (`text` -> content, an assistant's
`tool_use` -> its tool_calls with the input as JSON text, a user's `tool_result` -> a tool message, `thinking`
-> the assistant message's reasoning_content, which templates show where their model needs it: gpt-oss's before
a call, Qwen3's within a tool loop); `tools[].input_schema` -> `function.parameters`;
`tool_choice` auto / any / tool / none -> "auto" / "required" / the named function / "none";
`stop_sequences` -> `stop`; `max_tokens`, `temperature`, `top_p`, `top_k` under their own names.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from ..http.errors import bad_request
from ..openai.protocol import PASSED_THROUGH, NullIsAbsent

# Keys a block or tool may carry that change nothing for a local model (prompt caching, citations, how the
# hosted service loads, calls and streams tools: `caller`, `toolset_name` come back null in an SDK block's
# `model_dump()`). tests/server/test_anthropic_fields.py checks these tables against the installed SDK's types.
IGNORED_KEYS = frozenset({"cache_control", "citations", "allowed_callers", "defer_loading", "eager_input_streaming",
                          "strict", "input_examples", "caller", "toolset_name"})
# The fields each content block this server reads carries (the SDK's *BlockParam and response block models).
BLOCK_FIELDS = {"text": ("text",), "tool_use": ("id", "name", "input"), "thinking": ("thinking", "signature"),
                "redacted_thinking": ("data",), "tool_result": ("tool_use_id", "content", "is_error"),
                "image": ("source",)}
# Block types the hosted service writes or reads (its server tools, files, search results): named in the refusal.
_HOSTED_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                  "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                  "tool_search_tool_result", "container_upload", "mcp_tool_use", "mcp_tool_result", "compaction")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Message(_Strict):
    role: Literal["user", "assistant"]  # a system prompt goes in `system`
    content: Union[str, list[dict[str, Any]]]


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted", "updates"] | None = None
    block_binding: dict[str, Any] | None = None  # the hosted service's thinking-block binding: no effect here


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None
    task_budget: dict[str, Any] | None = None  # the hosted agent loop's budget: no effect on one answer


class _Fields(_Strict, NullIsAbsent):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None  # format: structured output (json_schema)
    # Accepted with no effect on a local model.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    container: Union[str, dict[str, Any], None] = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # The beta API's hosted controls (Claude Code sends context_management): no effect on a local model, which
    # neither edits the context nor falls back to other models; mcp_servers is refused when it names servers.
    betas: list[str] | None = None
    billing_policy: Any = None
    compaction: Any = None
    context_management: dict[str, Any] | None = None
    fallback_credit_token: Any = None
    fallbacks: Any = None
    mcp_servers: list[dict[str, Any]] | None = None
    thread: Any = None

class CountTokensRequest(_Fields):
    pass


class _MessagesFields(_Fields):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None


# With vLLM's sampling extras under their chat names (a client's extra_body): one request, one meaning everywhere.
MessagesRequest = create_model(
    "MessagesRequest", __base__=_MessagesFields,
    **{name: (Any, None) for name in PASSED_THROUGH if name not in _MessagesFields.model_fields}  # type: ignore[call-overload]
)


def chat_body(req: _Fields, images: bool = False) -> dict[str, Any]:
    """The Chat Completions body that asks for the same thing; `images`: the model takes images (a user's `image`
    blocks become `image_url` parts; otherwise they are a 400)."""
    if req.mcp_servers:
        raise bad_request("mcp_servers: the MCP connector is a hosted feature (the hosted service calls the "
                          "servers); this server does not reach them: connect the MCP servers in the client and "
                          "send their tools in `tools`", "mcp_servers")
    messages = [{"role": "system", "content": _system(req.system)}] if req.system else []
    for i, m in enumerate(req.messages):
        messages += _messages(m, f"messages[{i}]", images)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if isinstance(req, _MessagesFields):
        body["max_completion_tokens"], body["stream"] = req.max_tokens, req.stream
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        for name in PASSED_THROUGH:
            if name in req.model_fields_set and name != "stop":
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    if req.thinking is not None and req.thinking.type in ("enabled", "disabled"):
        # thinking on or off, in the template variable the thinking templates read (Qwen3's, SmolLM3's, ...)
        kwargs = {"enable_thinking": req.thinking.type == "enabled", **body.get("chat_template_kwargs", {})}
        body["chat_template_kwargs"] = kwargs
        if req.thinking.budget_tokens is not None:
            body["thinking_token_budget"] = req.thinking.budget_tokens
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None and "thinking_token_budget" not in body:
        body["reasoning_effort"] = {"max": "xhigh"}.get(effort, effort)
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"], parallel = _tool_choice(req.tool_choice)
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
    return body


def _system(system: str | list[dict[str, Any]] | None) -> str:
    if isinstance(system, str):
        return system
    return _texts(system or [], "system")


def _texts(blocks: list[Any], where: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{j}] must be a text block {{\"type\": \"text\", \"text\": string}}, got "
                              f"{str(block)[:200]}", f"{where}[{j}]")
        texts.append(block["text"])
    return "".join(texts)


def _messages(m: Message, where: str, images: bool = False) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results become tool messages (first, as they
    answer the turn before), its text (with its images as `image_url` parts, in block order) a user message; an
    assistant's blocks one assistant message."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # a user's text and images in order (as chat content parts)
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(m.content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _HOSTED_BLOCKS:
            raise bad_request(f"{at}: {kind} blocks belong to the hosted service's server tools, which this "
                              "server does not run; send text, tool_use, tool_result or thinking blocks",
                              f"{at}.type")
        if kind not in BLOCK_FIELDS or (kind == "image" and not images):
            why = "this model takes no images" if kind == "image" else "this server reads text and images"
            raise bad_request(f"{at}: content blocks of type {kind!r} are not supported: {why}; send text, "
                              "tool_use, tool_result or thinking blocks", f"{at}.type")
        unknown = set(block) - {"type", *BLOCK_FIELDS[kind], *IGNORED_KEYS}
        if unknown:
            raise bad_request(f"{at}: unknown field(s) {sorted(unknown)} in a {kind} block", at)
        if kind == "text":
            texts.append(_string(block, "text", at))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image":
            if m.role != "user":
                raise bad_request(f"{at}: image blocks belong to user messages", f"{at}.type")
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "tool_use":
            if m.role != "assistant":
                raise bad_request(f"{at}: tool_use blocks belong to assistant messages", f"{at}.type")
            if not isinstance(block.get("input"), dict):
                raise bad_request(f"{at}.input must be an object, got {block.get('input')!r}", f"{at}.input")
            calls.append({"id": _string(block, "id", at), "type": "function",
                          "function": {"name": _string(block, "name", at), "arguments": json.dumps(block["input"])}})
        elif kind == "tool_result":
            if m.role != "user":
                raise bad_request(f"{at}: tool_result blocks belong to user messages", f"{at}.type")
            content = block.get("content", "")
            text = content if isinstance(content, str) else _texts(content, f"{at}.content")
            results.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at), "content": text})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])  # a past turn's reasoning: templates that show it read it
        # redacted_thinking: the hosted service's encrypted reasoning, nothing a local model can read
    if m.role == "user":
        if len(parts) > len(texts):  # images: the content as parts, in block order
            return results + [{"role": "user", "content": parts}]
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking and m.role == "assistant":
        message["reasoning_content"] = "".join(thinking)
    return [message]


def _image_url(source: Any, where: str) -> str:
    """An image block's source as the image_url part's URL: base64 data as a data: URL, a url source as it is
    (the server fetches it only with --allow-remote-images)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request(f"{where}.source: an image block's source is {{\"type\": \"base64\", \"media_type\": "
                      "\"image/png\", \"data\": ...}} or {\"type\": \"url\", \"url\": ...} (file sources are not "
                      f"offered), got {str(source)[:200]}", f"{where}.source")


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string, got {value!r}", f"{where}.{key}")
    return value


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """An Anthropic client tool ({name, description, input_schema}) as a chat function tool."""
    if tool.get("type", "custom") != "custom":
        raise bad_request(f"tools[{i}]: server tools ({tool.get('type')!r}) are not offered by this server; send "
                          "client tools {name, description, input_schema}", f"tools[{i}].type")
    unknown = set(tool) - {"type", "name", "description", "input_schema", *IGNORED_KEYS}
    if unknown:
        raise bad_request(f"tools[{i}]: unknown field(s) {sorted(unknown)}: a tool is {{name, description, "
                          "input_schema}}", f"tools[{i}]")
    if not isinstance(tool.get("input_schema"), dict):
        raise bad_request(f"tools[{i}].input_schema is required: the JSON Schema of the tool's input",
                          f"tools[{i}].input_schema")
    function = {"name": tool.get("name"), "description": tool.get("description"), "parameters": tool["input_schema"]}
    # OpenAI's key order: templates render the tool as JSON, so the order is part of the prompt
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool | None]:
    """(chat tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request(f"tool_choice {choice!r}: send {{\"type\": \"auto\"}}, {{\"type\": \"any\"}}, "
                      "{\"type\": \"none\"} or {\"type\": \"tool\", \"name\": ...}", "tool_choice")
