"""`nexttoken bench load` (alias `nexttoken loadtest`): drive a running server with N concurrent streaming clients
and measure it.

Each client sends streaming /v1/completions requests (greedy, `ignore_eos`, a fixed max_tokens, so every run
does the same work) and records the time to first token and the gaps between tokens. With `--compare`, the
same requests first run one after another (concurrency 1), so the report shows what batching buys.

While it runs, the server's /metrics are read every half second: the report gives the KV pool's peak usage and
fewest free blocks, the preemptions and prefix-cache hit rate of the run, and the server's peak resident memory.
`--shared-prefix-words` starts every prompt with the same words (a system prompt), `--priority-every K` sends
every K-th request with priority -1 (ahead of the others under `--scheduling-policy priority`) and reports their
latency apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field

from .output import BenchError, percentiles, write_report

WORDS = ("the little cat dog girl boy park ball sun tree happy big red blue ran jumped saw played with "
         "her his mom friend bird house garden flower day time once upon there was a").split()


@dataclass
class RequestResult:
    ttft: float  # seconds to the first token
    itls: list[float]  # seconds between consecutive tokens
    latency: float
    completion_tokens: int
    ok: bool = True
    error: str = ""
    priority: int = 0


@dataclass
class RunReport:
    concurrency: int
    num_requests: int
    wall_s: float
    completion_tokens: int
    failed: int
    throughput_tok_s: float
    requests_per_s: float
    ttft_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    high_priority_latency_s: dict[str, float] = field(default_factory=dict)  # requests sent with priority -1
    high_priority_ttft_ms: dict[str, float] = field(default_factory=dict)
    server: dict[str, float] = field(default_factory=dict)  # from /metrics during the run (see ServerWatch)


def make_prompts(n: int, min_words: int, max_words: int, seed: int, shared_words: int = 0) -> list[str]:
    rng = random.Random(seed)
    shared = " ".join(random.Random(seed - 1).choice(WORDS) for _ in range(shared_words))
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]
    return [f"{shared} {p}" if shared else p for p in prompts]


class ServerWatch:
    """Reads the server's /metrics every `interval` seconds while a run goes on: peaks and the run's deltas."""

    GAUGES = ("nexttoken_kv_cache_usage_ratio", "nexttoken_kv_blocks_free", "nexttoken_kv_blocks_total",
              "nexttoken_process_resident_memory_bytes", "nexttoken_num_requests_running",
              "nexttoken_num_requests_waiting")
    COUNTERS = ("nexttoken_num_preemptions_total", "nexttoken_prefix_cache_queried_tokens_total",
                "nexttoken_prefix_cache_hit_tokens_total")

    def __init__(self, client, base_url: str, interval: float = 0.5) -> None:  # noqa: ANN001
        self.client, self.url, self.interval = client, base_url.rstrip("/") + "/metrics", interval
        self.samples: list[dict[str, float]] = []

    async def read(self) -> dict[str, float]:
        try:
            text = (await self.client.get(self.url)).text
        except Exception:  # noqa: BLE001 - a server without /metrics: the report has no server part
            return {}
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(nexttoken_\w+) (\S+)$", text, re.M)}

    async def watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            sample = await self.read()
            if sample:
                self.samples.append(sample)
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
        sample = await self.read()
        if sample:
            self.samples.append(sample)

    def summary(self) -> dict[str, float]:
        s = self.samples
        if not s:
            return {}

        def peak(name: str, pick=max) -> float:  # noqa: ANN001
            values = [x[name] for x in s if name in x]
            return pick(values) if values else 0.0

        def delta(name: str) -> float:
            return s[-1].get(name, 0.0) - s[0].get(name, 0.0)

        queried = delta("nexttoken_prefix_cache_queried_tokens_total")
        return {
            "kv_usage_peak": round(peak("nexttoken_kv_cache_usage_ratio"), 4),
            "kv_blocks_total": peak("nexttoken_kv_blocks_total"),
            "kv_blocks_free_min": peak("nexttoken_kv_blocks_free", min),
            "running_peak": peak("nexttoken_num_requests_running"),
            "waiting_peak": peak("nexttoken_num_requests_waiting"),
            "preemptions": delta("nexttoken_num_preemptions_total"),
            "prefix_hit_rate": round(delta("nexttoken_prefix_cache_hit_tokens_total") / queried, 4) if queried else 0.0,
            "rss_peak_mib": round(peak("nexttoken_process_resident_memory_bytes") / 2**20, 1),
        }


async def one_request(client, url: str, body: dict, headers: dict) -> RequestResult:  # noqa: ANN001
    start = time.perf_counter()
    times: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return RequestResult(0.0, [], time.perf_counter() - start, 0, False, f"{r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and (chunk["choices"][0].get("text") or chunk["choices"][0].get("logprobs")):
                    times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        return RequestResult(0.0, [], time.perf_counter() - start, 0, False, repr(e))
    if not times:
        return RequestResult(0.0, [], time.perf_counter() - start, tokens, False, "no tokens received")
    itls = [b - a for a, b in zip(times, times[1:])]
    return RequestResult(times[0] - start, itls, time.perf_counter() - start, tokens)


async def run_load(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                   api_key: str | None, priority_every: int = 0) -> tuple[RunReport, list[RequestResult]]:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    todo = list(enumerate(prompts))
    results: list[RequestResult | None] = [None] * len(prompts)

    async def worker(client) -> None:  # noqa: ANN001
        while todo:
            i, prompt = todo.pop(0)
            priority = -1 if priority_every and i % priority_every == priority_every - 1 else 0
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            if priority:
                body["priority"] = priority
            results[i] = await one_request(client, url, body, headers)
            results[i].priority = priority

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        watch, stop = ServerWatch(client, base_url), asyncio.Event()
        watcher = asyncio.create_task(watch.watch(stop))
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
        stop.set()
        await watcher
    done = [r for r in results if r is not None]
    report = summarize(concurrency, done, wall)
    report.server = watch.summary()
    return report, done


def summarize(concurrency: int, results: list[RequestResult], wall: float) -> RunReport:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    return RunReport(
        concurrency=concurrency,
        num_requests=len(results),
        wall_s=round(wall, 6),  # microseconds: the rates below are derived from it and a short run is ~50 ms
        completion_tokens=tokens,
        failed=len(results) - len(ok),
        throughput_tok_s=round(tokens / wall, 2) if wall else 0.0,
        requests_per_s=round(len(ok) / wall, 3) if wall else 0.0,
        ttft_ms=percentiles([r.ttft for r in ok], 1000),
        itl_ms=percentiles([x for r in ok for x in r.itls], 1000),
        latency_s=percentiles([r.latency for r in ok], 1),
        high_priority_latency_s=percentiles([r.latency for r in ok if r.priority < 0], 1),
        high_priority_ttft_ms=percentiles([r.ttft for r in ok if r.priority < 0], 1000),
    )


def plot(runs: list[tuple[RunReport, list[RequestResult]]], path: str) -> None:
    from ..extras import require

    matplotlib = require("matplotlib", "bench", "nexttoken bench load --plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = [f"concurrency {r.concurrency}" for r, _ in runs]
    axes[0].bar(labels, [r.throughput_tok_s for r, _ in runs], color=["#999", "#2a7"][: len(runs)] or None)
    axes[0].set_title("throughput (completion tokens/s)")
    for i, (r, _) in enumerate(runs):
        axes[0].text(i, r.throughput_tok_s, f"{r.throughput_tok_s:.0f}", ha="center", va="bottom")
    for (r, results), label in zip(runs, labels):
        ttft = sorted(x.ttft * 1000 for x in results if x.ok)
        itl = sorted(v * 1000 for x in results if x.ok for v in x.itls)
        if ttft:
            axes[1].plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=label)
        if itl:
            axes[2].plot(itl, [(i + 1) / len(itl) for i in range(len(itl))], label=label)
    axes[1].set_title("time to first token (CDF)")
    axes[1].set_xlabel("ms")
    axes[2].set_title("inter-token latency (CDF)")
    axes[2].set_xlabel("ms")
    axes[2].set_xscale("log")
    for ax in axes[1:]:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _print(report: RunReport) -> None:
    print(f"concurrency {report.concurrency}: {report.num_requests} requests ({report.failed} failed) in "
          f"{report.wall_s:.2f} s, {report.completion_tokens} tokens -> {report.throughput_tok_s:.1f} tok/s, "
          f"{report.requests_per_s:.2f} req/s")
    print(f"  TTFT ms {report.ttft_ms}\n  ITL ms  {report.itl_ms}\n  latency s {report.latency_s}")
    if report.high_priority_latency_s:
        print(f"  priority -1: latency s {report.high_priority_latency_s}, TTFT ms {report.high_priority_ttft_ms}")
    if report.server:
        print(f"  server {report.server}")


def add_parser(sub: argparse._SubParsersAction, name: str = "load") -> None:
    """`nexttoken bench load`; with name="loadtest", the same command at the top level (its older name)."""
    alias = " (the same as `nexttoken bench load`)" if name != "load" else ""
    p = sub.add_parser(name, help="load-test a running server: throughput, TTFT and ITL percentiles, plot" + alias)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--api-key", help="Bearer key, if the server wants one")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent streaming clients")
    p.add_argument("--num-requests", type=int, default=64, help="requests in the run")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (EOS ignored)")
    p.add_argument("--prompt-words", type=int, nargs=2, default=(4, 40), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0, help="seed for the synthetic prompts")
    p.add_argument("--shared-prefix-words", type=int, default=0,
                   help="start every prompt with the same N words (a shared system prompt)")
    p.add_argument("--priority-every", type=int, default=0, metavar="K",
                   help="send every K-th request with priority -1; their latency is reported apart")
    p.add_argument("--compare", action="store_true", help="first run the same requests sequentially")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--json", help="write the reports as JSON here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    model = args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if model is None:
        try:
            models = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        except httpx.HTTPError as e:
            raise BenchError(f"no server answers at {args.url} ({e}): start one with `nexttoken serve`") from e
        model = models.json()["data"][0]["id"]
    prompts = make_prompts(args.num_requests, *args.prompt_words, args.seed, args.shared_prefix_words)
    runs = []
    for concurrency in ([1] if args.compare else []) + [args.concurrency]:
        report, results = asyncio.run(run_load(args.url, model, prompts, concurrency, args.max_tokens, args.api_key,
                                               args.priority_every))
        _print(report)
        runs.append((report, results))
    if args.compare:
        ratio = runs[1][0].throughput_tok_s / max(runs[0][0].throughput_tok_s, 1e-9)
        print(f"throughput ratio, concurrency {args.concurrency} vs sequential: {ratio:.2f}x")
    if args.plot:
        plot(runs, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.json:
        write_report([asdict(r) for r, _ in runs], args.json)
    return 0 if all(r.failed == 0 for r, _ in runs) else 1
