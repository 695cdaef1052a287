"""POST /v1/embeddings: OpenAI's Embeddings API over the engine's prefill (engine/embedding.py): each input's final
hidden states pooled (the model folder's pooling, else --pooling), normalized, cut to `dimensions`, as float lists
or base64 (little-endian float32, what the `openai` client decodes)."""

from __future__ import annotations

import asyncio
import base64

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...engine.async_engine import EngineClosedError, EngineDeadError
from ...engine.embedding import EmbeddingError
from ..http.errors import bad_request
from ..http.request_log import current_request
from ..openai.prompts import completion_prompts
from ..openai.protocol import EmbeddingRequest
from .serving import Serving, parse_body, unavailable

MAX_INPUTS = 2048  # inputs per request, OpenAI's limit


class Embeddings(Serving):
    async def create(self, request: Request) -> Response:
        req: EmbeddingRequest = parse_body(EmbeddingRequest, await request.body())
        self._check_model(req.model)
        count = len(req.input) if isinstance(req.input, list) and not isinstance(req.input[0], int) else 1
        if count > MAX_INPUTS:
            raise bad_request(f"input has {count} items, over the limit of {MAX_INPUTS} per request (OpenAI's): "
                              "split it into several requests", "input")
        prompts = await asyncio.to_thread(completion_prompts, req.input, self.tokenizer, self.limits, "input")
        longest = max(len(p) for p in prompts)
        if longest > self.limits.max_model_len:
            raise bad_request(f"an input has {longest} tokens, over this model's maximum context length of "
                              f"{self.limits.max_model_len}: shorten it", "input")
        try:
            vectors = await self.engine.embed(prompts, self.settings.pooling, req.normalize, req.dimensions)
        except EmbeddingError as e:
            raise bad_request(str(e), "dimensions" if "dimensions" in str(e) else "input") from e
        except (EngineClosedError, EngineDeadError) as e:
            raise unavailable(e) from e
        record = current_request()  # the request log's line: its model and prompt tokens
        if record is not None:
            for prompt in prompts:
                record.started(prompt, None, self.settings.model_name)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        tokens = sum(len(p) for p in prompts)
        return JSONResponse({"object": "list", "data": data, "model": self.settings.model_name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encoded(vector: torch.Tensor, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()
