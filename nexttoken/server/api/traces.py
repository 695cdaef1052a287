"""Traces of traced requests (the `trace` field), kept for their explain page: GET /v1/traces/{id}.

Bounded: the newest `capacity` traces, within a byte budget, are kept; an older id answers 404 with a reason.
Each is also served as JSON (GET /v1/traces/{id}.json), the file `nexttoken replay` reads.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from typing import Any

from fastapi.responses import HTMLResponse, Response

from ...generation.trace.recorder import to_json
from ...generation.trace.page import render_page
from ..http.errors import APIError

DEFAULT_CAPACITY = 64  # traces kept at most
DEFAULT_BUDGET_BYTES = 64 << 20  # and at most this much JSON (a step is ~0.2 KiB per candidate and stage)


class TraceStore:
    """The newest traces, as JSON text, bounded in count and in bytes (the newest is always kept)."""

    def __init__(self, model_name: str, capacity: int = DEFAULT_CAPACITY,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.model_name, self.capacity, self.budget_bytes = model_name, capacity, budget_bytes
        self.traces: OrderedDict[str, str] = OrderedDict()
        self.bytes = 0

    def add(self, trace: dict[str, Any]) -> dict[str, str]:
        """Keep a finished request's trace; what a response carries about it (its id and URLs)."""
        trace_id = f"trace-{uuid.uuid4().hex}"
        text = to_json({**trace, "model": trace.get("model") or self.model_name})
        self.traces[trace_id] = text
        self.bytes += len(text)
        while len(self.traces) > 1 and (len(self.traces) > self.capacity or self.bytes > self.budget_bytes):
            self.bytes -= len(self.traces.popitem(last=False)[1])
        url = f"/v1/traces/{trace_id}"
        return {"id": trace_id, "url": url, "json_url": url + ".json"}

    async def get(self, trace_id: str) -> Response:
        """The explain page of a kept trace, or its JSON when the id ends in .json."""
        wants_json = trace_id.endswith(".json")
        key = trace_id.removesuffix(".json")
        text = self.traces.get(key)
        if text is None:
            raise APIError(404, f"no trace {key!r}: traces come from requests sent with \"trace\": true, and this "
                                f"server keeps the newest {self.capacity} ({self.budget_bytes >> 20} MiB at most)",
                           "trace_id", type="not_found_error")
        if wants_json:
            return Response(text, media_type="application/json")
        return HTMLResponse(render_page(json.loads(text), f"nexttoken trace {key}"))
