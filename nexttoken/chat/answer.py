"""An answer's text, split into what each API reports separately: the thinking (`Thinking`), the content (str) and
the tool calls (`ToolCallDelta`), as it streams. The thinking comes first and is read by the reasoning parser;
what follows it is content, read by the tool-call parser when the request has tools."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tools.parser import ToolCallDelta, ToolCallParser
from .reasoning import ReasoningParser


@dataclass(frozen=True)
class Thinking:
    text: str


class AnswerParser:
    """Text in (`feed`, then `finish`), pieces out: Thinking, str (content), ToolCallDelta (calls)."""

    def __init__(self, reasoning: ReasoningParser | None = None, calls: ToolCallParser | None = None) -> None:
        self.reasoning_parser, self.call_parser = reasoning, calls

    def feed(self, text: str) -> list[Any]:
        if self.reasoning_parser is None:
            return self._content(text)
        return self._split(self.reasoning_parser.feed(text))

    def finish(self, cut: bool = False) -> list[Any]:
        """The end of the answer; `cut`: it was cut off by max_tokens (an unfinished marker is markup, dropped)."""
        pieces = self._split(self.reasoning_parser.finish()) if self.reasoning_parser is not None else []
        if self.call_parser is not None:
            pieces += self.call_parser.finish(cut)
        return _merged(pieces)

    def parse(self, text: str, cut: bool = False) -> list[Any]:
        """A whole answer's pieces; with `cut`, a call that had not ended is left out (its pieces too)."""
        pieces = _merged(self.feed(text) + self.finish(cut))
        kept = {id(c) for c in self.calls}
        dropped = [i for i, c in enumerate(self.call_parser.calls) if id(c) not in kept] if self.call_parser else []
        return [p for p in pieces if not (isinstance(p, ToolCallDelta) and p.index in dropped)]

    @property
    def calls(self) -> list:
        """The calls read so far; after a `cut` finish, without the one that had not ended."""
        return self.call_parser.result()[1] if self.call_parser is not None else []

    def _split(self, parts: list[tuple[bool, str]]) -> list[Any]:
        out: list[Any] = []
        for thinking, text in parts:
            out += [Thinking(text)] if thinking else self._content(text)
        return out

    def _content(self, text: str) -> list[Any]:
        if self.call_parser is None:
            return [text] if text else []
        return self.call_parser.feed(text)


def _merged(pieces: list[Any]) -> list[Any]:
    """Neighbouring pieces of one kind joined (content with content, thinking with thinking)."""
    out: list[Any] = []
    for p in pieces:
        if out and isinstance(p, str) and isinstance(out[-1], str):
            out[-1] += p
        elif out and isinstance(p, Thinking) and isinstance(out[-1], Thinking):
            out[-1] = Thinking(out[-1].text + p.text)
        else:
            out.append(p)
    return out
