"""The HTTP server (FastAPI): the guards every request passes, and the routes to each API's handlers (api/)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineConfig, EngineStats, LLMEngine
from .api.responses import ResponseStore
from .api.traces import TraceStore
from .batch.routes import add_batch_routes
from .http.connections import AcceptErrors
from .http.errors import (ANTHROPIC_PATHS, OLLAMA_PATHS, APIError, anthropic_error_body, error_body_for,
                          ollama_error_body)
from .http.guards import ApiKeyGuard, BodyLimit, HostCheck, InternalErrors, JsonOnly
from .http.request_log import RequestLog
from .http.tracing import OtlpTracer
from .http.shutdown import MESSAGE as SHUTTING_DOWN, Drain
from .metrics import ServerMetrics
from .anthropic.protocol import CountTokensRequest, MessagesRequest
from .llamacpp.protocol import InfillRequest, LlamaCompletionRequest
from .ollama.schema import BODIES as OLLAMA_BODIES, ROUTES as OLLAMA_ROUTES
from .openai.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from .openai.responses import ResponsesRequest
from .openai.schema import (API_ERRORS, COMPLETION, COUNT, MESSAGE, RESPONSE, ROUTES, anthropic_operation, components,
                            operation)

# The other APIs' routes in /openapi.json: their request bodies and answers (Messages' errors in Anthropic's body).
MORE_BODIES = (ResponsesRequest, InfillRequest, LlamaCompletionRequest, MessagesRequest, CountTokensRequest, LoadLoraAdapterRequest,
               UnloadLoraAdapterRequest, *OLLAMA_BODIES)
# llama.cpp's answer body (/infill, /completion): the text, whether it ended, and at the end how and the counts
LLAMA_ANSWER = {"type": "object", "required": ["content", "stop"], "properties": {
    "index": {"type": "integer", "minimum": 0}, "content": {"type": "string"}, "stop": {"type": "boolean"},
    "model": {"type": "string"}, "stop_type": {"enum": ["eos", "limit", "word"]}, "stopping_word": {"type": "string"},
    "tokens_predicted": {"type": "integer", "minimum": 0}, "tokens_evaluated": {"type": "integer", "minimum": 0}}}
MORE_ROUTES = {
    "responses": operation(ResponsesRequest, RESPONSE, *API_ERRORS, stream=True),
    "infill": operation(InfillRequest, LLAMA_ANSWER, *API_ERRORS, stream=True),
    "completion": operation(LlamaCompletionRequest, LLAMA_ANSWER, *API_ERRORS, stream=True),
    "messages": anthropic_operation(MessagesRequest, MESSAGE, stream=True),
    "count_tokens": anthropic_operation(CountTokensRequest, COUNT),
    "load_lora": operation(LoadLoraAdapterRequest, {"type": "object"}, *API_ERRORS),
    "unload_lora": operation(UnloadLoraAdapterRequest, {"type": "object"}, *API_ERRORS),
    "admin": operation(None, {"type": "object", "required": ["id", "status"]}, *API_ERRORS, "403", "409"),
}
from .registry import LOADED, Entry, ModelCollector, ModelRegistry
from .router import ModelRouter
from .service import ModelService
from .settings import ServerSettings
from .webui import add_webui

__all__ = ["Parts", "ServerSettings", "build_app", "build_server"]


def _allowed(scope: dict) -> set[str]:
    """The methods the app's routes take on this request's path (for a 405's Allow header)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in scope["app"].router.routes:
        if route.matches(scope)[0] != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return methods


def add_ollama_routes(app: FastAPI, router: ModelRouter) -> None:
    """Ollama's API under /api/ (docs/serving.md): generation, embeddings and /api/show go to the model the body
    names (each model's Ollama API object, service.py); the listings are the registry's (router.py)."""
    for name in ("chat", "generate", "embed", "embeddings", "show"):
        app.post(f"/api/{name}", **OLLAMA_ROUTES[name])(router.route("ollama", name, ollama=True))
    app.get("/api/tags", **OLLAMA_ROUTES["tags"])(router.ollama_tags)
    app.get("/api/ps", **OLLAMA_ROUTES["ps"])(router.ollama_ps)
    app.get("/api/version", **OLLAMA_ROUTES["version"])(router.ollama_version)


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """The app over one engine (its model, tokenizer and defaults), handed over loaded; the engine thread starts
    and stops with the app's lifespan."""
    def one(parts: Parts) -> ModelRegistry:
        service = ModelService(engine, settings, parts.metrics, parts.traces, parts.stored, on_step=parts.on_step)
        return ModelRegistry([Entry(settings.model_name, settings.aliases, state=LOADED, service=service)])

    return build_server(one, settings, batch_concurrency=2 * engine.config.max_num_seqs)


@dataclass(frozen=True)
class Parts:
    """What every model's service shares: the metrics, the trace and response stores, the engines' step callback."""

    metrics: ServerMetrics
    traces: TraceStore
    stored: ResponseStore
    on_step: Callable[[EngineStats], None]


def build_server(make_registry: Callable[[Parts], ModelRegistry], settings: ServerSettings,
                 admin_without_key: bool = False, batch_concurrency: int | None = None) -> FastAPI:
    """The app over the models of the registry `make_registry` builds (server/registry.py): every API route goes
    to the model its request names. `admin_without_key`: the admin routes answer without an API key.
    `batch_concurrency`: the requests a batch (/v1/batches) runs at once (default: twice the engine's default
    max_num_seqs)."""
    registry: ModelRegistry | None = None
    # the loaded engines' numbers added up (nexttoken_*); each loaded model's own under its name (vllm:*, watched
    # by its service from its start to its unload)
    metrics = ServerMetrics(lambda: registry.stats(), settings.model_name, engines={})
    tracer = OtlpTracer(settings.otlp_traces_endpoint) if settings.otlp_traces_endpoint else None
    parts = Parts(metrics, TraceStore(settings.model_name), ResponseStore(),
                  lambda _: metrics.on_step(registry.stats()))  # one server-wide rate, whichever engine stepped
    registry = make_registry(parts)
    metrics.registry.register(ModelCollector(registry))
    router = ModelRouter(registry, metrics, parts.stored, admin=bool(settings.api_key) or admin_without_key)
    drain = Drain(settings.shutdown_timeout_s)  # cli.py starts its clock on the signal

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        asyncio.get_running_loop().set_exception_handler(AcceptErrors())  # out of descriptors: logged once a minute
        registry.start()
        drain.attach(asyncio.get_running_loop(), lambda: registry.close(SHUTTING_DOWN))
        yield
        await batches.close()  # running batches are cancelled (their answers so far kept in their files)
        registry.shutdown()
        if tracer is not None:
            tracer.close()  # the batched spans are exported before the process exits

    app = FastAPI(title="nexttoken", lifespan=lifespan, docs_url=None, redoc_url=None)
    # Starlette runs the last added first: errors, Host, CORS, the key, the media type, then the body is read.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                       drain=drain)
    app.add_middleware(JsonOnly)
    app.add_middleware(ApiKeyGuard, api_key=settings.api_key)
    # CORS: only the origins named by --allowed-origins may call from a browser (none by default: preflights fail)
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                       allow_headers=["*"])
    app.add_middleware(HostCheck, bound=settings.host, allowed=settings.allowed_hosts)
    app.add_middleware(InternalErrors)  # whatever goes wrong below is a 500 in OpenAI's body
    # outermost: one line (and span) per request, 500s too
    app.add_middleware(RequestLog, model_name=settings.model_name, tracer=tracer)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if request.url.path.startswith(ANTHROPIC_PATHS):  # each API answers in its own error body
            return JSONResponse(anthropic_error_body(exc.status, exc.message), status_code=exc.status)
        if request.url.path.startswith(OLLAMA_PATHS):
            return JSONResponse(ollama_error_body(exc.message), status_code=exc.status, headers=exc.headers)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: ("not_found_error", f"no route {request.url.path!r}: see /v1/models, /v1/completions, "
                                          "/v1/chat/completions, /v1/responses, /v1/messages, /v1/embeddings, /infill, /completion, /v1/traces/{id}, /v1/files, /v1/batches, /tokenize, /detokenize, /health, /metrics; Ollama's /api/chat, /api/generate, /api/embed, /api/tags, /api/show, /api/ps, /api/version"),
                 405: ("invalid_request_error", f"{request.method} is not allowed on {request.url.path!r}")}
        kind, message = kinds.get(exc.status_code, ("invalid_request_error", str(exc.detail)))
        body = error_body_for(request.url.path, exc.status_code, message, kind)
        headers = exc.headers
        if exc.status_code == 405:  # Starlette names the first matching route's methods; every route's count
            headers = {**(headers or {}), "Allow": ", ".join(sorted(_allowed(request.scope)))}
        return JSONResponse(body, status_code=exc.status_code, headers=headers)

    route = router.route  # (the API object, its method) of the model the request names
    app.post("/v1/completions", **ROUTES["completions"])(route("completions", "completions"))
    app.post("/v1/chat/completions", **ROUTES["chat"])(route("chat", "chat_completions"))
    for prefix in ("/v1", ""):  # clients with a base URL without /v1 (OpenAI's Responses examples) too
        app.post(f"{prefix}/responses", **MORE_ROUTES["responses"])(route("responses", "create"))
        app.get(f"{prefix}/responses/{{response_id}}", **ROUTES["response"])(router.get_response)
        app.delete(f"{prefix}/responses/{{response_id}}", **ROUTES["response"])(router.delete_response)
    app.post("/v1/embeddings", **ROUTES["embeddings"])(route("embeddings", "create"))
    app.post("/infill", **MORE_ROUTES["infill"])(route("infill", "infill"))
    app.post("/completion", **MORE_ROUTES["completion"])(route("infill", "completion"))
    app.post("/v1/messages", **MORE_ROUTES["messages"])(route("messages", "create"))
    app.post("/v1/messages/count_tokens", **MORE_ROUTES["count_tokens"])(route("messages", "count_tokens"))
    app.get("/v1/models", **ROUTES["models"])(router.models)
    app.get("/v1/models/{model_id:path}", **ROUTES["model"])(router.model)
    app.post("/tokenize", **ROUTES["tokenize"])(route("models", "tokenize"))
    app.post("/detokenize", **ROUTES["detokenize"])(route("models", "detokenize"))
    app.get("/health", **ROUTES["health"])(router.health)
    app.head("/health", include_in_schema=False)(router.health)
    app.get("/metrics", **ROUTES["metrics"])(router.prometheus)
    app.get("/v1/traces/{trace_id}", **ROUTES["trace"])(parts.traces.get)
    app.post("/v1/load_lora_adapter", **MORE_ROUTES["load_lora"])(route("loras", "load"))
    app.post("/v1/unload_lora_adapter", **MORE_ROUTES["unload_lora"])(route("loras", "unload"))
    app.post("/admin/models/{name:path}/load", **MORE_ROUTES["admin"])(router.load)
    app.post("/admin/models/{name:path}/unload", **MORE_ROUTES["admin"])(router.unload)
    # OpenAI's files and batches: a batch runs through this app's own routes (batch/), as `nexttoken run-batch`
    # does; each line's `model` picks its model as any request's does
    batches = add_batch_routes(app, batch_concurrency or 2 * EngineConfig.max_num_seqs, settings.api_key)
    add_ollama_routes(app, router)
    if settings.webui:
        add_webui(app)

    def openapi() -> dict:
        """FastAPI's document with the request models' schemas the routes' bodies refer to."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components(*MORE_BODIES))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    first = registry.entries[0]
    app.state.engine = first.service.engine if registry.single and first.state == LOADED else None
    app.state.registry, app.state.drain = registry, drain
    return app
