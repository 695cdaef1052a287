"""The model and its tokenizer: GET /v1/models (and one model), POST /tokenize and /detokenize (vLLM's), and the
operator's GET /health and /metrics."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..http.errors import bad_request, error_body
from ..openai.prompts import check_ids, render_request, template_kwargs
from ..openai.protocol import DetokenizeRequest, TokenizeRequest
from .serving import Serving, parse_body


class Models(Serving):
    async def models(self) -> dict:
        """The base model, then each LoRA adapter with the base as its `parent` (vLLM's cards)."""
        return {"object": "list", "data": [self._model_card(None), *map(self._model_card, self.adapters())]}

    async def model(self, model_id: str) -> dict:
        return self._model_card(self._adapter(model_id))

    def _model_card(self, adapter: str | None) -> dict:
        card = {"id": adapter or self.settings.model_name, "object": "model", "created": self.created,
                "owned_by": "nexttoken", "root": self.settings.model_name, "parent": None,
                "max_model_len": self.limits.max_model_len}
        adapters = self.network.adapters
        loaded = None if adapter is None or adapters is None else adapters.loaded.get(adapter)
        if adapter is not None:
            card |= {"root": str(loaded.path) if loaded is not None else adapter, "parent": self.settings.model_name}
        return card

    async def tokenize(self, request: Request) -> dict:
        req: TokenizeRequest = parse_body(TokenizeRequest, await request.body())
        self._check_model(req.model)
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer", "prompt")
        if req.messages is not None:
            use = self._tool_use(req.tools, "none", None)
            prompt = await asyncio.to_thread(
                render_request, req, self.renderer, use,
                template_kwargs(self.settings.default_chat_template_kwargs, req), self.limits)
            ids = prompt.ids
        else:  # off the event loop: a long text takes the tokenizer a while
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> dict:
        req: DetokenizeRequest = parse_body(DetokenizeRequest, await request.body())
        self._check_model(req.model)
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer", "tokens")
        check_ids(req.tokens, self.limits.vocab_size, "tokens")
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, req.tokens)}

    async def health(self) -> Response:
        if self.engine.error is not None:  # what stopped it is in the server's log, not for clients
            return JSONResponse(error_body("the engine stopped: this server cannot generate; see its log",
                                           "internal_server_error"), 503)
        return Response(status_code=200)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
