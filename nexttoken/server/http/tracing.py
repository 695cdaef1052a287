"""OpenTelemetry traces of requests: `nexttoken serve --otlp-traces-endpoint URL` exports one span per request over
OTLP/HTTP, a child of the caller's span when the request carries a W3C `traceparent` header. The span's attributes
are vLLM's (vllm/tracing.py's SpanAttributes, OpenTelemetry's gen_ai.* conventions): model, usage, finish reasons,
latencies. Without the flag nothing here is imported and the request log's middleware skips it (one `is None`).

The OpenTelemetry SDK and exporter are an extra: pip install 'nexttoken[otel]'."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from starlette.types import Scope

from ...errors import MissingExtraError
from .request_log import RequestRecord

OTEL_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
SPAN_NAME = "llm_request"  # vLLM's name of a generation request's span
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces, added to an endpoint given without a path


def require_otel() -> None:
    """Raise MissingExtraError naming the extra when the OpenTelemetry SDK or its OTLP/HTTP exporter is missing."""
    import importlib

    for module in OTEL_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise MissingExtraError(
                f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter ('{module}' is "
                "missing), which the base install does not carry: pip install 'nexttoken[otel]'") from e


def traces_url(endpoint: str) -> str:
    """The collector's traces URL: `endpoint` as given, or with /v1/traces added when it has no path
    (http://localhost:4318 -> http://localhost:4318/v1/traces, as OTEL_EXPORTER_OTLP_ENDPOINT is read)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint {endpoint!r} is not an http(s) URL: give the collector's "
                         "OTLP/HTTP address, e.g. http://localhost:4318/v1/traces")
    return endpoint if parts.path.strip("/") else endpoint.rstrip("/") + TRACES_PATH


class OtlpTracer:
    """The request tracer (request_log.RequestTracer): spans batched to an OTLP/HTTP collector; `close` flushes."""

    def __init__(self, endpoint: str, service_name: str = "nexttoken") -> None:
        require_otel()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # its own provider, not the process-wide one: an app embedding the server keeps its own
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("nexttoken.server")
        self.propagator = TraceContextTextMapPropagator()

    def record(self, scope: Scope, record: RequestRecord, status: int, seconds: float, error: str | None) -> None:
        """The finished request's span: from its arrival to its last byte, under the caller's `traceparent`."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or []}
        parent = self.propagator.extract(headers)  # no (or a malformed) traceparent: a new trace
        name = SPAN_NAME if record.ran else f"{scope['method']} {scope['path']}"
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, start_time=record.start_ns,
                                      attributes=attributes(scope, record, status, seconds))
        if status >= 500 or status == 0:
            span.set_status(Status(StatusCode.ERROR, error or "no response"))
        span.end(end_time=record.start_ns + int(seconds * 1e9))

    def close(self) -> None:
        """Export what is batched, then stop (the server's shutdown)."""
        self.provider.shutdown()


def attributes(scope: Scope, record: RequestRecord, status: int, seconds: float) -> dict[str, Any]:
    """A request span's attributes: HTTP's, and vLLM's gen_ai.* ones for a request that ran on the model."""
    out: dict[str, Any] = {"http.request.method": scope["method"], "url.path": scope["path"],
                           "http.response.status_code": status, "gen_ai.request.id": record.request_id,
                           "nexttoken.api": record.api}
    if not record.ran:
        return out
    model = record.adapter or record.model
    out.update({
        "gen_ai.request.model": model, "gen_ai.response.model": model,
        "gen_ai.usage.prompt_tokens": record.prompt_tokens, "gen_ai.usage.completion_tokens": record.completion_tokens,
        "gen_ai.usage.input_tokens": record.prompt_tokens, "gen_ai.usage.output_tokens": record.completion_tokens,
        "gen_ai.usage.num_sequences": record.sequences, "gen_ai.response.finish_reasons": tuple(record.finish_reasons),
        "gen_ai.latency.e2e": seconds,
    })
    if record.ttft_s is not None:
        out["gen_ai.latency.time_to_first_token"] = record.ttft_s
    if record.queue_s is not None:
        out["gen_ai.latency.time_in_queue"] = record.queue_s
    for key in ("temperature", "top_p", "max_tokens"):  # the options it ran with (None: off)
        if (record.sampling or {}).get(key) is not None:
            out[f"gen_ai.request.{key}"] = record.sampling[key]  # type: ignore[index]
    return {k: v for k, v in out.items() if v is not None}
