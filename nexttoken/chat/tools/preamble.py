"""Tools for chat templates that do not render them: the definitions and the call format in the system message.

Many templates (SmolLM2's, most fine-tunes' ChatML, Llama 2's) have no tools section: rendered with or without
`tools` the prompt is the same, so under `tool_choice: "auto"` the model never hears of a tool. llama.cpp's
server answers this by writing the tools into the system message for such templates; this module does the same,
with the text of the call format given by `--tool-call-parser` (`ToolFormat.preamble`: Hermes' `<tools>` block,
Llama 3.1's JSON instructions, Mistral's `[AVAILABLE_TOOLS]`). What the template leaves out of a conversation is
filled in the same way: past calls become the assistant turn's text in the format's markup, and tool results,
where a template drops the `tool` role, a user turn in the format's wrapper (Hermes' `<tool_response>`). (A
template that renders the `tool` role, as ChatML does, shows results as they are: wrapping them was tried with
SmolLM2, which then echoed the wrapper instead of answering.) A template that renders tools itself
is left alone. What a template renders is found once per template by rendering probes (`template_support`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .formats import ToolFormat
from ..messages import arguments_text
from ...text.chat_template import RenderLimits

_PROBE = "nexttoken_probe_7f3a"  # a name no template writes by itself
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_CALL = {"id": "call_probe", "type": "function", "function": {"name": _PROBE, "arguments": {}}}


@dataclass(frozen=True)
class TemplateSupport:
    """What a chat template renders of OpenAI's tool use."""

    tools: bool  # the definitions (`tools=`)
    calls: bool  # an assistant turn's `tool_calls`
    results: bool  # a `role: "tool"` message's content


def template_support(tokenizer: Any, limits: RenderLimits = RenderLimits()) -> TemplateSupport:
    """Render probes through `tokenizer`'s chat template (the one it picks for tools) and see what shows. A
    template that fails on a probe does not render that part. `limits` bound each probe as they bound a request's
    rendering (a server's: 2 s), so a runaway template does not hold the server's start for 3 x 10 s."""

    def shows(messages: list[dict], text: str, tools: list | None = None) -> bool:
        try:
            return text in tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                                         limits=limits)
        except Exception:  # noqa: BLE001 - a template is untrusted code; failing on a probe is "does not render"
            return False

    user = {"role": "user", "content": "hi"}
    call = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
    result = {"role": "tool", "tool_call_id": "call_probe", "content": _PROBE + "_result"}
    return TemplateSupport(tools=shows([user], _PROBE, [_PROBE_TOOL]),
                           calls=shows([user, call, {"role": "user", "content": "ok"}], _PROBE, [_PROBE_TOOL]),
                           results=shows([user, call, result], _PROBE + "_result", [_PROBE_TOOL]))


def with_preamble(messages: Sequence[dict[str, Any]], tools: Sequence[Any], format: ToolFormat,
                  support: TemplateSupport) -> list[dict[str, Any]]:
    """Template messages (messages.template_messages) with `tools` shown in the system message in `format`'s
    words, and past calls and results written as text where the template leaves them out."""
    out = [dict(m) for m in messages]
    preamble = format.preamble(tools)
    if out and out[0].get("role") in ("system", "developer"):
        first = out[0]
        out[0] = {**first, "content": f"{first['content']}\n\n{preamble}" if first["content"] else preamble}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    for i, m in enumerate(out):
        if m.get("role") == "assistant" and m.get("tool_calls") and not support.calls:
            written = format.write_calls([(c["function"]["name"], arguments_text(c["function"].get("arguments", {})))
                                          for c in m["tool_calls"]])
            out[i] = {**m, "content": f"{m['content']}\n{written}" if m["content"] else written}
        elif m.get("role") == "tool" and not support.results:  # a user turn in the format's wrapper
            out[i] = {"role": "user", "content": format.write_result(m["content"])}
    return out
