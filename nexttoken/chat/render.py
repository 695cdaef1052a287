"""One chat renderer for the library and every chat-shaped HTTP API (Chat Completions, Responses, Messages).

A conversation goes in (OpenAI-shaped messages, the request's tools and tool choice, the template's variables such
as `enable_thinking`); out come the prompt (text and ids) and what reading the answer needs: the tools whose calls
are parsed, the thinking format and whether the prompt left a thinking block open. `LLM.chat` and the server both
render here and split the answer with `ChatPrompt.answer()` / `split()`, so the reasoning, the content and the
tool calls come out the same in the library and over HTTP.

    renderer = ChatRenderer(tokenizer)                   # once per model: probes what the template renders
    use = renderer.tool_use(tools, tool_choice)          # None without tools
    prompt = renderer.render(messages, use)              # .ids, .text, .preamble, .opened
    answer = prompt.split(generated_text)                # .content, .reasoning, .tool_calls
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..errors import ChatTemplateError
from ..text.chat_template import RenderLimits
from . import harmony
from .answer import AnswerParser, Thinking
from .messages import template_messages
from .reasoning import ReasoningFormat, detect_format
from .reasoning import format_named as reasoning_format_named
from .tools.parser import ToolCall
from .tools.formats import detect_format as detect_tool_format
from .tools.preamble import TemplateSupport, template_support, with_preamble
from .tools.request import ToolUse

# The call format of the tools preamble a template that renders no tools gets when none is set: Hermes' (Qwen2.5's,
# the one ChatML models are trained and served with). llama.cpp's server also writes tools into such a template's
# prompt rather than refusing them; vLLM refuses without --tool-call-parser.
PREAMBLE_FORMAT = "hermes"


@dataclass(frozen=True)
class ChatAnswer:
    """A whole answer, split: the content outside calls, the thinking (None: none, or no thinking format), the
    calls (their arguments as the model wrote them)."""

    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation, and what its answer is read with."""

    ids: list[int]
    text: str
    use: ToolUse | None  # the request's tools (None: it sent none)
    reasoning: ReasoningFormat | None  # where the model writes its thinking; None: it does not think
    opened: bool  # the prompt left a thinking block open: the answer starts inside it
    preamble: str | None  # the call format whose tools preamble the prompt holds (None: the template shows tools)
    harmony: bool = False  # the answer is gpt-oss's harmony (chat/harmony.py): its markers are special tokens the
    # answer's text must keep (skip_special_tokens off), and its parser reads thinking, content and calls together

    @property
    def calls(self) -> ToolUse | None:
        """The tools whose calls are read out of the answer (None: the answer is text and thinking only)."""
        return self.use if self.use is not None and self.use.calls else None

    def answer(self) -> AnswerParser:
        """A streaming parser for one answer: thinking, content, calls."""
        if self.harmony:
            return harmony.HarmonyParser(calls=self.calls is not None)
        return AnswerParser(self.reasoning.parser(self.opened) if self.reasoning is not None else None,
                            self.calls.parser() if self.calls is not None else None)

    def split(self, text: str, cut: bool = False) -> ChatAnswer:
        """A whole answer's parts; `cut`: it ended at max_tokens (a call that had not ended is left out)."""
        parser = self.answer()
        pieces = parser.parse(text, cut=cut)
        thinking = "".join(p.text for p in pieces if isinstance(p, Thinking))
        return ChatAnswer("".join(p for p in pieces if isinstance(p, str)),
                          (thinking or None) if self.reasoning is not None else None, parser.calls)


