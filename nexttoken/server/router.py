"""Requests to the model they name: each API route reads the body's `model`, acquires that model from the registry
(loading it if needed) and hands the request to that model's handler; the model is held until the response is
sent. Also the routes about the models themselves: GET /v1/models (every model with its state), Ollama's /api/tags
(every model) and /api/ps (the loaded ones, with when they unload), /health, /metrics, the stored responses, and the
admin routes POST /admin/models/{name}/load and /unload."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .api.ollama import version_card
from .api.responses import ResponseStore
from .http.errors import APIError
from .metrics import ServerMetrics
from .ollama.models import TAG, ps_card, tag_card, unloaded_card
from .registry import LOADED, Entry, ModelRegistry, ModelUnavailableError, UnknownModelError

Handler = Callable[[Request], Awaitable[Response]]


class ModelRouter:
    """The server's routes over its registry. `admin`: whether the admin routes answer (with an API key set, or
    --admin-without-key)."""

    def __init__(self, registry: ModelRegistry, metrics: ServerMetrics, stored: ResponseStore,
                 admin: bool = False) -> None:
        self.registry, self.metrics, self.stored, self.admin = registry, metrics, stored, admin
        self.created = int(time.time())

    # ---- the APIs, by model ------------------------------------------------------------------------------------
    def route(self, api: str, method: str, ollama: bool = False) -> Handler:
        """The handler of one API route: `method` of the `api` object (service.py's names) of the model the
        request's body names. `ollama`: an Ollama route (its `name:latest` names the model too; a model it does
        not serve is Ollama's 404; a keep_alive it gives becomes the model's idle time before unloading)."""
        async def handler(request: Request) -> Any:
            body = await request.body()
            entry = await (self.acquire_ollama(_named(body, "name")) if ollama else self.acquire(_named(body)))
            try:
                response = await getattr(getattr(entry.service, api), method)(request)
            except BaseException:
                self.registry.release(entry)
                raise
            keep_alive = getattr(request.state, "keep_alive_s", None)  # seconds (inf: for good; 0: unload now)
            if keep_alive is not None:
                entry.idle_unload_s = keep_alive
            if not isinstance(response, Response):  # a dict, sent by FastAPI: the work is done
                self.registry.release(entry)
                return response
            return Held(response, lambda: self.registry.release(entry))

        handler.__name__ = f"{api}_{method}"
        return handler

    async def acquire(self, name: str | None) -> Entry:
        """The model `name` names, loaded and held (release it): an unknown name is a 404 naming the served
        models; a model that failed to load, a 503 with the reason."""
        try:
            return await self.registry.acquire(name)
        except UnknownModelError as e:
            raise APIError(404, str(e), "model", code="model_not_found") from None
        except ModelUnavailableError as e:
            raise APIError(503, f"{e}; the other models keep serving", "model", type="service_unavailable_error",
                           code="model_unavailable") from None

    async def acquire_ollama(self, name: str | None) -> Entry:
        """`acquire` for Ollama's routes: `name:latest` is `name`; a model this server does not serve is Ollama's
        404 (`model "x" not found`, in Ollama's body on /api/)."""
        try:
            return await self.acquire(name)
        except APIError as e:
            if e.status != 404:
                raise
            served = ", ".join(repr(n if ":" in n else f"{n}:{TAG}") for n in self.registry.names())
            raise APIError(404, f"model {name!r} not found: this server serves {served}", "model",
                           code="model_not_found") from None

    # ---- the models ----------------------------------------------------------------------------------------------
    async def models(self) -> dict:
        """A card for each name of each model (a loaded model's own cards, its LoRA adapters' too), each with the
        model's `status`: its state (unloaded, loading, loaded, failed), the reason it failed, its memory."""
        data = []
        for e in self.registry.entries:
            cards = (await e.service.models.models())["data"] if e.state == LOADED else [self._card(e, n)
                                                                                         for n in e.names]
            data += [card | {"status": status(e)} for card in cards]
        return {"object": "list", "data": data}

    async def model(self, model_id: str) -> dict:
        entry = self.registry.find(model_id)
        if entry is not None and entry.state == LOADED:
            return await entry.service.models.model(model_id) | {"status": status(entry)}
        if entry is None or model_id not in entry.names:
            raise APIError(404, str(self.registry.unknown(model_id)), "model", code="model_not_found")
        return self._card(entry, model_id) | {"status": status(entry)}

    def _card(self, entry: Entry, name: str) -> dict:
        """An unloaded model's card (a loaded one's comes from its own Models API)."""
        return {"id": name, "object": "model", "created": self.created, "owned_by": "nexttoken",
                "root": entry.name, "parent": None}

    async def ollama_tags(self) -> dict:
        """Ollama's /api/tags: every model under each of its names, loaded or not (a loaded model's card from its
        own Ollama API; an unloaded one's from its files), each with its `status` as in /v1/models."""
        cards = []
        for e in self.registry.entries:
            if e.state == LOADED:
                listed = [tag_card(m) for m in e.service.ollama.served_models()]
            else:
                listed = [unloaded_card(n, self._files_size(e), self._modified(e)) for n in e.names]
            cards += [card | {"status": status(e)} for card in listed]
        return {"models": cards}

    async def ollama_ps(self) -> dict:
        """Ollama's /api/ps: the loaded models, each with `expires_at`, when its idle unload is due (its last
        request + its idle time: Ollama's keep_alive, else --idle-unload-seconds; never: the year 9999)."""
        cards = []
        for e in self.registry.loaded():
            expires = self._expires(e)
            cards += [ps_card(dataclasses.replace(m, expires_at=expires)) | {"status": status(e)}
                      for m in e.service.ollama.served_models()]
        return {"models": cards}

    async def ollama_version(self) -> dict:
        return version_card()

    def _expires(self, entry: Entry) -> datetime | None:
        limit = entry.idle_unload_s if entry.idle_unload_s is not None else self.registry.idle_unload_s
        if limit is None or math.isinf(limit) or entry.choice is None:  # never unloaded
            return None
        return datetime.fromtimestamp(time.time() + entry.last_used + limit - time.monotonic(), timezone.utc)

    def _files_size(self, entry: Entry) -> int:
        return entry.choice.weight_bytes() if entry.choice is not None else 0

    def _modified(self, entry: Entry) -> datetime:
        """When its files changed (the server's start for a model not on disk)."""
        path = Path(entry.path).expanduser() if entry.path is not None else None
        stamp = path.stat().st_mtime if path is not None and path.exists() else self.created
        return datetime.fromtimestamp(stamp, timezone.utc)

    async def health(self) -> Response:
        """200 while the server answers; with one model, its engine's health (503 when it stopped)."""
        entry = self.registry.entries[0]
        if self.registry.single and entry.state == LOADED:
            return await entry.service.models.health()
        return Response(status_code=200)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- stored responses (one store for every model) ------------------------------------------------------------
    async def get_response(self, response_id: str) -> Response:
        return Response(self.stored.get(response_id)[0], media_type="application/json")

    async def delete_response(self, response_id: str) -> Response:
        self.stored.get(response_id)
        self.stored._drop(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # ---- admin -------------------------------------------------------------------------------------------------
    async def load(self, name: str) -> dict:
        """POST /admin/models/{name}/load: load it now (a failed model is tried again); its status."""
        self._check_admin()
        try:
            entry = await self.registry.load(name)
        except UnknownModelError as e:
            raise APIError(404, str(e), "model", code="model_not_found") from None
        except ModelUnavailableError as e:
            raise APIError(503, str(e), "model", type="service_unavailable_error", code="model_unavailable") from None
        return {"id": entry.name, "object": "model", "status": status(entry)}

    async def unload(self, name: str) -> dict:
        """POST /admin/models/{name}/unload: unload it now (409 while it has requests); its status."""
        self._check_admin()
        try:
            entry = await self.registry.unload(name)
        except UnknownModelError as e:
            raise APIError(404, str(e), "model", code="model_not_found") from None
        except ModelUnavailableError as e:
            raise APIError(409, str(e), "model", code="model_busy") from None
        return {"id": entry.name, "object": "model", "status": status(entry)}

    def _check_admin(self) -> None:
        if not self.admin:
            raise APIError(403, "the admin routes load and unload models for everyone: they answer only with an API "
                                "key set (--api-key), or with --admin-without-key", None, "permission_error",
                           code="admin_disabled")


def status(entry: Entry) -> dict[str, Any]:
    """A model's `status` in its cards: llama.cpp's router's `value` (its state), the reason it failed, its
    requests and, loaded, its memory in bytes and its context."""
    info = entry.describe()
    return {"value": info.pop("state"), **{k: v for k, v in info.items() if k not in ("name", "aliases", "path")}}


def _named(body: bytes, *more: str) -> str | None:
    """The `model` a JSON body names, else the first of the `more` fields it gives (Ollama's /api/show takes
    `name`); None: none, or not a JSON object (the model's own API says what is wrong)."""
    try:
        value = json.loads(body) if body else None
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("model")
    if not name:
        name = next((value[k] for k in more if value.get(k)), name)
    return name if isinstance(name, str) else None


class Held(Response):
    """A model's response that releases the model once it is sent, or fails, or its client leaves (a streamed body
    is still generating until then)."""

    def __init__(self, inner: Response, release: Callable[[], None]) -> None:  # noqa: D107 - no Response.__init__
        self.inner, self.release, self.background = inner, release, None
        self.status_code, self.raw_headers = inner.status_code, inner.raw_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.release()
        if self.background is not None:
            await self.background()
