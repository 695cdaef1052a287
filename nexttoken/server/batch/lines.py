"""OpenAI's batch file format: the input lines (`{"custom_id", "method", "url", "body"}`), the output lines
(`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`), and what an output file
already answers (a rerun resumes after it).

A line that cannot become a request (not JSON, no custom_id, another method or url, a streamed body) is answered
here with a 400 in the server's own error body; every other line goes to the server's route, which answers it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ...errors import NextTokenError
from ..http.errors import error_body
from . import ENDPOINTS
# A line without a readable custom_id is known by its number: its error message starts with it (resume reads it).
_LINE = re.compile(r"^line (\d+): ")


class BatchError(NextTokenError, ValueError):
    """A batch input or output file that cannot be run as a whole: unreadable, a custom_id given twice, or an
    output file that answers another input."""


@dataclass(frozen=True)
class BatchRequest:
    """One input line: what the route gets (`url`, `body` as JSON bytes), or the 400 it is answered with."""

    line: int  # 1-based, in the input file
    custom_id: str | None  # None: the line has no readable custom_id (it is known by `line`)
    url: str | None = None
    body: bytes | None = None
    error: dict[str, Any] | None = None  # the error body a line that is no request gets (status 400)

    @property
    def key(self) -> str | tuple[str, int]:
        """What an output line answers: the custom_id, else the line number."""
        return self.custom_id if self.custom_id is not None else ("line", self.line)


def parse_line(number: int, text: str, endpoints: tuple[str, ...] = ENDPOINTS) -> BatchRequest:
    """One input line as a request, or as the 400 that answers it; `endpoints`: the urls it may name (a server
    batch's one endpoint)."""

    def refused(message: str, param: str | None, custom_id: str | None = None) -> BatchRequest:
        where = f"line {number}: " if custom_id is None else f"line {number} ({custom_id!r}): "
        return BatchRequest(number, custom_id, error=error_body(where + message, "invalid_request_error", param))

    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        return refused(f"not valid JSON ({e}): each line is one request object", None)
    if not isinstance(item, dict):
        return refused("not a JSON object: each line is {\"custom_id\", \"method\", \"url\", \"body\"}", None)
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str):
        return refused(f"custom_id must be a string, got {custom_id!r}", "custom_id")
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        return refused(f"unknown field {unknown[0]!r}: a line has custom_id, method, url and body", unknown[0],
                       custom_id)
    if item.get("method") != "POST":
        return refused(f"method must be \"POST\", got {item.get('method')!r}", "method", custom_id)
    url = item.get("url")
    if url not in endpoints:
        return refused(f"url {url!r} is not {'a' if len(endpoints) > 1 else 'the'} batch endpoint: use "
                       f"{'one of ' if len(endpoints) > 1 else ''}{', '.join(endpoints)}", "url", custom_id)
    if "body" not in item:
        return refused("body is required: the request the url's API gets", "body", custom_id)
    body = item["body"]
    if isinstance(body, dict) and body.get("stream"):
        return refused("stream is not supported in a batch (each answer is one JSON body): leave it out",
                       "body.stream", custom_id)
    return BatchRequest(number, custom_id, url, json.dumps(body).encode())


def parse_requests(lines: Iterable[str], endpoints: tuple[str, ...] = ENDPOINTS) -> list[BatchRequest]:
    """Every non-blank line as a request (or its 400); a custom_id given twice is a BatchError naming it, before
    any work (a resumed run could not tell the answers apart)."""
    requests = [parse_line(n, text, endpoints) for n, text in enumerate(lines, 1) if text.strip()]
    seen: dict[str, int] = {}
    for r in requests:
        if r.custom_id is not None and r.custom_id in seen:
            raise BatchError(f"custom_id {r.custom_id!r} is on line {seen[r.custom_id]} and line {r.line}: each "
                             "request needs its own custom_id")
        if r.custom_id is not None:
            seen[r.custom_id] = r.line
    return requests


def read_requests(path: str | Path) -> list[BatchRequest]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BatchError(f"cannot read the batch input {str(path)!r}: {e}") from e
    return parse_requests(text.splitlines())


def output_line(request: BatchRequest, status: int, body: Any, request_id: str | None = None) -> dict[str, Any]:
    """The answer to one request, as OpenAI's batch output line."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
            "response": {"status_code": status, "request_id": request_id or f"req-{uuid.uuid4().hex[:24]}",
                         "body": body},
            "error": None}


def refusal(request: BatchRequest) -> dict[str, Any]:
    """The output line of a line that is no request: its 400."""
    assert request.error is not None
    return output_line(request, 400, request.error)


def answered_keys(lines: Iterable[str]) -> set[str | tuple[str, int]]:
    """The requests an output file's lines answer: custom_ids, and ("line", n) for a line without one."""
    keys: set[str | tuple[str, int]] = set()
    for text in lines:
        item = json.loads(text)
        if item.get("custom_id") is not None:
            keys.add(item["custom_id"])
            continue
        message = (((item.get("response") or {}).get("body") or {}).get("error") or {}).get("message", "")
        match = _LINE.match(message)
        if match:
            keys.add(("line", int(match.group(1))))
    return keys


def resume(path: str | Path, requests: list[BatchRequest]) -> list[BatchRequest]:
    """The requests `path` (an output file of an earlier run, or none) does not answer yet. A last line cut off
    by a kill is removed from the file (its request runs again); an answer to a custom_id the input does not have
    is a BatchError: the file is another batch's output."""
    path = Path(path)
    if not path.parent.is_dir():
        raise BatchError(f"the output file's folder {str(path.parent)!r} does not exist: create it first")
    if not path.exists():
        return requests
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]  # a kill mid-write leaves at most one line without its newline
    if len(whole) < len(data):
        with path.open("r+b") as f:
            f.truncate(len(whole))
    try:
        keys = answered_keys(line for line in whole.decode("utf-8").splitlines() if line.strip())
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise BatchError(f"{str(path)!r} is not a batch output file (a line is not an output object: {e}); "
                         "choose another output file") from e
    stray = sorted(k for k in keys - {r.key for r in requests} if isinstance(k, str))
    if stray:
        raise BatchError(f"{str(path)!r} answers custom_id {stray[0]!r}, which the input does not have: it is "
                         "another batch's output; choose another output file")
    return [r for r in requests if r.key not in keys]