class ChatRenderer:
    """A tokenizer's chat template with what it renders of tools found once, the call format (`tool_call_parser`,
    vLLM's name; None: read off the template) and the thinking format (`reasoning_parser`; None: read off the
    template). `support`: what the template renders of tools, when probed already. `limits` bound one rendering (a server renders clients' messages); `special_in_content=False`: a
    special token's text inside a message's content is encoded as plain text (see `render`)."""

    def __init__(self, tokenizer: Any, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 limits: RenderLimits = RenderLimits(), special_in_content: bool = True,
                 support: TemplateSupport | None = None) -> None:
        self.tokenizer, self.tool_call_parser, self.reasoning_parser = tokenizer, tool_call_parser, reasoning_parser
        self.limits = limits
        self.special_in_content = special_in_content
        self.support: TemplateSupport = support or template_support(tokenizer, limits)  # given: probed already
        template = tokenizer.chat_template_for()
        if reasoning_parser is not None:
            self.reasoning: ReasoningFormat | None = reasoning_format_named(reasoning_parser)
        else:
            self.reasoning = detect_format(template)
        self.harmony = ((self.reasoning is not None and self.reasoning.harmony) or tool_call_parser == "openai"
                        or (tool_call_parser is None and harmony.detect(template)))
        # The call format's name: the one set, else the one the template shows, else, for a template that renders no
        # tools, the preamble's default. None: the template renders tools in no format this reads (tools are refused
        # unless tool_choice is "none", naming --tool-call-parser).
        shown = detect_tool_format(tokenizer.chat_template_for([]))
        self.call_format: str | None = (tool_call_parser or (shown.name if shown is not None else None)
                                        or (None if self.support.tools else PREAMBLE_FORMAT))
        self.markers = None if self.harmony else self._markers()  # harmony's effort is a level, not a budget
        self._splitting: list[Any] | None = None  # the backend copies that read special tokens' text as text
        self._lock = threading.Lock()  # requests render on several threads at once

    def _markers(self) -> tuple[int, int] | None:
        """The thinking markers' token ids when each is one token (what a thinking budget, and a grammar that
        waits for the answer, need); None otherwise."""
        if self.reasoning is None:
            return None
        ids = [self.tokenizer.encode(m, add_special_tokens=False) for m in (self.reasoning.start, self.reasoning.end)]
        return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None

    def tool_use(self, tools: Sequence[Any] | None, tool_choice: Any = None,
                 parallel_tool_calls: bool | None = None) -> ToolUse | None:
        """A request's tools, validated against the call format (None without tools); bad ones raise ToolsError."""
        return ToolUse.of(tools, tool_choice, parallel_tool_calls, self.call_format,
                          self.tokenizer.chat_template_for(tools))

    @property
    def preamble_format(self) -> str | None:
        """The call format whose tools preamble requests with tools get (None: the template renders tools itself);
        the server says it once in its log."""
        return None if self.support.tools else self.call_format

    def render(self, messages: Sequence[Mapping[str, Any]], use: ToolUse | None = None,
               variables: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
               check: Callable[[str], None] | None = None, expand: Callable[[str], str] | None = None) -> ChatPrompt:
        """The conversation through the chat template.

        The tools go to the template as given, with the template `variables` (e.g. enable_thinking); when the
        template renders no tools and the tools have a call format, they go into the system message as that
        format's preamble instead (tools/preamble.py), and `preamble` names the format. `check` sees the text
        before it is tokenized (the server refuses one too long for the context there). Without
        `special_in_content`, a special token's text inside a message's content ("<|im_start|>") is encoded as
        plain text, as transformers' split_special_tokens does, while the template's own stay special. `expand`
        (a request's images: images/inputs.py) replaces each image's placeholder in the rendered text by its full
        token sequence before the text is checked and tokenized, as transformers' processors do."""
        chat = template_messages(messages)
        if self.harmony:
            chat = harmony.template_messages(chat)
        variables = dict(variables or {})
        given = variables.pop("tools", None)  # without a ToolUse, tools as a template variable go as given
        tools = list(use.tools) if use is not None else given
        preamble = None
        if use is not None and use.format is not None and not self.support.tools:
            chat, tools, preamble = with_preamble(chat, use.tools, use.format, self.support), None, use.format.name
        text = self._render(chat, add_generation_prompt, tools, variables)
        if expand is not None:
            text = expand(text)
        if check is not None:
            check(text)
        ids = None
        if not self.special_in_content:
            specials = [t.content for t in self.tokenizer.backend.get_added_tokens_decoder().values()
                        if t.special and t.content]
            if any(isinstance(m.get("content"), str) and any(s in m["content"] for s in specials) for m in chat):
                ids = self._encode_content_as_text(chat, add_generation_prompt, tools, text, variables)
        if ids is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS itself
        opened = self.reasoning is not None and self.reasoning.opened_in(text)
        return ChatPrompt(ids, text, use, self.reasoning, opened and not self.harmony, preamble, self.harmony)

    def with_effort(self, variables: Mapping[str, Any], reasoning_effort: str | None = None,
                    budget: int | None = None) -> dict[str, Any]:
        """The template's variables with a request's reasoning effort where the format takes one as a variable
        (harmony's `reasoning_effort`: low, medium, high; chat/harmony.py `effort`); a variable the request set
        itself (chat_template_kwargs) stays. Other formats: as given (their effort is a thinking budget)."""
        variables = dict(variables)
        if self.harmony and "reasoning_effort" not in variables:
            level = harmony.effort(reasoning_effort, budget, variables.get("enable_thinking"))
            if level is not None:
                variables["reasoning_effort"] = level
        return variables

    def _render(self, chat: list[dict[str, Any]], add_generation_prompt: bool, tools: list | None,
                variables: dict[str, Any]) -> str:
        return self.tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tools=tools,
                                                  limits=self.limits, **variables)

    # ---- special tokens' text in content, read as text -----------------------------------------------------------
    def _splitter(self, first: bool) -> Any:
        """A copy of the tokenizer's backend that encodes special tokens' text as plain text (tokenizers'
        encode_special_tokens; a copy, since requests encode on several threads at once). `first`: for the text's
        first piece; a Metaspace that prepends "▁" to the first piece only gets a copy that never does, for the
        rest."""
        with self._lock:
            if self._splitting is None:
                copies = []
                backend = self.tokenizer.backend
                for scheme in ("first", "never"):
                    copy = type(backend).from_str(backend.to_str())
                    copy.encode_special_tokens = True
                    if scheme == "never" and getattr(copy.pre_tokenizer, "prepend_scheme", None) == "first":
                        copy.pre_tokenizer.prepend_scheme = "never"
                    copies.append(copy)
                self._splitting = copies
            return self._splitting[0 if first else 1]

    def _encode_split(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        specials = {i for i, t in self.tokenizer.backend.get_added_tokens_decoder().items() if t.special}
        normal = self.tokenizer.backend.encode(text, add_special_tokens=False)
        inside = lambda a, b: any(s <= a and b <= e for s, e in spans)  # noqa: E731
        cuts = [(i, a, b) for i, (a, b) in zip(normal.ids, normal.offsets) if i in specials and not inside(a, b)]
        ids, start, first = [], 0, True
        for token, a, b in [*cuts, (None, len(text), len(text))]:
            if a > start:
                ids += self._splitter(first).encode(text[start:a], add_special_tokens=False).ids
            first = False
            if token is not None:
                ids.append(token)
            start = b
        return ids

    def _encode_content_as_text(self, chat: list[dict[str, Any]], add_generation_prompt: bool, tools: list | None,
                                text: str, variables: dict[str, Any]) -> list[int]:
        """`text` (the rendering) as the tokenizer encodes it, except that special tokens inside a message's content
        are not matched: where the contents lie comes from a rendering with a marker in place of each (a template
        that rewrites content cannot be split this way: a ChatTemplateError); the special tokens outside them (the
        template's) split the text as the tokenizer itself splits it, and each piece between them is encoded with
        special tokens read as plain text. A text whose contents hold no special token gets exactly the usual
        ids."""
        marked = [dict(m, content=_MARK.format(i)) if isinstance(m.get("content"), str) else m
                  for i, m in enumerate(chat)]
        rest, at, spans = self._render(marked, add_generation_prompt, tools, variables), 0, []  # (start, end)
        for i, m in enumerate(chat):
            if not isinstance(m.get("content"), str):
                continue
            before, found, rest = rest.partition(_MARK.format(i))
            if not found or _MARK.format(i) in rest:
                break
            at += len(before)
            spans.append((at, at + len(m["content"])))
            at += len(m["content"])
        else:
            if at + len(rest) == len(text) and all(text[s:e] == m for (s, e), m in zip(spans, (
                    m["content"] for m in chat if isinstance(m.get("content"), str)))):
                return self._encode_split(text, spans)
        raise ChatTemplateError(
            "this model's chat template rewrites message content, so special tokens in it cannot be kept as text "
            "(--no-special-tokens-in-content): remove them from the messages")


_MARK = "\ue000{}\ue001"  # private-use characters around a message's number: where its content goes
