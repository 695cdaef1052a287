"""Traces of traced requests (the `trace` field), kept for their explain page: GET /v1/traces/{id}.

Bounded: the newest `capacity` traces are kept; an older id answers 404 with a reason. Each is also served as
JSON (GET /v1/traces/{id}.json), the file `nexttoken replay` reads.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any

from fastapi.responses import HTMLResponse, Response

from ..generation.trace import to_json
from ..generation.trace_page import render_page
from .errors import APIError

DEFAULT_CAPACITY = 64  # traces kept; a trace of N candidates x S steps is ~S x N x 200 bytes of JSON


class TraceStore:
    def __init__(self, model_name: str, capacity: int = DEFAULT_CAPACITY) -> None:
        self.model_name, self.capacity = model_name, capacity
        self.traces: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def add(self, trace: dict[str, Any]) -> dict[str, str]:
        """Keep a finished request's trace; what a response carries about it (its id and URLs)."""
        trace_id = f"trace-{uuid.uuid4().hex}"
        self.traces[trace_id] = {**trace, "model": trace.get("model") or self.model_name}
        while len(self.traces) > self.capacity:
            self.traces.popitem(last=False)
        url = f"/v1/traces/{trace_id}"
        return {"id": trace_id, "url": url, "json_url": url + ".json"}

    async def get(self, trace_id: str) -> Response:
        """The explain page of a kept trace, or its JSON when the id ends in .json."""
        wants_json = trace_id.endswith(".json")
        key = trace_id.removesuffix(".json")
        trace = self.traces.get(key)
        if trace is None:
            raise APIError(404, f"no trace {key!r}: traces come from requests sent with \"trace\": true, and this "
                                f"server keeps the newest {self.capacity}", "trace_id", type="not_found_error")
        if wants_json:
            return Response(to_json(trace), media_type="application/json")
        return HTMLResponse(render_page(trace, f"nexttoken trace {key}"))
