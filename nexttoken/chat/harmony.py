"""Harmony, gpt-oss's chat format: an answer is a run of messages, each on a channel, and the parser that splits
it as it streams into what the APIs report separately.

After the prompt's `<|start|>assistant`, the model writes messages such as

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(one line each here; the text has no newlines between them). A message's header (its role after `<|start|>`, the
`<|channel|>` name, a recipient `to=...` before or after the channel, a content type after `<|constrain|>`) ends
at `<|message|>`; its body at `<|end|>`, `<|call|>` (a tool call: a stop token) or `<|return|>` (the answer's end:
a stop token). The channels, as OpenAI's harmony spec and vLLM read them:
- `analysis`: the chain of thought -> reasoning (reasoning_content, reasoning items, thinking blocks);
- `commentary` addressed `to=functions.NAME`: a call of the request's tool NAME, its body the arguments' JSON ->
  tool_calls, function_call items, tool_use blocks; without a recipient, a preamble to the user -> content;
- `final`: the answer -> content.
A message to another recipient (the built-in `browser` / `python` tools, or a function when the request allows no
calls) is the model's own work, not the user's: reasoning. A text that does not start as harmony (a model that was
not trained on it) is content.

Why a parser of our own and not OpenAI's `openai-harmony` package (its StreamableParser): that one parses token
ids of the o200k_harmony vocabulary only (and fetches the vocabulary file from the network on first use), so it
cannot read a GGUF's or another tokenizer's ids, and it raises on text that strays from the grammar, where a
server must still answer. This parser reads the decoded text (special tokens kept), a character at a time through
the same states whatever the chunking, and emits only what is decided: a possible start of a marker is held back,
a header is never emitted, so no prefix of an answer leaks markup (`<|start|>`, `<|channel|>`, `<|message|>`,
`<|end|>`, `<|call|>`, `<|return|>`, `<|constrain|>`, channel names). The tests check it against openai-harmony's
own renderer where that package can be used.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import NextTokenError
from ..generation.processors.structured import JSON_LAYOUTS
from ..generation.values import bounded_schema
from .answer import AnswerParser, Thinking, _merged
from .reasoning import EFFORT_BUDGETS
from .tools.formats import format_named
from .tools.parser import ToolCall, ToolCallDelta, openai_call_id

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_ENDS = (END, RETURN, CALL)  # what ends a message's body
_HEADER_CHARS = re.compile(r"[A-Za-z0-9_.=:/ -]*")  # a header's text outside its markers
_HEADER_MAX = 256  # a longer "header" is not one: the text is not harmony
_OPENINGS = (START, CHANNEL, " to=", CONSTRAIN, MESSAGE)  # how a header begins
FUNCTIONS = "functions."

# OpenAI's reasoning.effort names (and Anthropic's, mapped to them) as harmony's three levels.
EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}


def detect(template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's: `<|channel|>` and `<|message|>` in it)."""
    return bool(template) and CHANNEL in template and MESSAGE in template  # type: ignore[operator]


