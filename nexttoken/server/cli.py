"""`nexttoken serve --model DIR`: load the model, build the app, run it under uvicorn."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..collector import freeze_heap
from ..loadspec import PRECISION, SOURCE, LoadSpec, add_load_args
from ..chat.tools.formats import FORMATS
from ..chat.reasoning import FORMATS as REASONING_FORMATS

# engine/llm_engine.py's KV_CACHE_DTYPES and POLICIES, engine/block_manager.py's DEFAULT_MEMORY_FRACTION (named here
# so that the parser does not import torch; tests/engine/test_kv_pool.py checks they agree)
KV_CACHE_DTYPES = ("auto", "bf16", "float32", "int8")
POLICIES = ("fcfs", "priority")
DEFAULT_MEMORY_PERCENT = 25
DEFAULT_ENCODER_CACHE_BYTES = 64 * 2**20  # engine/encoder.py's (tests/server/test_image_requests.py checks they agree)
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def _bytes(text: str) -> int:
    """'2GiB', '512M', '1000000' -> bytes (argparse type)."""
    s = text.strip().upper().removesuffix("B")
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if u and s.endswith(u)), "")
    try:
        value = float(s[: len(s) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 2GiB, 512M, 1000000)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the KV pool needs at least one byte")
    return int(value)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    add_load_args(p.add_argument_group("model and loading (nexttoken.LoadSpec's fields; --model again for each "
                                       "more model, NAME=MODEL to name it)"), SOURCE + PRECISION,
                  model={"action": "append", "metavar": "[NAME=]MODEL"})
    many = p.add_argument_group("several models (docs/serving.md#several-models): a request's `model` picks one, "
                                "loaded on its first request")
    many.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                      help="serve every model folder and GGUF file in DIR, each by its name (a folder's name, a "
                           "file's stem); may be repeated")
    many.add_argument("--hf-cache", action="store_true",
                      help="serve every model in the Hugging Face cache (--download-dir, else $HF_HUB_CACHE or "
                           "~/.cache/huggingface/hub), by its Hub id (a GGUF file as id:stem)")
    many.add_argument("--presets", metavar="FILE",
                      help="each model's settings by name, in TOML or JSON (a [defaults] table and [models.NAME] "
                           "tables: load options, max_model_len, kv_cache_memory, chat_template, tool_call_parser, "
                           "...; a table with `model` adds that model); they win over the flags")
    many.add_argument("--idle-unload-seconds", type=float, metavar="SECONDS",
                      help="unload a model after this many seconds without requests (default: never); its next "
                           "request loads it again")
    many.add_argument("--memory-budget", type=_bytes, metavar="BYTES",
                      help="bytes the loaded models may hold together, weights + KV pool + working memory; loading "
                           "one unloads the least recently used idle ones to fit, and a model without a pool size "
                           "gets the room left (default: the memory available at start-up, less 10%% up to 1 GiB)")
    many.add_argument("--max-loaded-models", type=int, metavar="N",
                      help="models loaded at once; loading one more unloads the least recently used idle one "
                           "(default: as many as the memory budget holds)")
    many.add_argument("--admin-without-key", action="store_true",
                      help="answer POST /admin/models/{name}/load and /unload without --api-key (they are refused "
                           "without a key otherwise)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on: 127.0.0.1 (this machine only), 0.0.0.0 (every interface: set "
                        "--api-key)")
    p.add_argument("--port", type=int, default=8000, help="the TCP port to listen on")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model's names in requests: the first is the one reported (in /v1/models and responses), "
                        "the others are aliases (e.g. the two names Claude Code sends: docs/serving.md); default: the "
                        "folder's name, the GGUF file's stem, or the Hub id")
    p.add_argument("--api-key", help="require Authorization: Bearer <key> on the API paths")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences running at once (the batch limit)")
    p.add_argument("--max-model-len", type=int, help="tokens per request, prompt + output (default: the model's)")
    p.add_argument("--chunk-size", type=int, default=64, help="prefill chunk in tokens; prefix-cache hits are whole chunks")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens computed per engine step")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV blocks of common prompt prefixes between requests (default on)")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--kv-cache-memory", type=_bytes, metavar="BYTES",
                      help="KV pool size in bytes (suffixes K, M, G, T, Ki, Mi, Gi, Ti; default: "
                           f"{DEFAULT_MEMORY_PERCENT}%% of the memory available at start-up, at most "
                           "what --max-num-seqs full-length requests need)")
    pool.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks instead of bytes")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default 16; divides --chunk-size)")
    p.add_argument("--encoder-cache-memory", type=_bytes, default=DEFAULT_ENCODER_CACHE_BYTES, metavar="BYTES",
                   help="a vision-language model's image features kept for reuse (a second request with the same "
                        "image is not encoded again), taken out of the KV pool's memory; 0: none kept")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV pool element type: auto (the model's), float32, bf16 (half the memory of float32) or "
                        "int8 (a quarter, with per token and head scales)")
    p.add_argument("--scheduling-policy", choices=list(POLICIES), default="fcfs",
                   help="fcfs, or priority: a request's `priority` field (lower first) orders admission and "
                        "preemption")
    p.add_argument("--max-n", type=int, default=8, help="largest n (choices) a request may ask for")
    p.add_argument("--max-seqs-per-request", type=int, default=256,
                   help="most sequences (prompts x n) one request may create; more is a 400")
    p.add_argument("--max-body-bytes", type=int, default=32 << 20,
                   help="larger request bodies get 413 (32 MiB by default: a few photos inline, base64)")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds to send a request body; later: 408")
    p.add_argument("--max-images-per-request", type=int, default=8,
                   help="images one request may carry (a model that takes images); more is a 400")
    p.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                   help="pixels (width x height) of one image; larger is a 400, checked before decoding")
    p.add_argument("--max-image-bytes", type=_bytes, default=20 * 1024 * 1024, metavar="BYTES",
                   help="encoded bytes of one image (inline or fetched); larger is a 400 (a request's body is "
                        "bounded by --max-body-bytes too: raise it to send large images inline)")
    p.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s) image URLs in requests (off: only inline data: URLs); the server then "
                        "reaches URLs its clients name, a request-forgery risk: only public addresses are fetched, "
                        "within --remote-image-timeout and --max-image-bytes (docs/serving.md)")
    p.add_argument("--allow-private-image-urls", action="store_true",
                   help="with --allow-remote-images: fetch from loopback, private and other non-public addresses "
                        "too (only where every client is trusted)")
    p.add_argument("--remote-image-timeout", type=float, default=10.0,
                   help="seconds one remote image may take to fetch, connecting to the last byte; later: a 400")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection gets to send a request's headers (from connecting, or from the end "
                        "of the previous response); later it is closed (slow-header clients cannot hold it)")
    p.add_argument("--max-connections", type=int, default=512,
                   help="open connections served at once; more are closed as they arrive, and past it requests "
                        "get 503 (uvicorn's limit_concurrency)")
    p.add_argument("--max-waiting-seqs", type=int, default=1024,
                   help="sequences queued for a cache slot (on top of --max-num-seqs running); a request that "
                        "would queue more gets 429 with Retry-After")
    p.add_argument("--allowed-hosts", nargs="*", default=[],
                   help="host names the Host header may carry besides IP addresses, localhost and --host "
                        "(DNS rebinding guard); '*' allows any")
    p.add_argument("--allowed-origins", nargs="*", default=[],
                   help="web origins (https://app.example) that may call the API from a browser (CORS); none by "
                        "default, '*' allows any")
    p.add_argument("--no-special-tokens-in-content", dest="special_tokens_in_content", action="store_false",
                   help="encode a special token's text inside a chat message (\"<|im_start|>\") as plain text, not "
                        "as the special token (transformers' split_special_tokens); by default it is the special "
                        "token, as transformers and vLLM encode a rendered chat")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT: seconds in-flight requests get to finish; then they are aborted (503) "
                        "and the process exits")
    p.add_argument("--tool-call-parser", choices=sorted(FORMATS),
                   help="the format the model writes tool calls in (vLLM's names; default: read off the chat "
                        "template, or hermes' tools preamble for a template that renders no tools)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_FORMATS),
                   help="where the model writes its thinking (vLLM's names; default: read off the chat template): "
                        "sent as reasoning_content / reasoning, not content")
    p.add_argument("--reasoning-budget", type=int, metavar="N",
                   help="close a thinking block after N tokens (default: no limit; a request's reasoning effort "
                        "or thinking.budget_tokens sets its own)")
    p.add_argument("--default-chat-template-kwargs", type=json.loads, default={}, metavar="JSON",
                   help="chat template variables for every request, e.g. '{\"enable_thinking\": false}'; a "
                        "request's chat_template_kwargs override them")
    p.add_argument("--pooling", choices=["last", "mean", "cls"], default="last",
                   help="/v1/embeddings pooling for a model folder that declares none (sentence-transformers' "
                        "Pooling config wins where there is one)")
    p.add_argument("--structured-whitespace", choices=("compact", "flexible"), default="flexible",
                   help="JSON's whitespace under response_format / a JSON schema: flexible (the newlines and "
                        "indentation models write, bounded per gap) or compact (json.dumps' layout only); a request "
                        "sets its own with structured_outputs.whitespace")
    p.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                   help="auto (default, as vLLM's): a request that leaves out temperature, top_p, top_k, min_p, "
                        "repetition_penalty or max_tokens gets the model's generation_config.json value (a GGUF "
                        "file has none: then OpenAI's defaults, temperature 1 and all the context); vllm: OpenAI's "
                        "defaults always. GET /v1/models shows what applies (generation_defaults)")
    p.add_argument("--strict-json-schema", action=argparse.BooleanOptionalAction, default=True,
                   help="read JSON schemas (response_format, tool parameters) as clients write them: an object "
                        "with properties and no additionalProperties takes no other keys, numbers have at most 16 "
                        "integer and 10 fraction digits (llama.cpp's and XGrammar's reading; default); "
                        "--no-strict-json-schema: JSON Schema's literal reading. A request sets its own with "
                        "strict_json_schema")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="seconds a request waits for its structured-output grammar to compile (on a pool of its "
                        "own); later it gets 400, the compile finishes in the background and its result is cached "
                        "(default 10)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice \"auto\" is always on when the call "
                        "format is known")
    spec = p.add_mutually_exclusive_group()
    add_load_args(spec, ["draft_model"], flags={"draft_model": ["--speculative-model", "--draft-model"]})
    spec.add_argument("--speculative-ngram", action="store_true",
                      help="speculative decoding by prompt lookup (n-gram drafts from the request's own tokens)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens drafted per step")
    lora = p.add_argument_group("LoRA adapters (docs/lora.md): a request's `model` names the adapter it runs under")
    lora.add_argument("--enable-lora", action="store_true",
                      help="keep adapter slots for POST /v1/load_lora_adapter (implied by the flags below)")
    add_load_args(lora, ["lora", "max_loras", "max_cpu_loras", "max_lora_rank"], flags={"lora": ["--lora-modules"]},
                  lora={"action": "store", "nargs": "+", "metavar": "NAME=PATH", "default": []},
                  max_lora_rank={"default": 16, "shown": "16, vLLM's"})
    add_load_args(p, ["tensor_parallel_size", "tensor_parallel_timeout"])
    p.add_argument("--threads", type=int,
                   help=f"torch intra-op threads (default: the usable cores minus one, {default_threads()} here: the "
                        "event loop needs a core of its own; torch's own default takes every core and its OpenMP "
                        "threads spin against the loop: 300 streamed requests at concurrency 32 on 2 cores took "
                        "439 s with it, 23-25 s with 1 thread). With more than one thread, OpenMP's idle threads "
                        "sleep (OMP_WAIT_POLICY=PASSIVE) unless OMP_WAIT_POLICY is set")
    p.add_argument("--no-mmap", dest="mmap", action="store_false",
                   help="read a GGUF file into memory instead of mapping it (llama.cpp's --no-mmap): the server no "
                        "longer depends on the file, so truncating or replacing it cannot kill the server (with the "
                        "map, the next request dies of SIGBUS); its pages cannot be shared or dropped by the kernel")
    p.add_argument("--no-webui", dest="webui", action="store_false",
                   help="do not serve the chat page at / (docs/webui.md); the API is unchanged")
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.add_argument("--request-log-level", choices=("debug", "info", "warning", "error", "off"), default="info",
                   help="the request log on stderr: info (default) one line per request (method, path, status, "
                        "model, tokens, duration, request id); warning: only errors, with their cause; error: only "
                        "5xx (with the traceback); off: none; debug: /health and /metrics too")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="the request log's (and nexttoken's other log lines') format on stderr: text (default), or "
                        "json: one JSON object per line (time, level, logger, message; a request's line adds "
                        "request_id, method, path, status, model, api, prompt_tokens, completion_tokens, ttft_ms, "
                        "duration_ms, finish_reason, sampling, error)")
    p.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="export an OpenTelemetry trace of each request to this OTLP/HTTP collector (e.g. "
                        "http://localhost:4318/v1/traces; a URL without a path gets /v1/traces): a span per "
                        "request with vLLM's gen_ai.* attributes, a child of the caller's W3C traceparent. Needs "
                        "pip install 'nexttoken[otel]'")
    p.set_defaults(run=run)


def _configure_logging(request_level: str, log_format: str = "text") -> None:
    """nexttoken's loggers to stderr, with time and level (--log-format: text or JSON lines); the request log at
    --request-log-level."""
    import logging

    from .http.log_format import formatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger("nexttoken")
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    root.propagate = False
    level = logging.CRITICAL + 1 if request_level == "off" else getattr(logging, request_level.upper())
    logging.getLogger("nexttoken.server.requests").setLevel(level)
    logging.getLogger("nexttoken.server.models").setLevel(logging.INFO)  # each load and unload, with its memory


def default_threads() -> int:
    """torch's intra-op threads when --threads is not given: the usable cores minus one, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def _passive_openmp(threads: int) -> None:
    """With several torch threads, let OpenMP's idle ones sleep (OMP_WAIT_POLICY=PASSIVE) rather than spin
    against the event loop, unless the user set a policy. libgomp reads the variable once, when torch loads it: it
    is set before torch is imported (`nexttoken serve` imports none before this), or, when torch is loaded already and this
    process is the `nexttoken serve` command, the command starts again with it set (os.execv: the same process
    id; the imports once more)."""
    if threads <= 1 or "OMP_WAIT_POLICY" in os.environ:
        return
    loaded = "torch" in sys.modules
    command = sys.argv[1:2] == ["serve"] and sys.orig_argv[-len(sys.argv) + 1:] == sys.argv[1:]
    if loaded and not command:
        return  # serve called in-process (tests, embedding apps): their process, their policy
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if loaded:
        os.execv(sys.executable, sys.orig_argv)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .catalog import PresetError, build_catalog

    try:
        spec = _spec(args)  # every loading flag checked, before a file is read
        if spec.threads is None and spec.tensor_parallel_size == 1:
            spec = spec.replace(threads=default_threads())
        choices = build_catalog(args.model or [], args.models_dir, args.hf_cache, args.presets, spec,
                                args.served_model_name or ())
    except PresetError as e:
        print(f"nexttoken serve: {e}", file=sys.stderr)
        return 2
    _passive_openmp(spec.threads or 0)  # before torch loads (LoadSpec's module and the parsers import none)
    openmp = os.environ.get("OMP_WAIT_POLICY", "unset")  # as libgomp will read it when torch loads, just below
    from ..engine import EngineConfig
    from ..engine.fit import default_budget
    from ..errors import GenerationConfigError
    from .app import build_server
    from .registry import LOADED, Entry, ModelRegistry
    from .service import Loader
    from .settings import ServerSettings
    from .http.connections import protocol
    from .http.shutdown import BACKSTOP_S

    if args.otlp_traces_endpoint:  # the extra and the URL checked before a model loads
        from ..errors import MissingExtraError
        from .http.tracing import require_otel, traces_url

        try:
            require_otel()
            traces_url(args.otlp_traces_endpoint)
        except (MissingExtraError, ValueError) as e:
            print(f"nexttoken serve: {e}", file=sys.stderr)
            return 2
    try:
        config = EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            chunk_size=args.chunk_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_memory=args.kv_cache_memory,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            scheduling_policy=args.scheduling_policy,
            encoder_cache_memory=args.encoder_cache_memory,
        )
    except GenerationConfigError as e:
        print(f"nexttoken serve: {e}", file=sys.stderr)
        return 2
    for choice in choices:  # each model's own engine settings checked now, not at its first request
        try:
            EngineConfig(**{**config.__dict__, **choice.engine})
        except (GenerationConfigError, TypeError) as e:
            print(f"nexttoken serve: model {choice.name!r} (--presets): {e}", file=sys.stderr)
            return 2
    if not isinstance(args.default_chat_template_kwargs, dict):
        print("nexttoken serve: --default-chat-template-kwargs must be a JSON object, e.g. "
              "'{\"enable_thinking\": false}'", file=sys.stderr)
        return 2
    for flag, value in (("--header-timeout", args.header_timeout), ("--max-connections", args.max_connections),
                        ("--max-waiting-seqs", args.max_waiting_seqs + 1),
                        ("--grammar-compile-timeout", args.grammar_compile_timeout),
                        ("--max-images-per-request", args.max_images_per_request),
                        ("--max-image-pixels", args.max_image_pixels), ("--max-image-bytes", args.max_image_bytes),
                        ("--remote-image-timeout", args.remote_image_timeout),
                        ("--idle-unload-seconds", 1 if args.idle_unload_seconds is None else args.idle_unload_seconds),
                        ("--max-loaded-models", args.max_loaded_models or 1)):
        if value <= 0:
            print(f"nexttoken serve: {flag} must be > 0{' (or 0 for the waiting queue)' if 'waiting' in flag else ''}",
                  file=sys.stderr)
            return 2
    first = choices[0]
    settings = ServerSettings(first.name, args.api_key, args.max_n, args.max_seqs_per_request, args.max_body_bytes,
                              args.body_timeout, args.shutdown_timeout, args.tool_call_parser,
                              reasoning_parser=args.reasoning_parser, reasoning_budget=args.reasoning_budget,
                              default_chat_template_kwargs=args.default_chat_template_kwargs,
                              pooling=args.pooling, webui=args.webui,
                              structured_whitespace=args.structured_whitespace,
                              strict_json_schema=args.strict_json_schema, host=args.host,
                              generation_config=args.generation_config,
                              allowed_hosts=tuple(args.allowed_hosts), allowed_origins=tuple(args.allowed_origins),
                              max_waiting_seqs=args.max_waiting_seqs,
                              special_tokens_in_content=args.special_tokens_in_content, aliases=first.aliases,
                              grammar_compile_timeout_s=args.grammar_compile_timeout,
                              otlp_traces_endpoint=args.otlp_traces_endpoint,
                              max_images_per_request=args.max_images_per_request,
                              max_image_pixels=args.max_image_pixels, max_image_bytes=args.max_image_bytes,
                              allow_remote_images=args.allow_remote_images,
                              allow_private_image_urls=args.allow_private_image_urls,
                              remote_image_timeout_s=args.remote_image_timeout)
    if args.num_speculative_tokens < 1:
        print("nexttoken serve: --num-speculative-tokens must be >= 1", file=sys.stderr)
        return 2
    speculative = {"speculative_ngram": args.speculative_ngram, "num_speculative_tokens": args.num_speculative_tokens}
    budget = args.memory_budget or default_budget(spec.device or "cpu")

    def registry(parts) -> ModelRegistry:  # noqa: ANN001 - app.Parts
        loader = Loader(config, settings, parts.metrics, parts.traces, parts.stored, speculative, parts.on_step,
                        _stop_now)  # a rank that dies or hangs stops the server (_stop_now)
        entries = [Entry(c.name, c.aliases, c) for c in choices]
        if len(choices) == 1:  # one model: loaded before the server starts, as it always was
            print(f"loading {first.spec.model or 'the packaged default model'} ...", file=sys.stderr, flush=True)
            service = loader(first, budget)
            entries[0].service, entries[0].state, entries[0].loads = service, LOADED, 1
            entries[0].size = service.memory.total_bytes
            print(f"memory: {service.memory.describe()}", file=sys.stderr, flush=True)
        return ModelRegistry(entries, loader, budget, args.idle_unload_seconds, args.max_loaded_models)

    try:
        app = build_server(registry, settings, args.admin_without_key)
    except GenerationConfigError as e:  # a KV pool that cannot be had: the bytes and the flags, no traceback
        print(f"nexttoken serve: {e}", file=sys.stderr)
        return 2
    _configure_logging(args.request_log_level, args.log_format)
    name = first.name if len(choices) == 1 else f"{len(choices)} models ({', '.join(c.name for c in choices)})"
    print(f"serving {name if len(choices) > 1 else repr(name)} on http://{args.host}:{args.port}"
          + (f" (chat page: http://{args.host}:{args.port}/)" if args.webui else ""), file=sys.stderr, flush=True)
    print(f"threads: {spec.threads or 'torch default'} (OMP_WAIT_POLICY={openmp})", file=sys.stderr, flush=True)
    if not args.api_key and not _loopback(args.host):
        print(f"nexttoken serve: WARNING: listening on {args.host} without --api-key: anyone who can reach this "
              "address can use the model. Set --api-key KEY, or bind to 127.0.0.1.", file=sys.stderr, flush=True)
    drain = app.state.drain

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # noqa: ANN001 - uvicorn's signal handler
            drain.begin()  # in-flight requests get --shutdown-timeout seconds, then the rest is aborted (503)
            super().handle_exit(sig, frame)

    # h11 with a header timeout and a connection limit (http/connections.py); past the limit uvicorn answers 503.
    server_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + BACKSTOP_S,
                            http=protocol(args.header_timeout, args.max_connections),
                            limit_concurrency=args.max_connections + 1)
    _raise_open_files_limit(args.max_connections)
    # the startup heap (torch, the loaded models) out of every later full collection, as vLLM does once started
    print(f"gc: {freeze_heap()} startup objects frozen (collections during serving skip them)", file=sys.stderr,
          flush=True)
    server = Server(server_config)
    server.run()
    return 0 if server.started else 1


def _raise_open_files_limit(max_connections: int) -> None:
    """Let the soft open-files limit cover --max-connections (with room for the model's files and the engine),
    up to the hard limit; warn when it cannot."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            print(f"nexttoken serve: WARNING: the open-files limit ({hard}) is below --max-connections "
                  f"{max_connections} + 256: lower --max-connections or raise ulimit -n", file=sys.stderr, flush=True)


def _spec(args: argparse.Namespace) -> LoadSpec:
    """The load specification of serve's flags, but the model: --enable-lora keeps at least one adapter slot."""
    spec = LoadSpec.from_args(args, model=None)  # each served model's own (catalog.py)
    if args.enable_lora and not spec.max_loras:
        spec = spec.replace(max_loras=max(len(spec.lora or {}), 1))
    return spec


def _stop_now(message: str) -> None:
    """A tensor-parallel rank died or hung: the sharded model cannot answer anything, so the server exits (code
    3) with the reason rather than serving errors; in-flight requests see their connection close."""
    import os

    print(f"nexttoken serve: stopping: {message}", file=sys.stderr, flush=True)
    os._exit(3)


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything
