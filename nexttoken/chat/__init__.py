"""What a chat holds besides plain text: OpenAI messages as chat templates read them (messages.py), thinking
formats and their streaming split (reasoning.py), tool calls (tools/: the request's tools, each family's call
format and grammar, the streaming call parser, the tools preamble), and the split of an answer into thinking,
content and calls that every API uses (answer.py)."""

from .tools.formats import FORMATS, ToolFormat, detect_format, format_named
from .messages import template_messages
from .tools.parser import ToolCall, ToolCallDelta, ToolCallParser
from .tools.preamble import TemplateSupport, template_support, with_preamble
from .tools.request import ToolsError, ToolUse

__all__ = ["FORMATS", "TemplateSupport", "ToolCall", "ToolCallDelta", "ToolCallParser", "ToolFormat", "ToolUse",
           "ToolsError", "detect_format", "format_named", "template_messages", "template_support", "with_preamble"]