def effort(reasoning_effort: str | None = None, budget: int | None = None,
           enable_thinking: bool | None = None) -> str | None:
    """The system message's `Reasoning: low|medium|high` for a request's reasoning_effort (OpenAI's names), else
    its thinking budget in tokens (Anthropic's thinking.budget_tokens: up to 1024 low, up to 4096 medium, more
    high, as chat/reasoning.py's EFFORT_BUDGETS name them), else thinking switched off (low: gpt-oss always
    reasons); None: the template's default (medium)."""
    if reasoning_effort is not None:
        return EFFORTS[reasoning_effort]
    if budget is not None:
        return "low" if budget <= EFFORT_BUDGETS["low"] else "medium" if budget <= EFFORT_BUDGETS["medium"] else "high"
    if enable_thinking is False:
        return "low"
    return None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages (chat.messages.template_messages') as the gpt-oss template takes them. An assistant turn that calls
    a tool renders its reasoning or its content as the analysis before the call, not both (the template raises on
    both): with reasoning given, the reasoning is kept, as llama.cpp keeps it. The template renders one call per
    assistant turn (harmony's: a call ends the turn) and names a result after the last call, so a turn with
    several calls (parallel calls sent back) becomes one turn per call, each followed by its result."""
    out = []
    for m in _one_call_per_turn(messages):
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k)), None)
        if m.get("role") == "assistant" and m.get("tool_calls") and reasoning and m.get("content"):
            m = {**m, "content": ""}
        out.append(m)
    return out


def _one_call_per_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m, i = messages[i], i + 1
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if not calls or len(calls) < 2:
            out.append(m)
            continue
        results = []  # the tool messages that answer this turn
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        by_id = {r.get("tool_call_id"): r for r in results}
        for k, call in enumerate(calls):  # the turn's text and reasoning go with its first call
            out.append({**m, "tool_calls": [call]} if k == 0 else {"role": "assistant", "content": "",
                                                                   "tool_calls": [call]})
            answer = by_id.pop(call.get("id") if isinstance(call, dict) else None, None)
            if answer is not None:
                out.append(answer)
        out += [r for r in results if any(r is left for left in by_id.values())]  # results of no known call
    return out


def structured(cfg: Any, tokenizer: Any) -> Any:
    """A request's options (GenerationConfig) with its JSON constraint (json_schema, json_object: structured
    output) moved into harmony's final message, after the analysis the model writes first; other constraints, and
    a tokenizer whose markers are not single tokens, as given."""
    if cfg.json_schema is None and not cfg.json_object:
        return cfg
    schema = {"type": "object"} if cfg.json_schema is None else (
        bounded_schema(cfg.json_schema) if cfg.strict_json_schema else dict(cfg.json_schema))
    schema["x-guidance"] = dict(JSON_LAYOUTS[cfg.structured_whitespace], lenient=cfg.structured_best_effort)

    def token_of(marker: str) -> int | None:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    try:
        final = format_named("openai").final_grammar  # type: ignore[attr-defined] - Harmony's own
        grammar = final("%json " + json.dumps(schema), token_of)
    except NextTokenError:
        return cfg
    return cfg.updated(json_schema=None, json_object=False, grammar=grammar)


class HarmonyParser(AnswerParser):
    """An answer's text in (`feed`, then `finish`), pieces out: Thinking (analysis), str (final and preambles),
    ToolCallDelta (calls to `functions.NAME`, read when `calls`: the request allows them)."""

    def __init__(self, calls: bool = False) -> None:
        super().__init__()
        self.allow_calls = calls
        self.read: list[ToolCall] = []
        self._pending = ""  # text not yet decided: a header, or a possible marker's start at a body's end
        self._state = "header"  # header (the first one's role is the prompt's `<|start|>assistant`) | body
        self._kind = "content"  # the body's: thinking | content | call
        self._open = False  # the last call has started and not ended
        self._dropped: set[int] = set()  # calls left out: cut off, or arguments that are not JSON
        self._out: list[Any] = []

    # ---- AnswerParser's interface --------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Any]:
        self._pending += text
        while self._pending and self._step():
            pass
        return self._drain()

    def finish(self, cut: bool = False) -> list[Any]:
        """The end: a body's held-back text is what it is, unless it is a marker's start (`<|...`; a lone `<` only
        when `cut` at max_tokens): markup, dropped; an open call is left out when `cut`; an unfinished header is
        markup either way."""
        rest, self._pending = self._pending, ""
        if self._state == "body":
            keep = _marker_start(rest)
            if cut or keep > 1:
                rest = rest[: len(rest) - keep]
            self._body(rest)
            if self._kind == "call":
                self._end_call(cut)
        return self._drain()

    def parse(self, text: str, cut: bool = False) -> list[Any]:
        pieces = _merged(self.feed(text) + self.finish(cut))
        return [p for p in pieces if not (isinstance(p, ToolCallDelta) and p.index in self._dropped)]

    @property
    def calls(self) -> list[ToolCall]:
        return [c for i, c in enumerate(self.read) if i not in self._dropped]

    # ---- states --------------------------------------------------------------------------------------------------
    def _step(self) -> bool:
        """Decide what can be decided of `_pending`; False when the rest must wait for more text."""
        if self._state == "body":
            return self._step_body()
        at = self._pending.find(MESSAGE)
        header = self._pending if at < 0 else self._pending[:at]
        if not _header_prefix(header):
            self._state, self._kind = "body", "content"  # not harmony: the text is content
            return True
        if at < 0:
            return False
        self._pending = self._pending[at + len(MESSAGE):]
        self._open_body(header)
        return True

    def _step_body(self) -> bool:
        found = [(self._pending.find(m), m) for m in MARKERS if m in self._pending]
        if not found:
            keep = _marker_start(self._pending)
            self._body(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        at, marker = min(found)
        self._body(self._pending[:at])
        if marker in (MESSAGE, CONSTRAIN):  # stray markup inside a body: dropped
            self._pending = self._pending[at + len(marker):]
            return True
        if self._kind == "call":
            self._end_call(False)
        # the message ended; a new header starts (at <|start|> or <|channel|>, or after the end marker)
        self._pending = self._pending[at + (len(marker) if marker in _ENDS else 0):]
        self._state = "header"
        return True

    def _open_body(self, header: str) -> None:
        channel, recipient = _read_header(header)
        self._state = "body"
        if recipient is not None and recipient.startswith(FUNCTIONS) and self.allow_calls:
            self._kind = "call"
            call = ToolCall(openai_call_id(), recipient[len(FUNCTIONS):], "")
            self.read.append(call)
            self._open = True
            self._out.append(ToolCallDelta(len(self.read) - 1, call.id, call.name, ""))
        elif channel == "analysis" or (recipient is not None and recipient != "assistant"):
            self._kind = "thinking"
        else:
            self._kind = "content"  # final, a commentary preamble, a message without a channel

    def _body(self, text: str) -> None:
        if not text:
            return
        if self._kind == "thinking":
            self._out.append(Thinking(text))
        elif self._kind == "content":
            self._out.append(text)
        else:
            self.read[-1].arguments += text
            self._out.append(ToolCallDelta(len(self.read) - 1, arguments=text))

    def _end_call(self, cut: bool) -> None:
        """The open call ends: left out if `cut` or if its arguments are not a JSON object."""
        if not self._open:
            return
        self._open = False
        index = len(self.read) - 1
        arguments = self.read[index].arguments
        if not cut and not arguments.strip():  # a call without arguments
            self.read[index].arguments = "{}"
            self._out.append(ToolCallDelta(index, arguments="{}"))
            return
        if cut or not isinstance(_decoded(arguments), dict):
            self._dropped.add(index)

    def _drain(self) -> list[Any]:
        out, self._out = _merged(self._out), []
        merged: list[Any] = []
        for piece in out:  # one call's argument pieces joined
            last = merged[-1] if merged else None
            if (isinstance(piece, ToolCallDelta) and isinstance(last, ToolCallDelta) and piece.id is None
                    and last.index == piece.index):
                merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + piece.arguments)
            else:
                merged.append(piece)
        return merged


def _read_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message's header (its text before `<|message|>`)."""
    channel = re.search(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)", header)
    recipient = re.search(r"(?:^|\s|>)to=([^\s<]+)", header)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


def _header_prefix(text: str) -> bool:
    """Whether `text` can begin a message's header: it opens with a marker or ` to=` (a recipient right after the
    prompt's role), then holds markers and words of letters, digits and `_.=:/ -` only."""
    opened = text.lstrip("\n")
    if len(text) > _HEADER_MAX or not any(opened.startswith(o) or o.startswith(opened) for o in _OPENINGS):
        return False
    if opened.startswith(START):
        opened = opened[len(START):]
    plain = opened
    for marker in (CHANNEL, CONSTRAIN):
        plain = plain.replace(marker, " ")
    keep = _marker_start(plain)
    return _HEADER_CHARS.fullmatch(plain[: len(plain) - keep]) is not None


def _marker_start(text: str) -> int:
    """Length of the longest end of `text` that begins some marker (it may become one)."""
    for n in range(min(len(text), max(len(m) for m in MARKERS) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0


def _decoded(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
