"""Prometheus metrics: request latencies observed as events stream out, engine state read at scrape time."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.llm_engine import EngineStats
from ..engine.sequence import TokenEvent
from ..generation.processors.structured import Compiled

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, 10, 20, 40, 80)
_RATE_WINDOW_S = 10.0


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats  # the engine's latest snapshot
        self.registry = CollectorRegistry()  # one per server: several servers (tests) never clash
        r = self.registry
        self.ttft = Histogram("nexttoken_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("nexttoken_inter_token_latency_seconds", "Between consecutive tokens", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("nexttoken_request_queue_time_seconds", "Arrival to first scheduled", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("nexttoken_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("nexttoken_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.grammar_compile = Histogram("nexttoken_grammar_compile_seconds", "Compiling a structured-output grammar "
                                         "(cache misses)", buckets=_LATENCY_BUCKETS, registry=r)
        self.grammar_requests = Counter("nexttoken_grammar_requests", "Structured-output requests by grammar cache "
                                        "result (hit: compiled before)", ["cache"], registry=r)
        self._samples: deque[tuple[float, int]] = deque()  # (time, generated tokens) from the engine thread
        self._lock = threading.Lock()
        r.register(_EngineCollector(self))
        ProcessCollector(namespace="nexttoken", registry=r)  # resident memory: the KV pool's pages as they fill

    def on_step(self, stats: EngineStats) -> None:
        """Called on the engine thread after every step: sample the token counter for the rate gauge."""
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, stats.generated_tokens_total))
            while len(self._samples) > 2 and self._samples[0][0] < now - _RATE_WINDOW_S:
                self._samples.popleft()

    def tokens_per_second(self) -> float:
        with self._lock:
            if len(self._samples) < 2:
                return 0.0
            (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        if time.monotonic() - t1 > _RATE_WINDOW_S:  # idle: nothing generated lately
            return 0.0
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def observe(self, event: TokenEvent, previous_time: float | None) -> None:
        """Record one event of a request; previous_time is that request's previous token time (None: first)."""
        if event.token_ids:
            if previous_time is None:
                self.ttft.observe(event.time - event.arrival_time)
                if event.scheduled_time is not None:
                    self.queue.observe(max(0.0, event.scheduled_time - event.arrival_time))
            else:
                self.itl.observe(event.time - previous_time)
        if event.finished:
            self.e2e.observe(event.time - event.arrival_time)
            self.finished.labels(event.finish_reason).inc()

    def grammar(self, compiled: Compiled) -> None:
        """A structured-output request's grammar: compiled now (its seconds observed) or found in the cache."""
        self.grammar_requests.labels("hit" if compiled.cached else "miss").inc()
        if not compiled.cached:
            self.grammar_compile.observe(compiled.seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read from the engine's latest stats snapshot when Prometheus scrapes."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):  # noqa: ANN201
        s = self.metrics.stats()
        yield _gauge("nexttoken_num_requests_running", "Sequences running (holding KV blocks)", s.num_running)
        yield _gauge("nexttoken_num_requests_waiting", "Sequences waiting (new, or preempted)", s.num_waiting)
        yield _gauge("nexttoken_max_num_seqs", "Sequences that may run at once (--max-num-seqs)", s.num_slots)
        yield _gauge("nexttoken_kv_cache_usage_ratio", "KV pool blocks in use / blocks of the pool", s.kv_usage)
        yield _gauge("nexttoken_kv_blocks_total", "KV pool blocks", s.kv_blocks_total)
        yield _gauge("nexttoken_kv_blocks_free", "KV pool blocks free (or holding a cached prefix nobody holds)", s.kv_blocks_free)
        yield _gauge("nexttoken_kv_blocks_cached", "KV pool blocks holding a cached prefix block", s.kv_blocks_cached)
        yield _gauge("nexttoken_kv_block_size_tokens", "Tokens per KV block", s.kv_block_size)
        yield _gauge("nexttoken_kv_cache_bytes", "KV pool size in bytes (reserved; pages are committed as used)", s.kv_cache_bytes)
        yield _counter("nexttoken_num_preemptions", "Sequences preempted (blocks freed, recomputed later)", s.preemptions_total)
        yield _gauge("nexttoken_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up", s.prefix_hit_rate)
        yield _gauge("nexttoken_generation_tokens_per_second", "Generated tokens/s over the last 10 s", self.metrics.tokens_per_second())
        yield _counter("nexttoken_prompt_tokens", "Prompt tokens received", s.prompt_tokens_total)
        yield _counter("nexttoken_generation_tokens", "Tokens generated", s.generated_tokens_total)
        yield _counter("nexttoken_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", s.prefix_queried_tokens)
        yield _counter("nexttoken_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", s.prefix_hit_tokens)
        yield _counter("nexttoken_engine_steps", "Engine steps run (one forward round each)", s.steps_total)
        yield _counter("nexttoken_spec_decode_draft_tokens", "Speculative draft tokens verified", s.spec_draft_tokens_total)
        yield _counter("nexttoken_spec_decode_accepted_tokens", "Speculative draft tokens kept", s.spec_accepted_tokens_total)
        yield _counter("nexttoken_spec_decode_verify_steps", "Speculative verification passes", s.spec_steps_total)
        yield _gauge("nexttoken_spec_decode_acceptance_rate", "Draft tokens kept / verified", s.spec_acceptance_rate)
        per_step = (s.spec_accepted_tokens_total + s.spec_steps_total) / s.spec_steps_total if s.spec_steps_total else 0.0
        yield _gauge("nexttoken_spec_decode_tokens_per_step", "Tokens emitted per verification pass (kept drafts + 1)", per_step)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
