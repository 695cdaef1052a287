"""Reading tool calls out of model text as it streams: content outside the calls, and each call's id, name and
arguments, as OpenAI's `message.tool_calls` and streamed `delta.tool_calls`.

A parser reads the text one character at a time, in a generator written the way its format reads (formats.py),
so its state and everything it emits depend only on the text so far, never on how the text was cut into chunks:
a stream cut at any point yields the same content and calls as the whole text read at once. What it emits is
final: content that may still turn out to be the start of a call marker is held back until it is decided, a
call's name is emitted whole, and its arguments are the exact characters the model wrote for the arguments
value, emitted as they arrive (so the streamed fragments concatenate to the non-streamed `arguments`).

A text cut off (by max_tokens: `finish(cut=True)`) may end inside a call or a marker. Then the call that had not
ended is not in `result()` (its arguments would not parse), and what was held back as a possible marker, or read
as a call object that never got its name, is dropped: markup never becomes content. A stream has already sent the
cut call's name and argument text; its finish reason ("length") says the call is incomplete.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

Reader = Generator[None, "str | None", Any]  # receives characters (None: the end of the text)
_ALNUM = string.ascii_letters + string.digits


@dataclass
class ToolCall:
    """One finished call: OpenAI's `{"id", "type": "function", "function": {"name", "arguments"}}`."""

    id: str
    name: str
    arguments: str  # the arguments object as JSON text, exactly as the model wrote it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: its first piece carries the id and name, the next ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def random_id(length: int) -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(length))


def openai_call_id() -> str:
    return "call_" + random_id(24)


