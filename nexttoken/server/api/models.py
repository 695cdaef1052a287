"""The model and its tokenizer: GET /v1/models (and one model), POST /tokenize and /detokenize (vLLM's), and the
operator's GET /health and /metrics."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..http.errors import bad_request, error_body
from ..images import image_parts
from ..openai.prompts import check_ids, render_request, template_kwargs
from ..openai.protocol import DetokenizeRequest, TokenizeRequest
from .serving import Serving, parse_body


class Models(Serving):
    async def models(self) -> dict:
        """A card for each served name of the base model (vLLM's: every --served-model-name), then each LoRA adapter
        with the first name as its `parent`."""
        cards = [self._model_card(name) for name in self.settings.served_names]
        return {"object": "list", "data": cards + [self._adapter_card(a) for a in self.adapters()]}

    async def model(self, model_id: str) -> dict:
        adapter = self._adapter(model_id)  # an unknown name: 404
        return self._model_card(model_id) if adapter is None else self._adapter_card(adapter)

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "nexttoken",
                "root": self.settings.model_name, "parent": None, "max_model_len": self.limits.max_model_len,
                "generation_defaults": self.generation_defaults()}  # what a request that leaves a field out gets

    def _adapter_card(self, name: str) -> dict:
        loaded = self.registry().get(name)
        return self._model_card(name) | {"root": str(loaded.path) if loaded is not None else name,
                                         "parent": self.settings.model_name}

    async def tokenize(self, request: Request) -> dict:
        req: TokenizeRequest = parse_body(TokenizeRequest, await request.body())
        self._check_model(req.model)
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer", "prompt")
        if req.messages is not None:
            use = self._tool_use(req.tools, "none", None)
            refs = image_parts([m.model_dump(include={"content"}, exclude_none=True) for m in req.messages])
            images = await self.image_inputs(refs, req.model)  # each image's tokens counted as the chat counts them
            prompt = await asyncio.to_thread(
                render_request, req, self.renderer, use,
                template_kwargs(self.settings.default_chat_template_kwargs, req), self.limits, images)
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
