"""Tool calls: the request's tools (request.py), each model family's call format and grammar (formats.py), reading
calls out of the output as it streams (parser.py), OpenAI messages as chat templates read them (messages.py), and
the tools preamble for templates that do not render tools (preamble.py)."""

from .formats import FORMATS, ToolFormat, detect_format, format_named
from .messages import template_messages
from .parser import ToolCall, ToolCallDelta, ToolCallParser
from .preamble import TemplateSupport, template_support, with_preamble
from .request import ToolsError, ToolUse

__all__ = ["FORMATS", "TemplateSupport", "ToolCall", "ToolCallDelta", "ToolCallParser", "ToolFormat", "ToolUse",
           "ToolsError", "detect_format", "format_named", "template_messages", "template_support", "with_preamble"]