class ToolCallParser:
    """Text in (`feed`, then `finish` at the end), pieces out; `content` and `calls` hold the result so far.

    Subclasses define `_read()`: a generator that takes characters with `yield from self._getc()` (None at the
    end) and reports what it found through `_text`, `_start_call` and `_arguments`."""

    def __init__(self, new_id: Callable[[], str] = openai_call_id) -> None:
        self.new_id = new_id
        self.content = ""
        self.calls: list[ToolCall] = []
        self._out: list[Any] = []
        self._back: list[str] = []  # characters pushed back (read again next), last first
        self._eof = False
        self._record: list[str] | None = None  # the characters of the call object being read
        self._open = False  # the last call has started and not ended
        self._cut = False  # the text was cut off (known at finish)
        self._reader = self._read()
        next(self._reader)

    # ---- driving -------------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Any]:
        for ch in text:
            self._send(ch)
        return self._drain()

    def finish(self, cut: bool = False) -> list[Any]:
        """The end of the text: what was held back is decided (an unfinished marker is content after all, unless
        the text was `cut` off: then it is the start of markup, and dropped)."""
        self._cut = cut
        self._send(None)
        return self._drain()

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """A whole text -> (content, calls). Content is None when there are calls and nothing else (OpenAI's).
        With `cut` (the text ended at max_tokens), a call that had not ended is left out."""
        self.feed(text)
        self.finish(cut)
        return self.result()

    def result(self) -> tuple[str | None, list[ToolCall]]:
        calls = self.calls[:-1] if self._cut and self._open else list(self.calls)
        return (self.content or None) if calls else self.content, calls

    def _send(self, ch: str | None) -> None:
        if self._eof:
            return
        self._eof = ch is None
        try:
            self._reader.send(ch)
        except StopIteration:
            self._eof = True

    def _drain(self) -> list[Any]:
        """The pieces since the last drain, neighbours of one kind merged (content with content, one call's
        argument text with the text after it)."""
        merged: list[Any] = []
        for piece in self._out:
            last = merged[-1] if merged else None
            if isinstance(piece, str) and isinstance(last, str):
                merged[-1] = last + piece
            elif (isinstance(piece, ToolCallDelta) and isinstance(last, ToolCallDelta) and piece.id is None
                  and last.index == piece.index):
                merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + piece.arguments)
            elif piece != "":
                merged.append(piece)
        self._out = []
        return merged

    # ---- what a reader reports -----------------------------------------------------------------------------------
    def _text(self, text: str) -> None:
        if text:
            self.content += text
            self._out.append(text)

    def _start_call(self, name: str) -> None:
        call = ToolCall(self.new_id(), name, "")
        self.calls.append(call)
        self._open = True
        self._out.append(ToolCallDelta(len(self.calls) - 1, call.id, name, ""))

    def _arguments(self, text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            self._out.append(ToolCallDelta(len(self.calls) - 1, arguments=text))

    # ---- reading, for the formats ----------------------------------------------------------------------------
    def _read(self) -> Reader:
        raise NotImplementedError

    def _getc(self) -> Reader:
        """The next character, or None at the end of the text (and ever after)."""
        if self._back:
            ch = self._back.pop()
        elif self._eof:
            return None
        else:
            ch = yield
        if ch is not None and self._record is not None:
            self._record.append(ch)
        return ch

    def _unget(self, text: str | None) -> None:
        if text:
            self._back.extend(reversed(text))
            if self._record is not None:
                del self._record[len(self._record) - len(text):]

    def _skip_space(self) -> Reader:
        """The next character that is not whitespace (None at the end)."""
        while True:
            ch = yield from self._getc()
            if ch is None or not ch.isspace():
                return ch

    def _text_until(self, markers: Sequence[str], strip_leading: bool = False) -> Reader:
        """Content up to the first of `markers` (returned; None if the text ends first). Whitespace right before a
        marker (and, with `strip_leading`, right after the call before) is the calls' layout, not content."""
        held = ""  # trailing whitespace, then what may be the start of a marker: not yet decided
        while True:
            ch = yield from self._getc()
            if ch is None:
                if self._cut:  # a marker's start at the cut is markup, not content
                    held = held[: len(held) - _marker_start(held, markers)]
                self._text(held.rstrip() if self.calls else held)
                return None
            if strip_leading and ch.isspace():
                continue
            strip_leading = False
            held += ch
            found = next((m for m in markers if held.endswith(m)), None)
            if found is not None:
                self._text(held[: len(held) - len(found)].rstrip())
                return found
            keep = _marker_start(held, markers)
            head = held[: len(held) - keep]
            keep += len(head) - len(head.rstrip())
            self._text(held[: len(held) - keep])
            held = held[len(held) - keep:]

    def _until(self, markers: Sequence[str]) -> Reader:
        """(text before the first of `markers`, that marker or None at the end), nothing emitted."""
        text = ""
        while True:
            ch = yield from self._getc()
            if ch is None:
                return text, None
            text += ch
            found = next((m for m in markers if text.endswith(m)), None)
            if found is not None:
                return text[: len(text) - len(found)], found

    def _expect(self, literal: str) -> Reader:
        """Skip whitespace, then `literal`; True if it came, else what came instead is pushed back."""
        first = yield from self._skip_space()
        seen = first or ""
        while first is not None and literal.startswith(seen) and len(seen) < len(literal):
            ch = yield from self._getc()
            if ch is None:
                break
            seen += ch
        if seen == literal:
            return True
        if self._cut and seen and self._ended() and literal.startswith(seen):
            return True  # the text was cut inside the literal (a closing marker): it is layout, not content
        self._unget(seen)
        return False

    def _call_object(self, name_keys: Sequence[str] = ("name",),
                     argument_keys: Sequence[str] = ("arguments", "parameters")) -> Reader:
        """One call written as a JSON object (`{"name": ..., "arguments": {...}}`), its `{` already read.

        The call starts when its name is read; the arguments value is emitted as it arrives, or held until the
        name comes if it comes first. Returns "" for a complete call; otherwise the text read (for the format to
        treat as content) if no call had started, or None (the call ends where the text broke off)."""
        self._record = ["{"]
        try:
            left = yield from self._call_members(name_keys, argument_keys)
        finally:
            self._record = None
        if left == "":
            self._open = False
        return left

    def _call_members(self, name_keys: Sequence[str], argument_keys: Sequence[str]) -> Reader:
        held, name, wrote_arguments = "", None, False
        while True:
            ch = yield from self._skip_space()
            if ch == "}":
                break
            if ch != '"':
                return self._broken(name)
            key = _decoded((yield from self._json_string()))
            if key is None or not (yield from self._expect(":")):
                return self._broken(name)
            first = yield from self._skip_space()
            if first is None:
                return self._broken(name)
            if key in name_keys and name is None and first == '"':
                name = _decoded((yield from self._json_string()))
                if not isinstance(name, str):
                    return self._broken(None)
                self._start_call(name)
                self._arguments(held)
            elif key in argument_keys and not wrote_arguments:
                wrote_arguments = True
                sink: list[str] = []

                def write(text: str, sink: list[str] = sink) -> None:
                    sink.append(text)
                    if name is not None and first != '"':
                        self._arguments(text)

                done = yield from self._json_value(first, write)
                value = "".join(sink)
                if first == '"' and done:  # arguments sent as a string of JSON: its content is the arguments
                    value = _decoded(value) or ""
                    if name is not None:
                        self._arguments(value)
                if name is None:
                    held = value
                if not done:
                    return self._broken(name)
            elif not (yield from self._json_value(first, lambda text: None)):
                return self._broken(name)
            ch = yield from self._skip_space()
            if ch == "}":
                break
            if ch != ",":
                return self._broken(name)
        if name is None:
            return self._broken(None)
        if not wrote_arguments:
            self._arguments("{}")
        return ""

    def _broken(self, name: str | None) -> str | None:
        """What a call object that is not one gives back: its text if no call started (it is content after
        all, unless the text was cut off inside it: then it is a call's start, dropped), else None (the started
        call ends here)."""
        if name is None and not (self._cut and self._ended()):
            return "".join(self._record or ())
        return None

    def _ended(self) -> bool:
        """Whether the whole text has been read."""
        return self._eof and not self._back

    def _json_string(self) -> Reader:
        """A JSON string whose opening quote was read: its whole text, quotes included (cut short at the end)."""
        text: list[str] = []
        yield from self._json_value('"', text.append)
        return "".join(text)

    def _json_value(self, first: str, write: Callable[[str], None]) -> Reader:
        """A JSON value starting with `first` (already read), each character handed to `write` as it comes;
        True if it ended (a scalar's end is seen on the character after it, which is pushed back)."""
        write(first)
        if first in '"{[':  # a string, or a container: read to the quote or bracket that closes it
            depth, in_string, escaped = (0, True, False) if first == '"' else (1, False, False)
            while in_string or depth:
                ch = yield from self._getc()
                if ch is None:
                    return False
                write(ch)
                if escaped:
                    escaped = False
                elif in_string:
                    escaped, in_string = ch == "\\", ch != '"'
                elif ch == '"':
                    in_string = True
                elif ch in "{[":
                    depth += 1
                elif ch in "}]":
                    depth -= 1
            return True
        while True:  # number, true, false, null
            ch = yield from self._getc()
            if ch is None:
                return True
            if ch in ",}] \t\r\n":
                self._unget(ch)
                return True
            write(ch)


def _decoded(text: str) -> Any:
    """A JSON value's text -> the value, or None if it is not valid (the text broke off)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _marker_start(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start of some marker (it may become one)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best
