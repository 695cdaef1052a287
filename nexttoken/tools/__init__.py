"""Tool calls: the request's tools (request.py), each model family's call format and grammar (formats.py), and
reading calls out of the output as it streams (parser.py)."""

from .formats import FORMATS, ToolFormat, detect_format, format_named
from .parser import ToolCall, ToolCallDelta, ToolCallParser
from .request import ToolsError, ToolUse, template_messages

__all__ = ["FORMATS", "ToolCall", "ToolCallDelta", "ToolCallParser", "ToolFormat", "ToolUse", "ToolsError",
           "detect_format", "format_named", "template_messages"]
