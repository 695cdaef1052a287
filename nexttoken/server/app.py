"""The HTTP server (FastAPI): the guards every request passes, and the routes to each API's handlers (api/)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import LLMEngine
from ..engine.async_engine import AsyncEngine
from .api.chat import Chat
from .api.completions import Completions
from .api.lora import LoraAdapters
from .api.models import Models
from .api.traces import TraceStore
from .http.errors import APIError, error_body
from .http.guards import ApiKeyGuard, BodyLimit, InternalErrors
from .http.shutdown import MESSAGE as SHUTTING_DOWN, Drain
from .metrics import ServerMetrics
from .settings import ServerSettings

__all__ = ["ServerSettings", "build_app"]


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """The app over an engine (its model, tokenizer and defaults); the engine thread starts and stops with the
    app's lifespan."""
    metrics = ServerMetrics(lambda: async_engine.stats)
    async_engine = AsyncEngine(engine, on_step=metrics.on_step)
    traces = TraceStore(settings.model_name)  # one store: every API's traced choices are read back at one URL
    completions, chat, models, loras = (api(engine, async_engine, metrics, settings, traces)
                                        for api in (Completions, Chat, Models, LoraAdapters))
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

    app.post("/v1/completions")(completions.completions)
    app.post("/v1/chat/completions")(chat.chat_completions)
    app.get("/v1/models")(models.models)
    app.get("/v1/models/{model_id:path}")(models.model)
    app.post("/tokenize")(models.tokenize)
    app.post("/detokenize")(models.detokenize)
    app.api_route("/health", methods=["GET", "HEAD"])(models.health)
    app.get("/metrics")(models.prometheus)
    app.get("/v1/traces/{trace_id}")(traces.get)
    app.post("/v1/load_lora_adapter")(loras.load)
    app.post("/v1/unload_lora_adapter")(loras.unload)
    app.state.engine, app.state.drain = async_engine, drain
    return app
