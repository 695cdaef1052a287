"""OpenAI chat messages as chat templates read them: the one normalisation every chat API calls before rendering.

Clients send what OpenAI accepts, and templates were written for transformers' plain dicts. vLLM bridges the same
gap the same way; each rule is what an agent loop sends on its second turn:

- `content` null or absent (an assistant turn that only calls tools: the openai SDK's loop, the Agents SDK,
  LangChain, pydantic-ai) -> `""`: templates do `'...' + message['content']`.
- `content` as a list of parts -> the text parts joined (`{"type": "text", "text": ...}`; refusal parts are not
  prompt text; other kinds are refused by the API that accepted them).
- `content` with image parts (issue 43: OpenAI's `{"type": "image_url", "image_url": {"url": ...}}`, the
  Responses API's `input_image`, the library's `{"type": "image", "image": source}`) -> a list of `{"type": "text",
  "text": ...}` and `{"type": "image"}` parts, in order, as transformers' multimodal chat templates read them; the
  images' sources, in message order, come from `message_images`.
- a tool result's content that is not a string (a JSON object or list, as some frameworks send) -> its JSON.
- a past call's `arguments`, a JSON string on the wire -> the object (templates render it with `tojson`); a string
  that is not valid JSON (a call cut off by max_tokens, sent back as it came) is passed to the template as the
  string, as vLLM does.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Mapping, Sequence


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages -> new dicts for a chat template (see the module docstring); the input is not
    modified. Fields other than `content` and `tool_calls` pass as given."""
    out = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if _has_images(content):
            message["content"] = [{"type": "image"} if p.get("type") in IMAGE_PARTS
                                  else {"type": "text", "text": p.get("text") or ""}
                                  for p in content if p.get("type") in IMAGE_PARTS + TEXT_PARTS]
        else:
            message["content"] = message_text(content, message.get("role"))
        calls = message.get("tool_calls")
        if calls:
            message["tool_calls"] = [_template_call(call) for call in calls]
        elif "tool_calls" in message:
            del message["tool_calls"]  # [] or None: no calls (a template tests `if message.tool_calls`)
        out.append(message)
    return out


def message_images(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The source of every image part of the messages, in order (a URL or data: URL string, or what the library's
    `{"type": "image", "image": ...}` part holds: a path, bytes, a PIL image, an array); images/source.py loads
    them."""
    return [_image_source(p) for m in messages if _has_images(m.get("content")) for p in m["content"]
            if p.get("type") in IMAGE_PARTS]


def _has_images(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") in IMAGE_PARTS for p in content)


def _image_source(part: Mapping[str, Any]) -> Any:
    """An image part's source: image_url's {"url": ...} (or the URL itself), input_image's image_url, image's
    image."""
    if part["type"] == "image":
        return part.get("image")
    url = part.get("image_url")
    return url.get("url") if isinstance(url, Mapping) else url


def message_text(content: Any, role: str | None = None) -> str:
    """A message's content as the one string a template renders."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and "type" in p for p in content):
        return "".join(p.get("text") or "" for p in content if p["type"] in TEXT_PARTS)
    return json.dumps(content, ensure_ascii=False)  # a tool result given as a JSON value


TEXT_PARTS = ("text", "input_text", "output_text")
IMAGE_PARTS = ("image_url", "input_image", "image")


def _template_call(call: Any) -> Any:
    call = copy.deepcopy(dict(call)) if isinstance(call, Mapping) else call
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass  # not JSON (a call cut off by max_tokens): the template gets the string, as vLLM passes it
    return call


def arguments_text(arguments: Any) -> str:
    """A past call's arguments (an object, or a string that was not JSON) as the text the model wrote."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
