"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, health, metrics, tokenize/detokenize."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from ..engine import LLMEngine, expand
from ..engine.async_engine import AsyncEngine, EngineClosedError, EngineDeadError
from ..errors import NextTokenError
from .errors import APIError, bad_request, error_body, from_validation_error
from .guards import ApiKeyGuard, BodyLimit, InternalErrors
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from ..generation.structured import CONSTRAINTS, compile_for, constraint_of
from ..tools import ToolCallParser, ToolsError, ToolUse
from ..tools.request import tool_options
from .options import constraint_field, request_options, server_defaults
from .requests import DEFAULT_COMPLETION_TOKENS, Limits, chat_prompt, check_ids, completion_prompts, new_tokens
from .responses import Choice, LogprobFormatter, TokenTexts, echo_logprobs, echo_token_texts, usage
from .shutdown import MESSAGE as SHUTTING_DOWN, Drain
from .streams import ClientGone, Job, SSEResponse, collect, run_jobs, sse
from .traces import TraceStore


log = logging.getLogger("nexttoken.server")


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_n: int = 8  # choices per request
    max_seqs_per_request: int = 256  # prompts x n: one request may not create more sequences than this
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a request body not fully sent by then gets 408
    shutdown_timeout_s: float = 10.0  # on SIGTERM / SIGINT: what is still running after this is aborted (503)
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser name; None: read off the chat template


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """The app over an engine (its model, tokenizer and defaults); the engine thread starts and stops with the
    app's lifespan."""
    metrics = ServerMetrics(lambda: async_engine.stats)
    async_engine = AsyncEngine(engine, on_step=metrics.on_step)
    api = OpenAIServing(engine, async_engine, metrics, settings)
    drain = Drain(settings.shutdown_timeout_s)  # cli.py starts its clock on the signal

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        drain.attach(asyncio.get_running_loop(), lambda: async_engine.close(SHUTTING_DOWN))
        yield
        async_engine.shutdown()

    app = FastAPI(title="nexttoken", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(ApiKeyGuard, api_key=settings.api_key)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                       drain=drain)
    app.add_middleware(InternalErrors)  # outermost of ours: whatever goes wrong below is a 500 in OpenAI's body

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: ("not_found_error", f"no route {request.url.path!r}: see /v1/models, /v1/completions, "
                                          "/v1/chat/completions, /tokenize, /detokenize, /health, /metrics"),
                 405: ("invalid_request_error", f"{request.method} is not allowed on {request.url.path!r}")}
        kind, message = kinds.get(exc.status_code, ("invalid_request_error", str(exc.detail)))
        return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)

    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.get("/v1/models")(api.models)
    app.get("/v1/models/{model_id:path}")(api.model)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.api_route("/health", methods=["GET", "HEAD"])(api.health)
    app.get("/metrics")(api.prometheus)
    app.get("/v1/traces/{trace_id}")(api.traces.get)
    app.state.engine, app.state.drain = async_engine, drain
    return app


def _parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from e


class OpenAIServing:
    def __init__(self, core: LLMEngine, engine: AsyncEngine, metrics: ServerMetrics, settings: ServerSettings) -> None:
        self.tokenizer, self.engine, self.metrics, self.settings = core.tokenizer, engine, metrics, settings
        self.limits = Limits(core.max_model_len, core.model.config.vocab_size, settings.max_n)
        self.base = server_defaults(core.generation_config)
        self.logprobs = LogprobFormatter(core.tokenizer)
        self.created = int(time.time())
        self.traces = TraceStore(settings.model_name)  # traced requests' explain pages

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.model_name:
            raise APIError(
                404, f"the model {name!r} does not exist; this server serves {self.settings.model_name!r}",
                "model", code="model_not_found",
            )

    def _options(self, req: Any, prompts: list[list[int]], max_tokens: int | None, param: str, **extra: Any) -> Any:
        """The request's GenerationConfig: its fields through the one translation table, the length checked."""
        count = len(prompts) * req.n
        if count > self.settings.max_seqs_per_request:
            raise bad_request(
                f"this request asks for {len(prompts)} prompts x n={req.n} = {count} sequences, over this server's "
                f"limit of {self.settings.max_seqs_per_request} (--max-seqs-per-request): split it", "prompt")
        wanted = new_tokens(prompts, max_tokens, req.n, self.limits, param)
        cfg = request_options(req, self.base, max_new_tokens=wanted, **extra)
        for name, ids in cfg.ids_outside(self.limits.vocab_size).items():  # bad_words_ids, logit_bias, ...
            raise bad_request(f"{name} contains token ids {ids[:5]} outside the vocabulary [0, "
                              f"{self.limits.vocab_size})", name)
        return cfg

    async def _compile(self, req: Any, cfg: Any, field: str | None = None) -> None:
        """Compile the request's grammar off the event loop (the engine then finds it cached); a constraint that
        cannot be enforced is a 400 naming what (and the field that carried it), before any work is queued."""
        if constraint_of(cfg) is None:
            return
        try:
            compiled = await asyncio.to_thread(compile_for, cfg, self.tokenizer, self.limits.vocab_size)
        except NextTokenError as e:
            raise bad_request(str(e), field or constraint_field(req)) from e
        self.metrics.grammar(compiled)  # type: ignore[arg-type]

    # ---- /v1/completions ---------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: CompletionRequest = _parse(CompletionRequest, await request.body())
        self._check_model(req.model)
        prompts = completion_prompts(req, self.tokenizer, self.limits.vocab_size)
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        cfg = self._options(req, prompts, max_tokens, "prompt", top_logprobs=req.logprobs or 0,
                            prompt_logprobs=req.echo and req.logprobs is not None)
        await self._compile(req, cfg)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = [Job(i, f"{rid}-{i}", ids, c, rid) for i, (ids, c) in enumerate(expand(prompts, cfg))]
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.settings.model_name}
        events = run_jobs(self.engine, jobs, self.metrics, arrival)
        if req.stream:
            return SSEResponse(self._completion_stream(req, jobs, head, events))
        return await self._completion_full(request, req, jobs, head, events)

    def _echo_text(self, req: CompletionRequest, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens) if self.tokenizer else ""

    def _token_texts(self, req: CompletionRequest, job: Job) -> TokenTexts | None:
        """A choice's token texts and offsets, read in context (with echo, from the prompt's first token)."""
        if req.logprobs is None:
            return None
        if req.echo:
            return echo_token_texts(self.tokenizer, job.prompt_ids, req.skip_special_tokens)
        return TokenTexts(self.tokenizer, req.skip_special_tokens)

    def _completion_logprobs(self, req: CompletionRequest, job: Job, ids: list[int], lps: list, tops: list,
                             with_prompt: bool, prompt_lp: list | None, texts: TokenTexts | None) -> dict | None:
        if texts is None:
            return None
        if with_prompt:
            p_values, p_tops = echo_logprobs(job.prompt_ids, prompt_lp)
            ids, lps, tops = job.prompt_ids + ids, p_values + lps, p_tops + tops
        return self.logprobs.completion(ids, lps, tops, texts)

    async def _completion_full(self, request: Request, req: CompletionRequest, jobs: list[Job], head: dict,
                               events: AsyncIterator) -> Response:
        choices = await _collect_choices(request, len(jobs), events)
        if choices is None:
            return Response(status_code=499)  # the client left; its requests were cancelled
        body = []
        for job, c in zip(jobs, choices):
            prefix = self._echo_text(req, job.prompt_ids) if req.echo else ""
            body.append({
                "index": job.index,
                "text": prefix + c.text,
                "logprobs": self._completion_logprobs(req, job, c.token_ids, c.logprobs, c.top_logprobs,
                                                      req.echo, c.prompt_logprobs, self._token_texts(req, job)),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **self._trace_field(c.trace),
            })
        n_prompt = sum(len(j.prompt_ids) for j in jobs[:: req.n])
        return JSONResponse({**head, "choices": body, "usage": usage(n_prompt, sum(len(c.token_ids) for c in choices),
                                                                     [c.speculated for c in choices])})

    async def _completion_stream(self, req: CompletionRequest, jobs: list[Job], head: dict,
                                 events: AsyncIterator) -> AsyncIterator[str]:
        started, completion_tokens, speculated = set(), 0, {}
        texts = [self._token_texts(req, job) for job in jobs]
        try:
            async for index, event in events:
                if event.finish_reason == "error":
                    yield sse(json.dumps(_engine_failure(event).body()))
                    break
                job = jobs[index]
                first = index not in started
                started.add(index)
                text = (self._echo_text(req, job.prompt_ids) if req.echo and first else "") + event.text
                lp = self._completion_logprobs(req, job, event.token_ids, event.logprobs, event.top_logprobs,
                                               req.echo and first, event.prompt_logprobs, texts[index])
                completion_tokens += len(event.token_ids)
                speculated[index] = (event.spec_draft_tokens, event.spec_accepted_tokens)
                if not (text or event.finished or lp):
                    continue
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": event.finish_reason,
                          "stop_reason": event.stop_reason, **self._trace_field(event.trace)}
                yield sse(json.dumps({**head, "choices": [choice]}))
        except NextTokenError as e:
            yield sse(json.dumps(bad_request(str(e)).body()))
        except (EngineClosedError, EngineDeadError) as e:
            yield sse(json.dumps(_unavailable(e).body()))
        if req.stream_options and req.stream_options.include_usage:
            n_prompt = sum(len(j.prompt_ids) for j in jobs[:: req.n])
            yield sse(json.dumps({**head, "choices": [],
                                  "usage": usage(n_prompt, completion_tokens, list(speculated.values()))}))
        yield sse("[DONE]")

    # ---- /v1/chat/completions ----------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: ChatCompletionRequest = _parse(ChatCompletionRequest, await request.body())
        self._check_model(req.model)
        use = self._tool_use(req.tools, req.tool_choice, req.parallel_tool_calls)
        tools = list(use.tools) if use is not None else None
        ids = await asyncio.to_thread(chat_prompt, req, self.tokenizer, tools)  # untrusted template work: off the loop
        check_ids(ids, self.limits.vocab_size, "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        cfg = self._options(req, [ids], max_tokens, "messages", top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0)
        if use is not None:
            cfg = self._with_tools(cfg, use)
        await self._compile(req, cfg, "tools" if use is not None and use.calls else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = [Job(j, f"{rid}-{j}", p, c, rid) for j, (p, c) in enumerate(expand([ids], cfg))]
        head = {"id": rid, "created": int(time.time()), "model": self.settings.model_name}
        events = run_jobs(self.engine, jobs, self.metrics, arrival)
        parsing = use if use is not None and use.calls else None
        if req.stream:
            return SSEResponse(self._chat_stream(req, jobs, head, events, parsing))
        choices = await _collect_choices(request, len(jobs), events)
        if choices is None:
            return Response(status_code=499)  # the client left; its requests were cancelled
        body = []
        for i, c in enumerate(choices):
            message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if parsing is not None:
                content, calls = parsing.parser().parse(c.text)  # type: ignore[union-attr]
                message["content"] = content
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
                    finish_reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
            body.append({
                "index": i,
                "message": message,
                "logprobs": self.logprobs.chat(c.token_ids, c.logprobs, c.top_logprobs) if req.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
                **self._trace_field(c.trace),
            })
        total = sum(len(c.token_ids) for c in choices)
        return JSONResponse({**head, "object": "chat.completion", "choices": body,
                             "usage": usage(len(ids), total, [c.speculated for c in choices])})

    def _trace_field(self, trace: dict | None) -> dict:
        """A traced choice's `trace` (its id and the URLs of its explain page and JSON); {} when not traced."""
        return {} if trace is None else {"trace": self.traces.add(trace)}

    def _tool_use(self, tools: list | None, tool_choice: Any, parallel: bool | None) -> ToolUse | None:
        template = self.tokenizer.chat_template_for(tools) if self.tokenizer is not None else None
        try:
            return ToolUse.of(tools, tool_choice, parallel, self.settings.tool_call_parser, template)
        except ToolsError as e:
            raise bad_request(str(e), e.param) from e

    def _with_tools(self, cfg: Any, use: ToolUse) -> Any:
        """The request's options with what its tools need (the calls' grammar; special tokens kept in the text
        when a call marker is one)."""
        try:
            return cfg.updated(**tool_options(use, self.tokenizer, {n: getattr(cfg, n) for n in CONSTRAINTS}))
        except ToolsError as e:
            raise bad_request(str(e), e.param) from e
        except NextTokenError as e:
            raise bad_request(str(e), "tools") from e

    async def _chat_stream(self, req: ChatCompletionRequest, jobs: list[Job], head: dict,
                           events: AsyncIterator, use: ToolUse | None) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}
        for job in jobs:  # the role comes first, in a chunk of its own, as OpenAI sends it
            delta = {"role": "assistant", "content": ""}
            yield sse(json.dumps({**head, "choices": [{"index": job.index, "delta": delta, "logprobs": None,
                                                       "finish_reason": None}]}))
        parsers = {job.index: use.parser() for job in jobs} if use is not None else {}
        completion_tokens, speculated = 0, {}
        try:
            async for index, event in events:
                if event.finish_reason == "error":
                    yield sse(json.dumps(_engine_failure(event).body()))
                    break
                completion_tokens += len(event.token_ids)
                speculated[index] = (event.spec_draft_tokens, event.spec_accepted_tokens)
                lp = self.logprobs.chat(event.token_ids, event.logprobs, event.top_logprobs) if req.logprobs else None
                choices = _chat_deltas(index, event, lp, parsers.get(index))
                if choices:
                    choices[-1].update(self._trace_field(event.trace))
                for choice in choices:
                    yield sse(json.dumps({**head, "choices": [choice]}))
        except NextTokenError as e:
            yield sse(json.dumps(bad_request(str(e)).body()))
        except (EngineClosedError, EngineDeadError) as e:
            yield sse(json.dumps(_unavailable(e).body()))
        if req.stream_options and req.stream_options.include_usage:
            yield sse(json.dumps({**head, "choices": [], "usage": usage(len(jobs[0].prompt_ids), completion_tokens,
                                                                        list(speculated.values()))}))
        yield sse("[DONE]")

    # ---- the rest ----------------------------------------------------------------------------------------------
    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str) -> dict:
        self._check_model(model_id)
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": self.created, "owned_by": "nexttoken",
                "max_model_len": self.limits.max_model_len}

    async def tokenize(self, request: Request) -> dict:
        req: TokenizeRequest = _parse(TokenizeRequest, await request.body())
        self._check_model(req.model)
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer", "prompt")
        if req.messages is not None:
            use = self._tool_use(req.tools, "none", None)
            ids = await asyncio.to_thread(chat_prompt, req, self.tokenizer, list(use.tools) if use else None)
        else:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> dict:
        req: DetokenizeRequest = _parse(DetokenizeRequest, await request.body())
        self._check_model(req.model)
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer", "tokens")
        check_ids(req.tokens, self.limits.vocab_size, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    async def health(self) -> Response:
        if self.engine.error is not None:  # what stopped it is in the server's log, not for clients
            return JSONResponse(error_body("the engine stopped: this server cannot generate; see its log",
                                           "internal_server_error"), 503)
        return Response(status_code=200)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _chat_deltas(index: int, event: Any, lp: dict | None, parser: ToolCallParser | None) -> list[dict]:
    """One event as chat chunks' choices: its content, or with tools each piece in a chunk of its own (the text
    outside calls as content; a call's id and name, then its argument text, as delta.tool_calls, as OpenAI sends
    them). Log-probs go with the first chunk, the finish with the last; an event with nothing to say sends none."""
    finish_reason = event.finish_reason
    if parser is None:
        deltas: list[dict] = [{"content": event.text}] if event.text else []
    else:
        pieces = parser.feed(event.text) + (parser.finish() if event.finished else [])
        deltas = [{"content": p} if isinstance(p, str) else {"tool_calls": [p.to_openai()]} for p in pieces]
        if finish_reason == "stop" and parser.calls:
            finish_reason = "tool_calls"
    if not deltas and (event.finished or (lp and lp["content"])):
        deltas = [{}]
    last = len(deltas) - 1
    return [{"index": index, "delta": delta, "logprobs": lp if k == 0 else None,
             "finish_reason": finish_reason if k == last else None,
             "stop_reason": event.stop_reason if k == last else None} for k, delta in enumerate(deltas)]


async def _collect_choices(request: Request, n: int, events: AsyncIterator) -> list[Choice] | None:
    """Every event of a non-streaming request, gathered per choice; None when the client left first."""
    choices = [Choice() for _ in range(n)]
    try:
        for index, event in await collect(request, events):
            choices[index].add(event)
    except ClientGone:
        return None
    except NextTokenError as e:
        raise bad_request(str(e)) from e
    except (EngineClosedError, EngineDeadError) as e:
        raise _unavailable(e) from e
    failed = next((c for c in choices if c.finish_reason == "error"), None)
    if failed is not None:
        raise _engine_failure(failed)
    return choices


def _unavailable(e: Exception) -> APIError:
    """The engine is closed (shutting down) or dead: a 503, retryable elsewhere or later."""
    if isinstance(e, EngineClosedError):
        return APIError(503, SHUTTING_DOWN, type="service_unavailable_error", code="server_shutting_down")
    return APIError(503, "the engine stopped: this server cannot generate; see its log", type="internal_server_error")


def _engine_failure(event: Any) -> APIError:
    """A request that failed inside the engine (its own options at run time; the others go on): a 500 in
    OpenAI's body for it alone. What failed is logged here, not sent."""
    log.error("a request failed inside the engine: %s", event.stop_reason)
    return APIError(500, "generation failed inside the engine for this request (other requests are not "
                         "affected); the server log has the details", type="internal_server_error")
