"""POST /v1/chat/completions: OpenAI's Chat Completions API (the chat template, tools and their calls, log-probs,
n, streaming)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...engine import expand
from ...engine.async_engine import EngineClosedError, EngineDeadError
from ...errors import NextTokenError
from ...tools import ToolCallParser, ToolUse
from ..http.errors import bad_request
from ..http.streams import Job, SSEResponse, run_jobs, sse
from ..openai.outputs import usage
from ..openai.prompts import chat_prompt, check_ids
from ..openai.protocol import ChatCompletionRequest
from .serving import Serving, collect_choices, engine_failure, parse_body, unavailable


class Chat(Serving):
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: ChatCompletionRequest = parse_body(ChatCompletionRequest, await request.body())
        lora = self._adapter(req.model)
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
        jobs = [Job(j, f"{rid}-{j}", p, c, rid, lora) for j, (p, c) in enumerate(expand([ids], cfg))]
        head = {"id": rid, "created": int(time.time()), "model": lora or self.settings.model_name}
        events = run_jobs(self.engine, jobs, self.metrics, arrival)
        parsing = use if use is not None and use.calls else None
        if req.stream:
            return SSEResponse(self._chat_stream(req, jobs, head, events, parsing))
        choices = await collect_choices(request, len(jobs), events)
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
                    yield sse(json.dumps(engine_failure(event).body()))
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
            yield sse(json.dumps(unavailable(e).body()))
        if req.stream_options and req.stream_options.include_usage:
            yield sse(json.dumps({**head, "choices": [], "usage": usage(len(jobs[0].prompt_ids), completion_tokens,
                                                                        list(speculated.values()))}))
        yield sse("[DONE]")


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
