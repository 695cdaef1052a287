"""The model families' tool-call formats: how each writes a call, how to read it back, and its grammar.

Each format is what its models were trained to write (and what their chat templates render for past calls), under
vLLM's `--tool-call-parser` name:

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one
  block per call, after any text;
- `llama3_json` (Llama 3.1 to 3.3): the whole answer is `{"name": "f", "parameters": {...}}`, calls separated
  by `; `, optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]` (v3 tokenizers), or
  `[TOOL_CALLS]f[ARGS]{...}` per call (v11+), after any text;
- `openai` (gpt-oss's harmony): a message on the commentary channel addressed `to=functions.f`, its body the
  arguments' JSON, ended by `<|call|>` (a stop token: one call per answer), after any analysis messages; read
  by chat/harmony.py's parser together with the reasoning and the answer.

The grammar (llguidance's Lark) is the constraint of a request with tools: with `tool_choice` "required" or a
named function the output is calls only; with "auto" the text is free until the model opens a call, and from there
the call must be one of the tools with arguments valid under its JSON Schema. A marker that is one token of the
tokenizer (Qwen's `<tool_call>`, Llama's `<|python_tag|>`, Mistral's `[TOOL_CALLS]`) is written as that token.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Protocol, Sequence

from ...errors import GenerationConfigError
from ...generation.values import bounded_schema
from .parser import Reader, ToolCallParser, openai_call_id, random_id


class ToolUse(Protocol):
    """What a format's grammar reads of a request's tools (request.ToolUse, passed in: formats sit below it)."""

    choice: str
    parallel: bool

    @property
    def callable_functions(self) -> Sequence[Any]: ...

# Arguments are written as json.dumps writes them (the templates render past calls so): no free whitespace.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TokenOf = Callable[[str], "int | None"]  # a marker -> its token id when the tokenizer has it as one token


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal (JSON's escapes are Lark's)


def _arguments_schema(parameters: dict[str, Any], strict: bool, layout: dict[str, Any] = _JSON_LAYOUT) -> str:
    """The arguments' JSON grammar: as clients write schemas (values.bounded_schema), unless `strict` is False."""
    schema = bounded_schema(parameters) if strict else dict(parameters)
    schema.setdefault("type", "object")
    schema["x-guidance"] = layout
    return "%json " + json.dumps(schema)


class ToolFormat:
    name: str
    opening: str  # the marker that opens the calls
    markers: tuple[str, ...] = ()  # the format's marker strings, which the parser must see in the text
    args_key = "arguments"

    def parser(self) -> ToolCallParser:
        raise NotImplementedError

    # ---- for chat templates that do not render tools (preamble.py): the format in words and past calls as text
    def preamble(self, tools: Sequence[Any]) -> str:
        """The system message's text that shows `tools` (OpenAI's dicts) and how to call them, as the format's own
        models were shown them."""
        raise NotImplementedError

    def write_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """Past calls, (name, arguments JSON text) each, written as the model writes them."""
        raise NotImplementedError

    def write_result(self, content: str) -> str:
        """A tool's result, for a template that renders no tool messages: a user turn's text."""
        return content

    @staticmethod
    def detect(template: str) -> bool:
        raise NotImplementedError

    def grammar(self, use: "ToolUse", token_of: TokenOf, strict: bool = True) -> str:
        """The Lark grammar of the output under `use` (its choice decides: "auto", "required" or one function);
        `strict`: the arguments' schemas as clients write them (GenerationConfig.strict_json_schema)."""
        lines = ["%llguidance {}", f"start: {self._start(use, token_of)}"]
        functions = use.callable_functions
        lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
        for i, fn in enumerate(functions):
            head = "{" + f'"name": {json.dumps(fn.name)}, "{self.args_key}": '
            lines.append(f"call_{i}: {_lit(head)} {_arguments_schema(fn.parameters, strict)} {_lit('}')}")
        lines.append(r"TEXT: /(.|\n)+/")
        return "\n".join(lines) + "\n" + self._extra_rules(use, token_of)

    def _start(self, use: "ToolUse", token_of: TokenOf) -> str:
        """The output: calls, opened by the format's marker; with "auto", after any text. Where the marker is one
        token, the text (which cannot contain that token) ends at it; where it is plain text, the text is a lazy
        lexeme ending at the marker's first appearance (llguidance's trigger mode)."""
        rest = self._after_opening(use, token_of)
        calls = f"{self._marker(self.opening, token_of)} {rest}"
        if use.choice != "auto":
            return calls
        if token_of(self.opening) is None:
            return f"TEXT? | before_call {rest}"
        return f"TEXT? | TEXT? {calls}"

    def _after_opening(self, use: "ToolUse", token_of: TokenOf) -> str:
        """The calls' grammar after the opening marker."""
        raise NotImplementedError

    def _extra_rules(self, use: "ToolUse", token_of: TokenOf) -> str:
        if use.choice == "auto" and token_of(self.opening) is None:
            marker = re.escape(self.opening).replace("/", "\\/")  # a regex literal inside Lark's /.../
            return f"before_call[lazy]: /(.|\\n)*{marker}/\n"
        return ""

    def _marker(self, marker: str, token_of: TokenOf) -> str:
        token = token_of(marker)
        return f"<[{token}]>" if token is not None else _lit(marker)


