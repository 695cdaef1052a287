"""The one stream driver under every API's server-sent events (Chat Completions, Completions, Responses, Messages,
/infill): it pulls a request's engine events, runs each choice's answer split (thinking, content, tool calls) as
the text streams, counts the usage, and turns what fails (the engine on one request, the answer's parsing, a bad
option at run time, an engine shutting down) into the API's error; closing it (the client left) cancels the
request. Each API keeps only an `EventEncoder`: what its frames say at the start, per event, on failure and at
the end.

    async for frame in drive(run.events, ChatChunks(...), run.answer): ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from ...engine.async_engine import EngineClosedError, EngineDeadError
from ...engine.sequence import TokenEvent
from ...errors import NextTokenError
from ...chat.answer import AnswerParser
from ..http.errors import APIError, client_error
from .serving import engine_failure, log, tool_parse_failure, unavailable


@dataclass
class Tally:
    """What a stream has produced so far, over its choices: the usage and how each choice ended."""

    tokens: int = 0  # generated tokens, all choices
    speculated: dict[int, tuple[int, int]] = field(default_factory=dict)  # choice -> (drafted, accepted)
    finish: dict[int, tuple[str | None, int | str | None]] = field(default_factory=dict)  # (finish, stop reason)

    def add(self, index: int, event: TokenEvent) -> None:
        self.tokens += len(event.token_ids)
        self.speculated[index] = (event.spec_draft_tokens, event.spec_accepted_tokens)
        self.finish[index] = (event.finish_reason, event.stop_reason)


@dataclass
class Step:
    """One engine event of one choice, with its answer's pieces (Thinking, str, ToolCallDelta: tools/answer.py;
    None when the API streams the text as it is) and whether that answer has made calls so far."""

    index: int
    event: TokenEvent
    pieces: list[Any] | None = None
    calls: bool = False


class EventEncoder:
    """An API's frames (SSE text, `sse` in http/streams.py) for the driver's moments; `ends_after_failure`:
    whether the end frames follow a failure's (OpenAI's [DONE] does; a Responses or Messages stream ends with its
    error)."""

    ends_after_failure = False

    def start(self) -> list[str]:
        return []

    def step(self, step: Step, tally: Tally) -> list[str]:
        raise NotImplementedError

    def failed(self, error: APIError, tally: Tally) -> list[str]:
        raise NotImplementedError

    def end(self, tally: Tally) -> list[str]:
        return []


async def drive(events: AsyncIterator[tuple[int, TokenEvent]], encoder: EventEncoder,
                answer: Callable[[], AnswerParser] | None = None) -> AsyncIterator[str]:
    """A request's frames: the encoder's start, a step per event (with `answer`, each choice's text split by a
    parser of its own), then its end; a failure ends the events with the encoder's error frames."""
    tally, parsers = Tally(), {}
    error: APIError | None = None
    try:
        for frame in encoder.start():
            yield frame
        async for index, event in events:
            if event.finish_reason == "error":
                error = engine_failure(event)
                break
            tally.add(index, event)
            step = Step(index, event)
            if answer is not None:
                parser = parsers.setdefault(index, answer())
                try:
                    step.pieces = _pieces(parser, event)
                except Exception:  # noqa: BLE001 - this request's answer parsing failed: it ends alone, in the API's body
                    log.exception("parsing a streamed choice's answer (thinking, tool calls) failed")
                    error = tool_parse_failure()
                    break
                step.calls = bool(parser.calls)
            for frame in encoder.step(step, tally):
                yield frame
    except (EngineClosedError, EngineDeadError) as e:  # before NextTokenError, their base: a 503
        error = unavailable(e)
    except NextTokenError as e:  # a client's mistake (an adapter unloaded under it: 404 model_not_found)
        error = client_error(e)
    finally:
        await events.aclose()  # type: ignore[attr-defined] - the request's unfinished choices are cancelled
    if error is not None:
        for frame in encoder.failed(error, tally):
            yield frame
        if not encoder.ends_after_failure:
            return
    for frame in encoder.end(tally):
        yield frame


def _pieces(parser: AnswerParser, event: TokenEvent) -> list[Any]:
    """The event's text as its answer's pieces; the last event finishes the answer (a cut one drops a call that
    had not ended)."""
    pieces = parser.feed(event.text)
    if event.finished:
        pieces += parser.finish(cut=event.finish_reason == "length")
    return pieces
