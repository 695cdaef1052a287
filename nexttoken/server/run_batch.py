"""`nexttoken run-batch -i requests.jsonl -o results.jsonl`: a file of OpenAI requests run offline (vLLM's
run-batch), through the server's own routes in this process (batch/), with a progress bar on stderr.

Each answer is appended to the output file and flushed as it is ready, so a run that is killed loses only the
requests in flight; run again with the same output file, it answers only what the file does not have yet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from ..loadspec import PRECISION, SOURCE, LoadSpec, add_load_args
from .batch import ENDPOINTS
from .cli import default_threads


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="run a JSONL file of OpenAI requests (OpenAI's batch format) offline",
                       description="Run a JSONL file of requests in OpenAI's batch format ({\"custom_id\", "
                                   "\"method\": \"POST\", \"url\", \"body\"} per line; url one of "
                                   f"{', '.join(ENDPOINTS)}) through the server's own routes, many at once, and "
                                   "write one answer per line ({\"id\", \"custom_id\", \"response\": {\"status_code\", "
                                   "\"request_id\", \"body\"}, \"error\"}) as each is ready. A bad line is answered "
                                   "with its 400; run again with the same output file, only unanswered lines run.")
    p.add_argument("-i", "--input-file", required=True, metavar="REQUESTS.jsonl", help="the requests, one per line")
    p.add_argument("-o", "--output-file", required=True, metavar="RESULTS.jsonl",
                   help="the answers, one per line (appended to: a rerun resumes where the last run stopped)")
    add_load_args(p.add_argument_group("model and loading (nexttoken.LoadSpec's fields)"),
                  SOURCE + PRECISION + ("threads",))
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the names a request's `model` may give the model (the first is reported); default: the "
                        "folder's name, the GGUF file's stem, or the Hub id")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences running at once (the batch limit)")
    p.add_argument("--max-model-len", type=int, help="tokens per request, prompt + output (default: the model's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens computed per engine step")
    p.add_argument("--chunk-size", type=int, default=64, help="prefill chunk in tokens; prefix-cache hits are whole chunks")
    p.add_argument("--concurrency", type=int,
                   help="requests in flight at once (default: twice --max-num-seqs, so the batch stays full)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..engine import EngineConfig, LLMEngine
    from ..engine.embedding import model_pooling
    from ..errors import GenerationConfigError
    from ..loading import load
    from .app import build_app
    from .batch.lines import read_requests, resume
    from .settings import ServerSettings

    concurrency = args.concurrency or 2 * args.max_num_seqs
    if concurrency < 1:
        raise GenerationConfigError(f"--concurrency must be >= 1, got {concurrency}")
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                          max_num_batched_tokens=args.max_num_batched_tokens, chunk_size=args.chunk_size)
    requests = read_requests(args.input_file)  # a duplicate custom_id stops here, before the model loads
    todo = resume(args.output_file, requests)
    if not todo:
        print(f"all {len(requests)} requests are answered in {args.output_file}", file=sys.stderr)
        return 0
    spec = LoadSpec.from_args(args)
    if spec.threads is None:  # serve's default: the event loop that feeds the engine keeps a core
        spec = spec.replace(threads=default_threads())
    print(f"loading {spec.model or 'the packaged default model'} ...", file=sys.stderr, flush=True)
    loaded = load(spec).main
    name, *aliases = args.served_model_name or [loaded.name]
    settings = ServerSettings(name, pooling=model_pooling(loaded.path) or "last", webui=False, aliases=tuple(aliases))
    engine = LLMEngine(loaded.model, loaded.tokenizer, config, loaded.generation_config)
    app = build_app(engine, settings)
    # The answers, errors too, are in the output file: the request log says only what went wrong in the server.
    logging.getLogger("nexttoken.server.requests").setLevel(logging.ERROR)
    asyncio.run(_run(app, todo, args.output_file, concurrency, len(requests), args.progress))
    return 0


async def _run(app: Any, todo: list, output: str, concurrency: int, total: int, progress: bool) -> None:
    from tqdm import tqdm

    from .batch.runner import run_requests, started

    bar = tqdm(total=total, initial=total - len(todo), unit="req", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    with open(output, "a", encoding="utf-8") as out, bar:

        def on_answer(line: dict[str, Any]) -> None:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()  # a kill loses only the requests in flight
            bar.update(1)

        async with started(app):
            await run_requests(app, todo, on_answer, concurrency)