class Hermes(ToolFormat):
    name = "hermes"
    opening = "<tool_call>"
    markers = ("<tool_call>", "</tool_call>")

    @staticmethod
    def detect(template: str) -> bool:
        return "<tool_call>" in template

    def parser(self) -> ToolCallParser:
        return _HermesParser()

    def preamble(self, tools: Sequence[Any]) -> str:  # Hermes 2 Pro's, as Qwen2.5's template words it
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                f"with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")

    def write_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return "\n".join(f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n</tool_call>'
                         for name, args in calls)

    def write_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def _after_opening(self, use: "ToolUse", token_of: TokenOf) -> str:
        opening, closing = (self._marker(m, token_of) for m in self.markers)
        rest = f'"\\n" call "\\n" {closing}'
        return f'{rest} ("\\n" {opening} {rest})*' if use.parallel else rest


class _HermesParser(ToolCallParser):
    def _read(self) -> Reader:
        strip = False
        while True:
            if (yield from self._text_until(("<tool_call>",), strip)) is None:
                return
            first = yield from self._skip_space()
            if first == "{":
                left = yield from self._call_object()
                self._text(left or "")
            else:
                self._unget(first)
            yield from self._expect("</tool_call>")
            strip = True


class Llama3Json(ToolFormat):
    name = "llama3_json"
    opening = "<|python_tag|>"
    markers = ("<|python_tag|>",)
    args_key = "parameters"

    @staticmethod
    def detect(template: str) -> bool:
        return "<|python_tag|>" in template or ('"parameters": ' in template and "<|start_header_id|>" in template)

    def parser(self) -> ToolCallParser:
        return _Llama3Parser()

    def preamble(self, tools: Sequence[Any]) -> str:  # Llama 3.1's JSON tool calling, as its template words it
        listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
                "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n" + listed)

    def write_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return "; ".join(f'{{"name": {json.dumps(name)}, "parameters": {args}}}' for name, args in calls)

    def _start(self, use: "ToolUse", token_of: TokenOf) -> str:
        calls = 'call ("; " call)*' if use.parallel else "call"
        if use.choice != "auto":
            return calls
        # An answer is text that does not start with "{" (a call does), or calls after <|python_tag|>.
        tag = token_of("<|python_tag|>")
        return f"ANSWER? | {calls}" + (f" | <[{tag}]> {calls}" if tag is not None else "")

    def _extra_rules(self, use: "ToolUse", token_of: TokenOf) -> str:
        return "ANSWER: /[^{](.|\\n)*/\n"


