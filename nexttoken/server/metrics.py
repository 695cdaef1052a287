"""Prometheus metrics: request latencies observed as events stream out, engine state read at scrape time.

Two sets of names: nexttoken's own (`nexttoken_*`, unlabelled) and vLLM's (`vllm:*`, each with the `model_name`
label of the model that served the request), so that dashboards and alerts written for vLLM read this server
unchanged (docs/serving.md, "Watching the server")."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.llm_engine import EngineStats
from ..engine.sequence import TokenEvent
from ..generation.processors.structured import Compiled

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, 10, 20, 40, 80)
# vLLM's request-latency buckets reach further: a long generation takes minutes
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 5M (vLLM's 1-2-5)
_RATE_WINDOW_S = 10.0
MODEL = ("model_name",)  # vLLM's label on every vllm:* metric


@dataclass
class SequenceClock:
    """One sequence's times, as its events arrive (monotonic seconds; None: not yet)."""

    first_token: float | None = None
    previous_token: float | None = None


class ServerMetrics:
    """`stats`: the engine's latest snapshot (a server of several models: theirs added up); `model_name`: the name
    its requests and gauges are labelled with. `engines`: the engines in the vllm:* gauges by model name (default:
    `stats` under `model_name`); more are added (and removed) with `watch`."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str = "model",
                 engines: dict[str, Callable[[], EngineStats]] | None = None) -> None:
        self.stats = stats  # the engine's latest snapshot
        self.model_name = model_name
        # vllm:* gauges, per model
        self.engines: dict[str, Callable[[], EngineStats]] = {model_name: stats} if engines is None else engines
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
        self.vllm = _VllmRequestMetrics(r)
        self._samples: deque[tuple[float, int]] = deque()  # (time, generated tokens) from the engine thread
        self._lock = threading.Lock()
        r.register(_EngineCollector(self))
        ProcessCollector(namespace="nexttoken", registry=r)  # resident memory: the KV pool's pages as they fill

    def watch(self, model_name: str, stats: Callable[[], EngineStats] | None) -> None:
        """Report (or, with None, stop reporting) the engine serving `model_name` in the vllm:* gauges."""
        if stats is None:
            self.engines.pop(model_name, None)
        else:
            self.engines[model_name] = stats

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

    def observe(self, event: TokenEvent, clock: SequenceClock, model: str | None = None) -> None:
        """Record one event of a sequence (its clock is updated); `model`: the label (default: this server's)."""
        label = model or self.model_name
        if event.token_ids:
            v = self.vllm.of(label)
            if clock.first_token is None:
                self.ttft.observe(event.time - event.arrival_time)
                v.ttft.observe(event.time - event.arrival_time)
                if event.scheduled_time is not None:
                    queued = max(0.0, event.scheduled_time - event.arrival_time)
                    self.queue.observe(queued)
                    v.queue.observe(queued)
                    v.prefill.observe(max(0.0, event.time - event.scheduled_time))
                clock.first_token = event.time
            else:
                gap = event.time - clock.previous_token  # type: ignore[operator]
                self.itl.observe(gap)
                v.itl.observe(gap)
                v.tpot_legacy.observe(gap)
            clock.previous_token = event.time
        if event.finished:
            self.e2e.observe(event.time - event.arrival_time)
            self.finished.labels(event.finish_reason).inc()
            self.vllm.finished(label, event, clock)

    def aborted(self, model: str | None = None) -> None:
        """A sequence whose client left before it finished (engine.stream's cleanup aborted it)."""
        self.finished.labels("abort").inc()
        self.vllm.success.labels(model or self.model_name, "abort").inc()

    def grammar(self, compiled: Compiled) -> None:
        """A structured-output request's grammar: compiled now (its seconds observed) or found in the cache."""
        self.grammar_requests.labels("hit" if compiled.cached else "miss").inc()
        if not compiled.cached:
            self.grammar_compile.observe(compiled.seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VllmRequestMetrics:
    """vLLM's per-request histograms and its finish counter (vllm/v1/metrics/loggers.py's names), per model; `of`
    hands out one model's children, made once (a label lookup per token would cost more than the observation)."""

    def __init__(self, r: CollectorRegistry) -> None:
        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"vllm:{name}", doc, MODEL, buckets=buckets, registry=r)

        self.families = {
            "ttft": hist("time_to_first_token_seconds", "Arrival to first token, seconds", _LATENCY_BUCKETS),
            "itl": hist("inter_token_latency_seconds", "Between consecutive tokens of a sequence, seconds",
                        _LATENCY_BUCKETS),
            "tpot_legacy": hist("time_per_output_token_seconds", "Between consecutive tokens (vLLM's older name of "
                                "inter_token_latency_seconds), seconds", _LATENCY_BUCKETS),
            "tpot": hist("request_time_per_output_token_seconds", "A finished sequence's decode time / (output "
                         "tokens - 1), seconds", _LATENCY_BUCKETS),
            "e2e": hist("e2e_request_latency_seconds", "Arrival to finish, seconds", _REQUEST_BUCKETS),
            "queue": hist("request_queue_time_seconds", "Arrival to first scheduled, seconds", _REQUEST_BUCKETS),
            "prefill": hist("request_prefill_time_seconds", "First scheduled to first token, seconds",
                            _REQUEST_BUCKETS),
            "decode": hist("request_decode_time_seconds", "First token to last, seconds", _REQUEST_BUCKETS),
            "inference": hist("request_inference_time_seconds", "First scheduled to finish, seconds",
                              _REQUEST_BUCKETS),
            "prompt_tokens": hist("request_prompt_tokens", "Prompt tokens of a finished sequence", _TOKEN_BUCKETS),
            "generation_tokens": hist("request_generation_tokens", "Tokens a finished sequence generated",
                                      _TOKEN_BUCKETS),
        }
        self.success = Counter("vllm:request_success", "Finished sequences, by finish reason (stop, length, abort)",
                               [*MODEL, "finished_reason"], registry=r)
        self._models: dict[str, SimpleNamespace] = {}

    def of(self, model: str) -> SimpleNamespace:
        """`model`'s histograms (children labelled with it), by the short names of `families`."""
        if model not in self._models:
            self._models[model] = SimpleNamespace(**{k: h.labels(model) for k, h in self.families.items()})
        return self._models[model]

    def finished(self, label: str, event: TokenEvent, clock: SequenceClock) -> None:
        """A sequence's last event: its whole-request histograms and its finish reason."""
        m = self.of(label)
        m.e2e.observe(event.time - event.arrival_time)
        self.success.labels(label, event.finish_reason).inc()
        m.prompt_tokens.observe(event.num_prompt_tokens)
        m.generation_tokens.observe(event.num_output_tokens)
        if event.scheduled_time is not None:
            m.inference.observe(max(0.0, event.time - event.scheduled_time))
        if clock.first_token is not None:
            m.decode.observe(event.time - clock.first_token)
            if event.num_output_tokens > 1:
                m.tpot.observe((event.time - clock.first_token) / (event.num_output_tokens - 1))


class _EngineCollector:
    """Gauges and counters read from the engines' latest stats snapshots when Prometheus scrapes."""

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
        yield _gauge("nexttoken_prefix_state_checkpoints", "Hybrid models: recurrent states kept where cached prefixes end", s.state_checkpoints)
        yield _gauge("nexttoken_prefix_state_checkpoint_bytes", "Hybrid models: memory reserved for those states", s.state_checkpoint_bytes)
        yield _counter("nexttoken_engine_steps", "Engine steps run (one forward round each)", s.steps_total)
        yield _counter("nexttoken_spec_decode_draft_tokens", "Speculative draft tokens verified", s.spec_draft_tokens_total)
        yield _counter("nexttoken_spec_decode_accepted_tokens", "Speculative draft tokens kept", s.spec_accepted_tokens_total)
        yield _counter("nexttoken_spec_decode_verify_steps", "Speculative verification passes", s.spec_steps_total)
        yield _gauge("nexttoken_spec_decode_acceptance_rate", "Draft tokens kept / verified", s.spec_acceptance_rate)
        per_step = (s.spec_accepted_tokens_total + s.spec_steps_total) / s.spec_steps_total if s.spec_steps_total else 0.0
        yield _gauge("nexttoken_spec_decode_tokens_per_step", "Tokens emitted per verification pass (kept drafts + 1)", per_step)
        yield from _vllm_families({name: stats() for name, stats in list(self.metrics.engines.items())})


# vLLM's engine-level names: (name, kind, help, the EngineStats value). Counters get `_total` when exposed.
_VLLM_ENGINE: tuple[tuple[str, str, str, Callable[[EngineStats], float]], ...] = (
    ("num_requests_running", "gauge", "Sequences in the running batch", lambda s: s.num_running),
    ("num_requests_waiting", "gauge", "Sequences waiting (new, or preempted)", lambda s: s.num_waiting),
    ("kv_cache_usage_perc", "gauge", "KV pool usage: 1 means 100 percent", lambda s: s.kv_usage),
    ("gpu_cache_usage_perc", "gauge", "KV pool usage: 1 means 100 percent (vLLM's older name of "
                                      "kv_cache_usage_perc)", lambda s: s.kv_usage),
    ("num_preemptions", "counter", "Sequences preempted (blocks freed, recomputed later)",
     lambda s: s.preemptions_total),
    ("prompt_tokens", "counter", "Prompt tokens of admitted sequences", lambda s: s.prompt_tokens_total),
    ("generation_tokens", "counter", "Tokens generated", lambda s: s.generated_tokens_total),
    ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache", lambda s: s.prefix_queried_tokens),
    ("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache", lambda s: s.prefix_hit_tokens),
    ("spec_decode_num_drafts", "counter", "Speculative verification passes (one draft each)",
     lambda s: s.spec_steps_total),
    ("spec_decode_num_draft_tokens", "counter", "Speculative draft tokens verified",
     lambda s: s.spec_draft_tokens_total),
    ("spec_decode_num_accepted_tokens", "counter", "Speculative draft tokens kept",
     lambda s: s.spec_accepted_tokens_total),
)


def _vllm_families(engines: dict[str, EngineStats]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """vLLM's engine gauges and counters, one sample per model."""
    for name, kind, doc, value in _VLLM_ENGINE:
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(f"vllm:{name}", doc, labels=MODEL)
        for model, stats in engines.items():
            family.add_metric([model], value(stats))
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
