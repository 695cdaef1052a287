"""A chat request's tools, validated once: the definitions the template shows, which of them the output may call
(`tool_choice`, `parallel_tool_calls`), the format the model writes calls in, and what that means for generation
(the grammar that keeps calls valid, special tokens kept in the text for the parser).

Tools are OpenAI's `{"type": "function", "function": {"name", "description", "parameters", "strict"}}`; the bare
`{"name", "description", "parameters"}` form transformers' docs use is read too. They reach the chat template
exactly as given, so the prompt is the one transformers' `apply_chat_template(tools=...)` renders.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ...errors import GenerationConfigError
from .formats import ToolFormat, detect_format, format_named
from .parser import ToolCallParser

CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


class ToolsError(GenerationConfigError):
    """Tools, a tool choice or a message's tool calls that cannot be used as given; `param` names the request
    field at fault (for the server's 400)."""

    def __init__(self, message: str, param: str = "tools") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]  # the arguments' JSON Schema (an object schema)


@dataclass(frozen=True)
class ToolUse:
    tools: tuple[Mapping[str, Any], ...]  # as given: what the chat template renders
    functions: tuple[Function, ...]
    choice: str  # "none", "auto", "required", or the name of the one function to call
    parallel: bool  # more than one call in one answer
    format: ToolFormat | None  # None: the model has no known format (then only tool_choice "none" works)

    @classmethod
    def of(cls, tools: Sequence[Any] | None, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
           format: ToolFormat | str | None = None, template: str | None = None) -> "ToolUse | None":
        """Validate a request's tools; None when it has none (and no tool_choice asks for one). `format` is a
        format or its vLLM name; without one it is read off the chat `template`."""
        tools = list(tools or [])
        functions = tuple(_function(t, i) for i, t in enumerate(tools))
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise ToolsError(f"tools: function names must be unique, got {names}")
        choice = _choice(tool_choice, names)
        if not tools:
            return None
        if isinstance(format, str):
            try:
                format = format_named(format)
            except ValueError as e:
                raise ToolsError(str(e)) from None
        format = format or detect_format(template)
        if format is None and choice != "none":
            raise ToolsError(
                "this model's chat template shows no tool-call format this server reads (hermes <tool_call>, "
                "llama3_json, mistral [TOOL_CALLS], openai (gpt-oss's harmony)): set one with --tool-call-parser (tool_call_parser= in the "
                "library), or send tool_choice \"none\"")
        parallel = parallel_tool_calls is not False and choice in CHOICES  # a named function is called once
        return cls(tuple(tools), functions, choice, parallel, format)

    @property
    def calls(self) -> bool:
        """Whether the output may hold calls (and is parsed for them)."""
        return self.choice != "none"

    @property
    def callable_functions(self) -> tuple[Function, ...]:
        if self.choice in CHOICES:
            return self.functions
        return tuple(f for f in self.functions if f.name == self.choice)

    def grammar(self, tokenizer: Any, strict: bool = True) -> str | None:
        """The constraint's Lark grammar (GenerationConfig's `grammar`), or None with tool_choice "none";
        `strict`: GenerationConfig.strict_json_schema for the arguments' schemas."""
        if not self.calls:
            return None
        assert self.format is not None
        return self.format.grammar(self, lambda marker: _single_token(tokenizer, marker), strict)

    def keeps_special_tokens(self, tokenizer: Any) -> bool:
        """Whether the output text must keep special tokens (a marker is one) for the parser to see calls."""
        if not self.calls:
            return False
        assert self.format is not None
        special = tokenizer.skipped_special_ids
        return any(_single_token(tokenizer, m) in special for m in self.format.markers)

    def parser(self) -> ToolCallParser | None:
        if not self.calls:
            return None
        assert self.format is not None
        return self.format.parser()


def _single_token(tokenizer: Any, marker: str) -> int | None:
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _function(tool: Any, index: int) -> Function:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping):
        raise ToolsError(f"{where} must be a dict ({{\"type\": \"function\", \"function\": {{...}}}}), got "
                         f"{type(tool).__name__}")
    if "function" in tool or "type" in tool:
        if tool.get("type") != "function":
            raise ToolsError(f"{where}: only function tools are offered, got type {tool.get('type')!r}")
        fn = tool.get("function")
        where += ".function"
    else:
        fn = tool
    if not isinstance(fn, Mapping):
        raise ToolsError(f"{where} must be a dict with name, description and parameters")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolsError(f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise ToolsError(f"{where}.parameters must be a JSON Schema of an object ({{\"type\": \"object\", "
                         f"\"properties\": {{...}}}}), got {json.dumps(parameters)[:200]}")
    description = fn.get("description")
    return Function(name, description if isinstance(description, str) else None, dict(parameters))


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolsError(f"tool_choice must be one of {list(CHOICES)} or {{\"type\": \"function\", "
                             f"\"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
        if choice == "required" and not names:
            raise ToolsError("tool_choice \"required\" needs tools: send the functions the model may call",
                             "tool_choice")
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        if name not in names:
            raise ToolsError(f"tool_choice names the function {name!r}, which is not among the tools {names}",
                             "tool_choice")
        return name
    raise ToolsError(f"tool_choice must be one of {list(CHOICES)} or {{\"type\": \"function\", \"function\": "
                     f"{{\"name\": ...}}}}, got {choice!r}", "tool_choice")


def tool_options(use: ToolUse, tokenizer: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """Generation options (GenerationConfig's names) with what `use` needs: the grammar that keeps calls valid,
    and special tokens kept in the text when a call marker is one."""
    from ...generation.processors.structured import CONSTRAINTS

    options = dict(options)
    grammar = use.grammar(tokenizer, options.get("strict_json_schema", True) is not False)
    if grammar is not None:
        clash = [name for name in CONSTRAINTS if options.get(name) not in (None, False)]
        if clash:
            raise ToolsError(f"tool_choice {use.choice!r} decodes tool calls under their schemas, which cannot be "
                             f"combined with {clash[0]}: send tool_choice \"none\" to constrain the answer instead",
                             "tool_choice")
        options["grammar"] = grammar
    if use.keeps_special_tokens(tokenizer):
        options["skip_special_tokens"] = False
    return options
