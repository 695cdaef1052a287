"""POST /v1/completions: OpenAI's Completions API (prompts as text or ids, echo, log-probs, n, streaming, and
`suffix`: fill in the middle with the model's FIM tokens)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...engine import expand
from ...text.infill import InfillError, fim_prompt
from ..http.errors import APIError, bad_request
from ..http.streams import Job, SSEResponse, run_jobs, sse
from ..openai.outputs import TokenTexts, echo_logprobs, echo_token_texts, usage
from ..openai.prompts import DEFAULT_COMPLETION_TOKENS, check_ids, completion_prompts
from ..openai.protocol import CompletionRequest
from .serving import Serving, collect_choices, parse_body
from .streaming import EventEncoder, Step, Tally, drive


class Completions(Serving):
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: CompletionRequest = parse_body(CompletionRequest, await request.body())
        lora = self._adapter(req.model)
        if req.suffix:  # OpenAI's insertion: the prompt is the prefix, the model writes what comes before suffix
            texts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
            prompts = [self._fim(text, req.suffix) for text in texts]
        else:  # tokenizing takes time: off the event loop
            prompts = await asyncio.to_thread(completion_prompts, req.prompt, self.tokenizer, self.limits)
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        cfg = self._options(req, prompts, max_tokens, "prompt", top_logprobs=req.logprobs or 0,
                            prompt_logprobs=req.echo and req.logprobs is not None)
        await self._compile(req, cfg)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = [Job(i, f"{rid}-{i}", ids, c, rid, priority=req.priority, lora=lora)
                for i, (ids, c) in enumerate(expand(prompts, cfg))]
        self._admit(len(jobs))
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self._reported(req.model, lora)}
        events = run_jobs(self.engine, jobs, self.metrics, arrival, reserved=True, model=self.settings.model_name)
        if req.stream:
            return SSEResponse(self._completion_stream(req, jobs, head, events))
        return await self._completion_full(request, req, jobs, head, events)

    def _fim(self, prefix: str, suffix: str, extra: list[tuple[str, str]] = (), after: str = "",  # type: ignore[assignment]
             param: str = "suffix") -> list[int]:
        """A fill-in-the-middle prompt in the model family's layout; a 400 for a tokenizer without FIM tokens."""
        try:
            ids = fim_prompt(self.tokenizer, prefix, suffix, extra, after)
        except InfillError as e:
            raise bad_request(str(e), param) from e
        check_ids(ids, self.limits.vocab_size, param)
        return ids

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
                             with_prompt: bool, prompt_lp: list | None, texts: TokenTexts | None,
                             hidden_stop: bool) -> dict | None:
        if texts is None:
            return None
        if with_prompt:
            p_values, p_tops = echo_logprobs(job.prompt_ids, prompt_lp)
            ids, lps, tops = job.prompt_ids + ids, p_values + lps, p_tops + tops
        return self.logprobs.completion(ids, lps, tops, texts, hidden_stop)

    async def _completion_full(self, request: Request, req: CompletionRequest, jobs: list[Job], head: dict,
                               events: AsyncIterator) -> Response:
        choices = await collect_choices(request, len(jobs), events)
        if choices is None:
            return Response(status_code=499)  # the client left; its requests were cancelled
        body = []
        for job, c in zip(jobs, choices):
            prefix = self._echo_text(req, job.prompt_ids) if req.echo else ""
            body.append({
                "index": job.index,
                "text": prefix + c.text,
                "logprobs": self._completion_logprobs(req, job, c.token_ids, c.logprobs, c.top_logprobs,
                                                      req.echo, c.prompt_logprobs, self._token_texts(req, job),
                                                      c.hidden_stop),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **self._trace_field(c.trace),
            })
        n_prompt = sum(len(j.prompt_ids) for j in jobs[:: req.n])
        return JSONResponse({**head, "choices": body, "usage": usage(n_prompt, sum(len(c.token_ids) for c in choices),
                                                                     [c.speculated for c in choices])})

    def _completion_stream(self, req: CompletionRequest, jobs: list[Job], head: dict,
                           events: AsyncIterator) -> AsyncIterator[str]:
        return drive(events, _CompletionChunks(self, req, jobs, head))


class _CompletionChunks(EventEncoder):
    """Completions' stream: a chunk per event that says something (the echoed prompt before a choice's first
    text), the usage (with stream_options.include_usage) and [DONE] at the end, after an error too."""

    ends_after_failure = True

    def __init__(self, api: Completions, req: CompletionRequest, jobs: list[Job], head: dict) -> None:
        self.api, self.req, self.jobs, self.head = api, req, jobs, head
        self.started: set[int] = set()
        self.texts = [api._token_texts(req, job) for job in jobs]

    def step(self, step: Step, tally: Tally) -> list[str]:
        req, event, index = self.req, step.event, step.index
        job = self.jobs[index]
        first = index not in self.started
        self.started.add(index)
        text = (self.api._echo_text(req, job.prompt_ids) if req.echo and first else "") + event.text
        lp = self.api._completion_logprobs(req, job, event.token_ids, event.logprobs, event.top_logprobs,
                                           req.echo and first, event.prompt_logprobs, self.texts[index],
                                           event.hidden_stop)
        if not (text or event.finished or lp):
            return []
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": event.finish_reason,
                  "stop_reason": event.stop_reason, **self.api._trace_field(event.trace)}
        return [sse({**self.head, "choices": [choice]})]

    def failed(self, error: APIError, tally: Tally) -> list[str]:
        return [sse(error.body())]

    def end(self, tally: Tally) -> list[str]:
        frames = []
        if self.req.stream_options and self.req.stream_options.include_usage:
            n_prompt = sum(len(j.prompt_ids) for j in self.jobs[:: self.req.n])
            frames.append(sse({**self.head, "choices": [],
                               "usage": usage(n_prompt, tally.tokens, list(tally.speculated.values()))}))
        return frames + [sse("[DONE]")]