class _Llama3Parser(ToolCallParser):
    def _read(self) -> Reader:
        first = yield from self._getc()
        self._unget(first)
        if first != "{" and (yield from self._text_until(Llama3Json.markers)) is None:
            return
        while True:
            while True:  # calls, separated by ";"
                ch = yield from self._skip_space()
                if ch != "{":
                    self._unget(ch)
                    break
                left = yield from self._call_object()
                if left:
                    self._text(left)
                    break
                if not (yield from self._expect(";")):
                    break
            if (yield from self._text_until(Llama3Json.markers, strip_leading=True)) is None:
                return


class Mistral(ToolFormat):
    name = "mistral"
    opening = "[TOOL_CALLS]"
    markers = ("[TOOL_CALLS]",)

    @staticmethod
    def detect(template: str) -> bool:
        return "[TOOL_CALLS]" in template

    def parser(self) -> ToolCallParser:
        return _MistralParser(mistral_call_id)

    def preamble(self, tools: Sequence[Any]) -> str:  # Mistral's [AVAILABLE_TOOLS] block, and the call layout
        return (f"[AVAILABLE_TOOLS] {json.dumps(list(tools), ensure_ascii=False)}[/AVAILABLE_TOOLS]\n\nTo call "
                "functions, answer with [TOOL_CALLS] and a JSON list of calls: [TOOL_CALLS] [{\"name\": "
                "<function-name>, \"arguments\": <args-json-object>}]")

    def write_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return "[TOOL_CALLS] [" + ", ".join(f'{{"name": {json.dumps(name)}, "arguments": {args}}}'
                                             for name, args in calls) + "]"

    def write_result(self, content: str) -> str:
        return f"[TOOL_RESULTS] {content}[/TOOL_RESULTS]"

    def _after_opening(self, use: "ToolUse", token_of: TokenOf) -> str:
        return '" [" call (", " call)* "]"' if use.parallel else '" [" call "]"'


class _MistralParser(ToolCallParser):
    def _read(self) -> Reader:
        strip = False
        while True:
            if (yield from self._text_until(("[TOOL_CALLS]",), strip)) is None:
                return
            strip = True
            first = yield from self._skip_space()
            if first == "[":  # v3: a JSON list of call objects
                while True:
                    ch = yield from self._skip_space()
                    if ch != "{":
                        self._unget(ch if ch != "]" else None)
                        break
                    left = yield from self._call_object()
                    if left:
                        self._text(left)
                        break
                    if not (yield from self._expect(",")):
                        yield from self._expect("]")
                        break
            elif first is not None:  # v11: name[ARGS]{...}, with an optional [CALL_ID]id before [ARGS]
                name, marker = yield from self._until(("[ARGS]", "[CALL_ID]"))
                if marker == "[CALL_ID]":
                    _, marker = yield from self._until(("[ARGS]",))
                if marker is None:
                    if not self._cut:  # a cut call's start is markup, not content
                        self._text("[TOOL_CALLS]" + first + name)
                    continue
                self._start_call((first + name).strip())
                value = yield from self._skip_space()
                if value is not None and (yield from self._json_value(value, self._arguments)):
                    self._open = False


