"""A server you can watch: after a few requests (chat and completions, streamed and not, embeddings, one refused), a real
`nexttoken serve --log-format json --otlp-traces-endpoint URL` (stories260K) is read three ways. Its /metrics
parses with prometheus_client's own text parser and carries vLLM's metric names with the model_name label, their
counts equal to the requests made and their token counters to the responses' usage; its request log has one JSON
line per request with the usage the client got; and a loopback OTLP/HTTP collector (support/otlp.py, decoding with
opentelemetry-proto) receives one span per request, a child of the span named by the request's `traceparent`."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import openai
import pytest
from conftest import requires_shared
from prometheus_client.parser import text_string_to_metric_families
from support.otlp import Collector, Span
from support.server import start_server, stop_server

from nexttoken.cli import main
from nexttoken.errors import MissingExtraError
from nexttoken.server.http.tracing import require_otel

pytestmark = requires_shared

NAME = "watched"  # --served-model-name: every vllm:* sample's model_name
# A prompt over two 16-token chunks (--chunk-size 16): sent twice, the second finds whole chunks in the prefix cache
LONG = "Once upon a time there was a little girl named Lily. She liked to play in the park with her big red ball."
# W3C traceparents (version-trace id-parent span id-flags) of the two requests sent inside a caller's trace
PARENTS = {"obs-chat": ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"),
           "obs-chat-stream": ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")}


@dataclass
class Served:
    usage: dict[str, tuple[int, int, str]]  # request id -> (prompt tokens, completion tokens, finish reason)
    embedded: int  # the embeddings request's prompt tokens
    metrics: str  # the /metrics text after the requests
    log: list[dict]  # the request log's JSON lines
    spans: list[Span]


def _headers(request_id: str) -> dict[str, str]:
    headers = {"x-request-id": request_id}
    if request_id in PARENTS:
        trace_id, span_id = PARENTS[request_id]
        headers["traceparent"] = f"00-{trace_id}-{span_id}-01"
    return headers


def _streamed(chunks) -> tuple[int, int, str]:  # noqa: ANN001 - an openai Stream
    chunks = list(chunks)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens, finish[-1]


@pytest.fixture(scope="module")
def served(model_dir) -> Served:
    with Collector() as collector:
        proc, url = start_server(model_dir, "--served-model-name", NAME, "--log-format", "json",
                                 "--otlp-traces-endpoint", collector.url)
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            chat = [{"role": "user", "content": "Tell me a story"}]
            usage = {}
            r = client.chat.completions.create(model=NAME, messages=chat, max_tokens=5, temperature=0,
                                               extra_headers=_headers("obs-chat"))
            usage["obs-chat"] = (r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason)
            usage["obs-chat-stream"] = _streamed(client.chat.completions.create(
                model=NAME, messages=chat, max_tokens=6, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_headers=_headers("obs-chat-stream")))
            r = client.completions.create(model=NAME, prompt=LONG, max_tokens=3, temperature=0,
                                          extra_headers=_headers("obs-completion"))
            usage["obs-completion"] = (r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason)
            usage["obs-completion-stream"] = _streamed(client.completions.create(
                model=NAME, prompt=LONG, max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_headers=_headers("obs-completion-stream")))
            embedded = client.embeddings.create(model=NAME, input=["a cat", "a dog sat"],
                                                extra_headers=_headers("obs-embed")).usage.prompt_tokens
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model=NAME, prompt="Hi", temperature=-1, extra_headers=_headers("obs-bad"))
            metrics = client.with_options(base_url=url).get("/metrics", cast_to=str)
        finally:
            stop_server(proc)  # the server's shutdown exports the spans it batched
        log = [json.loads(line) for line in proc.stdout.read().decode().splitlines() if line.startswith("{")]
        return Served(usage, embedded, metrics, log, list(collector.spans))


def _samples(text: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """The families' types by name and every sample's value by (name, labels)."""
    types, values = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            values[(s.name, frozenset(s.labels.items()))] = s.value
    return types, values


def test_metrics_carry_vllm_names_with_the_requests_counts_and_tokens(served: Served) -> None:
    types, values = _samples(served.metrics)
    model = frozenset({("model_name", NAME)})

    def value(name: str, **labels: str) -> float:
        return values[(name, model | frozenset(labels.items()))]

    n = len(served.usage)  # sequences that ran: one per request (n=1); the refused one never ran
    prompt = sum(p for p, _, _ in served.usage.values())
    completion = sum(c for _, c, _ in served.usage.values())
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_time_per_output_token_seconds"):
        assert types[f"vllm:{name}"] == "histogram", name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc"):
        assert types[f"vllm:{name}"] == "gauge", name
    for name in ("request_success", "prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_queries",
                 "prefix_cache_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens"):
        assert types[f"vllm:{name}"] == "counter", name
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_inference_time_seconds", "request_prompt_tokens"):
        assert value(f"vllm:{name}_count") == n, name
    # one inter-token gap per token after each sequence's first (one token per step without speculation)
    assert value("vllm:inter_token_latency_seconds_count") == completion - n
    assert value("vllm:inter_token_latency_seconds_sum") > 0
    assert value("vllm:e2e_request_latency_seconds_sum") >= value("vllm:time_to_first_token_seconds_sum") > 0
    assert value("vllm:request_prompt_tokens_sum") == prompt
    assert value("vllm:request_generation_tokens_sum") == completion
    assert value("vllm:prompt_tokens_total") == prompt and value("vllm:generation_tokens_total") == completion
    reasons = [f for _, _, f in served.usage.values()]
    for reason in set(reasons):
        assert value("vllm:request_success_total", finished_reason=reason) == reasons.count(reason)
    assert value("vllm:num_requests_running") == 0 and value("vllm:num_requests_waiting") == 0
    assert 0 <= value("vllm:kv_cache_usage_perc") == value("vllm:gpu_cache_usage_perc") <= 1
    assert value("vllm:prefix_cache_queries_total") == prompt
    # each prompt's second request (the chat's, the long completion's) found whole chunks of its first
    repeated = served.usage["obs-chat-stream"][0] + served.usage["obs-completion-stream"][0]
    assert 16 <= value("vllm:prefix_cache_hits_total") <= repeated
    assert value("vllm:num_preemptions_total") == 0
    assert value("vllm:spec_decode_num_drafts_total") == value("vllm:spec_decode_num_accepted_tokens_total") == 0
    assert {dict(labels).get("model_name") for name, labels in values if name.startswith("vllm:")} == {NAME}
    # nexttoken's own names still there
    assert values[("nexttoken_time_to_first_token_seconds_count", frozenset())] == n
    assert values[("nexttoken_generation_tokens_total", frozenset())] == completion


def test_json_request_log_has_a_line_per_request_with_its_usage(served: Served) -> None:
    lines = {x["request_id"]: x for x in served.log if x["logger"] == "nexttoken.server.requests"}
    assert set(lines) == {*served.usage, "obs-embed", "obs-bad"}
    apis = {"obs-chat": "openai.chat", "obs-chat-stream": "openai.chat", "obs-completion": "openai.completions",
            "obs-completion-stream": "openai.completions"}
    for request_id, (prompt, completion, finish) in served.usage.items():
        line = lines[request_id]
        assert (line["level"], line["method"], line["status"], line["model"], line["api"]) == (
            "INFO", "POST", 200, NAME, apis[request_id])
        assert (line["prompt_tokens"], line["completion_tokens"], line["finish_reason"]) == (prompt, completion, finish)
        assert 0 < line["ttft_ms"] <= line["duration_ms"]
        assert line["error"] is None and line["sampling"]["temperature"] == 0
    embed = lines["obs-embed"]
    assert (embed["status"], embed["model"], embed["api"], embed["prompt_tokens"], embed["completion_tokens"]) == (
        200, NAME, "openai.embeddings", served.embedded, 0)
    bad = lines["obs-bad"]
    assert (bad["level"], bad["status"], bad["model"], bad["ttft_ms"], bad["finish_reason"]) == (
        "WARNING", 400, None, None, None)
    assert "temperature" in bad["error"]


def test_one_span_per_request_under_the_callers_traceparent(served: Served) -> None:
    spans = {s.attributes["gen_ai.request.id"]: s for s in served.spans}
    assert len(served.spans) == len(spans) == len(served.usage) + 2  # the embeddings' and the refused one's too
    assert len({s.trace_id for s in served.spans}) == len(served.spans)  # a trace each
    for request_id, (prompt, completion, finish) in served.usage.items():
        span = spans[request_id]
        parent = PARENTS.get(request_id)
        assert (span.trace_id, span.parent_span_id) == (parent if parent else (span.trace_id, ""))
        assert (span.name, span.kind, span.service_name) == ("llm_request", 2, "nexttoken")  # 2: SERVER
        a = span.attributes
        assert (a["gen_ai.request.model"], a["gen_ai.response.model"]) == (NAME, NAME)
        assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (prompt, completion)
        assert a["gen_ai.response.finish_reasons"] == (finish,) and a["http.response.status_code"] == 200
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"]
        assert a["gen_ai.request.temperature"] == 0
        assert abs((span.end_ns - span.start_ns) / 1e9 - a["gen_ai.latency.e2e"]) < 1e-3
    embed = spans["obs-embed"].attributes
    assert (embed["gen_ai.usage.prompt_tokens"], embed["gen_ai.usage.num_sequences"]) == (served.embedded, 2)
    bad = spans["obs-bad"]
    assert bad.attributes["http.response.status_code"] == 400 and "gen_ai.usage.prompt_tokens" not in bad.attributes


def test_without_the_otel_extra_the_flag_names_it(monkeypatch, capsys, model_dir) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)  # not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'nexttoken\[otel\]'"):
        require_otel()
    argv = ["serve", "--model", str(model_dir), "--otlp-traces-endpoint", "http://127.0.0.1:4318"]
    assert main(argv) == 2  # before the model loads
    assert "pip install 'nexttoken[otel]'" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter")
    assert main([*argv[:-1], "localhost:4318"]) == 2
    assert "not an http(s) URL" in capsys.readouterr().err
