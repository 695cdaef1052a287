"""llama.cpp's own endpoints, over the completions request path, answered in llama.cpp's body (`content`, `stop`,
`stop_type`, token counts):

- POST /infill: fill in the middle (llama.vim, llama.vscode): the FIM prompt laid out by nexttoken/text/infill.py
  (context files, prefix, suffix, the middle's start), sampled as a Completions request would be;
- POST /completion: a prompt (text or token ids), or one with images as llama-server takes them (the prompt
  `{"prompt_string", "multimodal_data"}` with a `<__media__>` marker where each image goes, or the older
  `image_data` placed with `[img-<id>]`): each marker becomes the model's image placeholder, expanded to the
  image's tokens as the library's `LLM.generate(prompt, images=...)` does."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...engine import expand
from ..http.errors import APIError
from ..http.streams import Job, SSEResponse, run_jobs, sse
from ..images import ImageRef
from ..llamacpp.protocol import MEDIA_MARKER, InfillRequest, LlamaCompletionRequest, completion_body, media_prompt, \
    stop_type
from ..openai.prompts import check_ids, check_text_length, completion_prompts
from ..openai.protocol import CompletionRequest
from .completions import Completions
from .serving import collect_choices, parse_body
from .streaming import EventEncoder, Step, Tally, drive


class Infill(Completions):
    async def infill(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: InfillRequest = parse_body(InfillRequest, await request.body())
        self._check_model(req.model)
        extra = [(chunk.filename, chunk.text) for chunk in req.input_extra]
        ids = self._fim(req.input_prefix, req.input_suffix, extra, req.prompt, "input_prefix")
        creq: CompletionRequest = parse_body(CompletionRequest, json.dumps(completion_body(req, ids)).encode())
        cfg = self._options(creq, [ids], creq.max_tokens, "input_prefix")  # None: all the context has room for
        rid = f"infill-{uuid.uuid4().hex}"
        jobs = [Job(0, rid, p, c, rid) for p, c in expand([ids], cfg)]
        events = run_jobs(self.engine, jobs, self.metrics, arrival, model=self.settings.model_name)
        if req.stream:
            return SSEResponse(self._stream(len(ids), events))
        choices = await collect_choices(request, 1, events)
        if choices is None:
            return Response(status_code=499)
        c = choices[0]
        return JSONResponse(self._body(c.text, True, len(ids), len(c.token_ids), c.finish_reason, c.stop_reason))

    async def completion(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: LlamaCompletionRequest = parse_body(LlamaCompletionRequest, await request.body())
        self._check_model(req.model)
        text, urls = media_prompt(req) or (req.prompt, [])
        images: tuple = ()
        if not urls:
            ids = (await asyncio.to_thread(completion_prompts, text, self.tokenizer, self.limits))[0]
        else:
            param = "prompt.multimodal_data" if req.image_data is None else "image_data"
            refs = [ImageRef(url, f"{param}.{k}") for k, url in enumerate(urls)]
            inputs = await self.image_inputs(refs, req.model, "images in the prompt are not supported")
            expanded = inputs.expand(text.replace(MEDIA_MARKER, self.processor.placeholder))
            check_text_length(expanded, self.limits, "prompt")
            ids = await asyncio.to_thread(self.tokenizer.encode, expanded)
            check_ids(ids, self.limits.vocab_size, "prompt")
            images = self.placed(inputs, ids, "prompt")
        creq: CompletionRequest = parse_body(CompletionRequest, json.dumps(completion_body(req, ids)).encode())
        cfg = self._options(creq, [ids], creq.max_tokens, "prompt")  # None: all the context has room for
        await self._compile(creq, cfg)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = [Job(0, rid, p, c, rid, lora=self._adapter(req.model), images=images) for p, c in expand([ids], cfg)]
        self._admit(len(jobs))
        events = run_jobs(self.engine, jobs, self.metrics, arrival, reserved=True, model=self.settings.model_name)
        if req.stream:
            return SSEResponse(self._stream(len(ids), events))
        choices = await collect_choices(request, 1, events)
        if choices is None:
            return Response(status_code=499)
        c = choices[0]
        return JSONResponse(self._body(c.text, True, len(ids), len(c.token_ids), c.finish_reason, c.stop_reason))

    def _body(self, content: str, stop: bool, prompt: int, predicted: int, finish_reason: str | None,
              stop_reason: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"index": 0, "content": content, "stop": stop, "model": self.settings.model_name}
        if stop:
            body.update(stop_type=stop_type(finish_reason, stop_reason),
                        stopping_word=stop_reason if isinstance(stop_reason, str) else "",
                        tokens_predicted=predicted, tokens_evaluated=prompt)
        return body

    def _stream(self, prompt: int, events: AsyncIterator) -> AsyncIterator[str]:
        return drive(events, _InfillChunks(self, prompt))


class _InfillChunks(EventEncoder):
    """llama.cpp's /infill stream: a body per event with text (or the end), the last one with the counts."""

    def __init__(self, api: Infill, prompt: int) -> None:
        self.api, self.prompt = api, prompt

    def step(self, step: Step, tally: Tally) -> list[str]:
        event = step.event
        if not (event.text or event.finished):
            return []
        return [sse(self.api._body(event.text, event.finished, self.prompt, tally.tokens, event.finish_reason,
                                   event.stop_reason))]

    def failed(self, error: APIError, tally: Tally) -> list[str]:
        return [sse(error.body())]
