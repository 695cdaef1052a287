"""`nexttoken serve --model DIR`: load the model, build the app, run it under uvicorn."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..tools.formats import FORMATS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    p.add_argument("--model", help="Hugging Face model folder (default: the model packaged with nexttoken)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weights dtype (default float32 on CPU)")
    p.add_argument("--device", help="cpu (default) or cuda")
    p.add_argument("--quantize", choices=["int8", "int4", "bf16"],
                   help="weight-only quantization: int8 (per row), int4 (groups of 32), bf16 (bf16 weights, float32 "
                        "activations)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model name clients send (default: the folder's name)")
    p.add_argument("--api-key", help="require Authorization: Bearer <key> on the API paths")
    p.add_argument("--max-num-seqs", type=int, default=32, help="KV cache slots: requests decoded at once")
    p.add_argument("--max-model-len", type=int, help="tokens per request, prompt + output (default: the model's)")
    p.add_argument("--chunk-size", type=int, default=64, help="prefill chunk and prefix-cache block, in tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens computed per engine step")
    p.add_argument("--prefix-cache-blocks", type=int, default=256, help="prefix-cache capacity in blocks (0: off)")
    p.add_argument("--max-n", type=int, default=8, help="largest n (choices) a request may ask for")
    p.add_argument("--max-seqs-per-request", type=int, default=256,
                   help="most sequences (prompts x n) one request may create; more is a 400")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds to send a request body; later: 408")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT: seconds in-flight requests get to finish; then they are aborted (503) "
                        "and the process exits")
    p.add_argument("--tool-call-parser", choices=sorted(FORMATS),
                   help="the format the model writes tool calls in (vLLM's names; default: read off the chat "
                        "template)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice \"auto\" is always on when the call "
                        "format is known")
    spec = p.add_mutually_exclusive_group()
    spec.add_argument("--speculative-model", metavar="DIR",
                      help="speculative decoding with this draft model (same tokenizer) for every request")
    spec.add_argument("--speculative-ngram", action="store_true",
                      help="speculative decoding by prompt lookup (n-gram drafts from the request's own tokens)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens drafted per step (default 4)")
    lora = p.add_argument_group("LoRA adapters (docs/lora.md): a request's `model` names the adapter it runs under")
    lora.add_argument("--enable-lora", action="store_true",
                      help="keep adapter slots for POST /v1/load_lora_adapter (implied by the flags below)")
    lora.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
                      help="PEFT LoRA adapter folders served as models: NAME=PATH, or vLLM's JSON "
                           "'{\"name\": ..., \"path\": ...}'")
    lora.add_argument("--max-loras", type=int,
                      help="adapter slots: adapters served at once (default: the --lora-modules given, at least 1)")
    lora.add_argument("--max-lora-rank", type=int, default=16,
                      help="largest adapter rank a slot holds (default 16, vLLM's); a larger adapter is refused")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N ranks: N-1 local worker processes, or the ranks torchrun started "
                        "(docs/tensor_parallel.md)")
    p.add_argument("--tensor-parallel-timeout", type=float, default=60.0,
                   help="seconds a rank may stay silent (a step, or an idle heartbeat) before the server stops")
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from ..engine import EngineConfig, LLMEngine, SpeculativeConfig
    from ..pretrained import default_model_path, load_pretrained
    from .app import build_app
    from .settings import ServerSettings
    from .http.shutdown import BACKSTOP_S

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading {args.model or 'the packaged default model'} ...", file=sys.stderr, flush=True)
    model = None
    if args.tensor_parallel_size != 1:
        from ..engine.launch import load_sharded

        model = load_sharded(args.model or default_model_path(), args.tensor_parallel_size, args.dtype,
                             args.device, args.quantize, args.tensor_parallel_timeout, on_failure=_stop_now,
                             threads=args.threads)
    loaded = load_pretrained(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize, model=model)
    if args.enable_lora or args.lora_modules or args.max_loras:
        _attach_adapters(loaded.model, args)
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        chunk_size=args.chunk_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_cache_blocks=args.prefix_cache_blocks,
    )
    name = args.served_model_name or Path(loaded.path).name
    settings = ServerSettings(name, args.api_key, args.max_n, args.max_seqs_per_request, args.max_body_bytes,
                              args.body_timeout, args.shutdown_timeout, args.tool_call_parser)
    speculative = None
    if args.num_speculative_tokens < 1:
        print("nexttoken serve: --num-speculative-tokens must be >= 1", file=sys.stderr)
        return 2
    if args.speculative_ngram:
        speculative = SpeculativeConfig(args.num_speculative_tokens)
    elif args.speculative_model:
        draft = load_pretrained(args.speculative_model, dtype=args.dtype, device=args.device)
        if _vocab(draft) != _vocab(loaded):
            print(f"nexttoken serve: --speculative-model {args.speculative_model} has a different tokenizer from "
                  f"the model: a draft model must share it", file=sys.stderr)
            return 2
        speculative = SpeculativeConfig(args.num_speculative_tokens, draft.model)
    engine = LLMEngine(loaded.model, loaded.tokenizer, config, loaded.generation_config, speculative)
    app = build_app(engine, settings)
    print(f"serving {name!r} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    if not args.api_key and not _loopback(args.host):
        print(f"nexttoken serve: WARNING: listening on {args.host} without --api-key: anyone who can reach this "
              "address can use the model. Set --api-key KEY, or bind to 127.0.0.1.", file=sys.stderr, flush=True)
    drain = app.state.drain

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # noqa: ANN001 - uvicorn's signal handler
            drain.begin()  # in-flight requests get --shutdown-timeout seconds, then the rest is aborted (503)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + BACKSTOP_S)
    server = Server(config)
    server.run()
    return 0 if server.started else 1


def _attach_adapters(model, args: argparse.Namespace) -> None:  # noqa: ANN001
    """The model's adapter slots and the --lora-modules read into them; a bad adapter stops the server here."""
    from ..model.lora import attach, parse_modules, read_adapter

    modules = parse_modules(args.lora_modules)
    slots = attach(model, args.max_loras or max(len(modules), 1), args.max_lora_rank)
    for name, path in modules.items():
        slots.add(read_adapter(name, path, model.config, args.max_lora_rank))


def _stop_now(message: str) -> None:
    """A tensor-parallel rank died or hung: the sharded model cannot answer anything, so the server exits (code
    3) with the reason rather than serving errors; in-flight requests see their connection close."""
    import os

    print(f"nexttoken serve: stopping: {message}", file=sys.stderr, flush=True)
    os._exit(3)


def _vocab(loaded) -> object:  # noqa: ANN001
    tok = loaded.tokenizer
    return tok.backend.get_vocab() if tok is not None else loaded.model.config.vocab_size


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything
