"""Tool calls: the request's tools and `tool_choice` (request.py), each model family's call format and its grammar
(formats.py), the streaming parser that reads calls out of the text (parser.py), and the tools preamble for
templates that render no tools (preamble.py)."""
