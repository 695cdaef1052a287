"""vLLM's run-time LoRA API: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key, as every
/v1/ path). The adapter is read off the event loop, then added to the model's slots on the engine's thread between
two steps; it is then a `model` requests may name and a card in /v1/models."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from ...engine.async_engine import EngineClosedError, EngineDeadError
from ...errors import NextTokenError, UnknownLoraError
from ...model.lora import Resolver, read_adapter
from ...model.weights.hub import resolve_adapter
from ..http.errors import APIError, bad_request
from ..openai.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from .serving import Serving, parse_body, unavailable


class LoraAdapters(Serving):
    # how a lora_path that is not a folder is fetched: a Hub id, from the Hub cache (downloaded when allowed)
    resolve: Resolver | None = staticmethod(resolve_adapter)

    async def load(self, request: Request) -> Response:
        req: LoadLoraAdapterRequest = parse_body(LoadLoraAdapterRequest, await request.body())
        registry, served = self.registry(), self.settings.served_names
        if req.lora_name in served or req.lora_name in registry.names:
            raise bad_request(f"the name {req.lora_name!r} is served already: unload it first, or choose another",
                              "lora_name")
        if registry.slots is None:
            raise bad_request("this server has no LoRA slots: start it with --enable-lora (or --lora-modules, "
                              "--max-loras)", "lora_name")
        try:
            adapter = await asyncio.to_thread(read_adapter, req.lora_name, req.lora_path, self.network.config,
                                              registry.max_rank, self.resolve)
            await self.engine.call(lambda engine: engine.add_lora(adapter, served))
        except (EngineClosedError, EngineDeadError) as e:  # before NextTokenError, their base: a 503
            raise unavailable(e) from e
        except NextTokenError as e:
            raise bad_request(str(e), "lora_path") from e
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    async def unload(self, request: Request) -> Response:
        req: UnloadLoraAdapterRequest = parse_body(UnloadLoraAdapterRequest, await request.body())
        try:
            await self.engine.call(lambda engine: engine.unload_lora(req.lora_name))
        except UnknownLoraError as e:
            raise APIError(404, str(e), "lora_name", type="not_found_error", code="lora_not_found") from e
        except (EngineClosedError, EngineDeadError) as e:
            raise unavailable(e) from e
        except NextTokenError as e:
            raise bad_request(str(e), "lora_name") from e
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")