class Harmony(ToolFormat):
    """gpt-oss's calls (chat/harmony.py). Its grammar is the whole answer's, since harmony's markers are special
    tokens that free text cannot hold: analysis and commentary messages, then the final answer ("auto") or one
    call, `<|start|>assistant to=functions.f<|channel|>commentary <|constrain|>json<|message|>{...}` or with the
    recipient after the channel; the stop tokens (`<|call|>`, `<|return|>`) end it. The arguments are written
    compact, as OpenAI's harmony examples write them."""

    name = "openai"
    opening = " to=functions."
    markers = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>")
    layout = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    @staticmethod
    def detect(template: str) -> bool:
        return "<|channel|>" in template and "<|message|>" in template

    def parser(self) -> ToolCallParser:
        raise NotImplementedError("harmony's calls are read with its thinking and content, by chat/harmony.py's "
                                  "HarmonyParser (ChatPrompt.answer picks it)")

    def preamble(self, tools: Sequence[Any]) -> str:  # the developer message's tools, as gpt-oss's template words it
        lines = ["# Tools", "", "## functions", "", "namespace functions {", ""]
        for tool in tools:
            fn = tool.get("function", tool)
            if fn.get("description"):
                lines.append(f"// {fn['description']}")
            lines += [f"type {fn['name']} = (_: {json.dumps(fn.get('parameters') or {}, ensure_ascii=False)}) "
                      "=> any;", ""]
        return "\n".join(lines + ["} // namespace functions"])

    def write_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return "".join(f"<|start|>assistant to=functions.{name}<|channel|>commentary <|constrain|>json<|message|>"
                       f"{args}<|call|>" for name, args in calls)

    def grammar(self, use: "ToolUse", token_of: TokenOf, strict: bool = True) -> str:
        start, end, message, channel, constrain = self._tokens(token_of)
        ctype = f'(" " {constrain}? "json")?'
        lines = ["%llguidance {}", f"start: head* {'(final | call)' if use.choice == 'auto' else 'call'}",
                 self._head(token_of), f'final: {channel} "final" {message} TEXT?',
                 "call: " + " | ".join(f"call_{i}" for i in range(len(use.callable_functions)))]
        for i, fn in enumerate(use.callable_functions):
            name = _lit(fn.name)
            lines.append(f'call_{i}: (" to=functions." {name} {channel} "commentary" | {channel} '
                         f'"commentary to=functions." {name}) {ctype} {message} args_{i}')
            lines.append(f"args_{i}: {_arguments_schema(fn.parameters, strict, self.layout)}")
        lines.append(r"TEXT: /(.|\n)+/")
        return "\n".join(lines) + "\n"

    def final_grammar(self, body: str, token_of: TokenOf) -> str:
        """The answer's grammar with the final message's body under `body` (a Lark rule's right side, e.g. a
        `%json {...}` schema): analysis and commentary messages first, as gpt-oss writes them (structured output:
        the constraint applies to the answer, not to the thinking)."""
        start, end, message, channel, constrain = self._tokens(token_of)
        return "\n".join(["%llguidance {}", "start: head* final", self._head(token_of),
                          f'final: {channel} "final" (" " {constrain}? "json")? {message} body', f"body: {body}",
                          r"TEXT: /(.|\n)+/"]) + "\n"

    def _tokens(self, token_of: TokenOf) -> list[str]:
        """<|start|>, <|end|>, <|message|>, <|channel|>, <|constrain|> as Lark's token references."""
        tokens = {m: token_of(m) for m in self.markers[:5]}
        missing = [m for m, t in tokens.items() if t is None]
        if missing:
            raise GenerationConfigError(f"harmony's markers {missing} are not single tokens of this tokenizer, so its "
                                        "answer cannot be constrained: use gpt-oss's tokenizer (o200k_harmony)")
        return [f"<[{tokens[m]}]>" for m in self.markers[:5]]

    def _head(self, token_of: TokenOf) -> str:
        """An analysis or commentary message, then the next message's start."""
        start, end, message, channel, _ = self._tokens(token_of)
        return f'head: {channel} ("analysis" | "commentary") {message} TEXT? {end} {start} "assistant"'


def mistral_call_id() -> str:
    """Mistral's templates want call ids of exactly 9 letters and digits."""
    return random_id(9)


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral(), Harmony())}


def format_named(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}: choose one of {sorted(FORMATS)}") from None


def detect_format(template: str | None) -> ToolFormat | None:
    """The format a chat template renders past tool calls in, or None if it shows none of them."""
    if not template:
        return None
    return next((f for f in FORMATS.values() if f.detect(template)), None)


__all__ = ["FORMATS", "ToolFormat", "detect_format", "format_named", "openai_call_id"]
