"""POST /v1/chat/completions: OpenAI's Chat Completions API (the chat template, tools and their calls, log-probs,
n, streaming)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...engine import expand
from ...engine.async_engine import EngineClosedError, EngineDeadError
from ...errors import NextTokenError
from ...tools import ToolUse
from ...tools.answer import AnswerParser, Thinking
from ...tools.chat import ChatPrompt
from ...tools.reasoning import ReasoningFormat
from ..http.errors import bad_request
from ..http.streams import Job, SSEResponse, run_jobs, sse
from ..openai.outputs import usage
from ..openai.prompts import PREAMBLE_HEADER, check_ids, render_request, template_kwargs
from ..openai.protocol import ChatCompletionRequest
from .serving import Serving, collect_choices, engine_failure, log, parse_body, tool_parse_failure, unavailable


@dataclass
class ChatRun:
    """A chat request on its way through the engine: what every chat-shaped API (Chat Completions, Responses,
    Messages) formats in its own way."""

    id: str
    prompt: ChatPrompt  # the rendered conversation, and what its answer is read with (tools/chat.py)
    jobs: list[Job]
    events: AsyncIterator  # (choice index, TokenEvent) as they come
    lora: str | None = None  # the LoRA adapter the request's `model` chose; None: the base model

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids

    @property
    def use(self) -> ToolUse | None:
        """The tools whose calls are read out of the text; None: plain text."""
        return self.prompt.calls

    @property
    def reasoning(self) -> ReasoningFormat | None:
        """Where the model writes its thinking; None: no thinking."""
        return self.prompt.reasoning

    @property
    def preamble(self) -> str | None:
        """The call format whose tools preamble the prompt holds (a response header says so)."""
        return self.prompt.preamble

    def answer(self) -> AnswerParser:
        """A parser for one choice's text: thinking, content, calls."""
        return self.prompt.answer()


class Chat(Serving):
    async def render(self, req: ChatCompletionRequest) -> ChatPrompt:
        """The request's tools, checked, and its prompt: the conversation through the one chat renderer (ids,
        text, the call format of the tools preamble it holds, what the answer is read with)."""
        self._adapter(req.model)  # an unknown model (or adapter) name: a 404 before any work
        use = self._tool_use(req.tools, req.tool_choice, req.parallel_tool_calls)
        variables = template_kwargs(self.settings.default_chat_template_kwargs, req)
        prompt = await asyncio.to_thread(  # untrusted template work: off the event loop
            render_request, req, self.renderer, use, variables, self.limits)
        check_ids(prompt.ids, self.limits.vocab_size, "messages")
        return prompt

    async def start_chat(self, req: ChatCompletionRequest, arrival: float, prefix: str = "chatcmpl") -> ChatRun:
        """The one chat request path: tools checked, the template rendered, the options translated and the
        grammar compiled, then the jobs queued on the engine."""
        prompt = await self.render(req)
        use, ids = prompt.use, prompt.ids
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        cfg = self._options(req, [ids], max_tokens, "messages", top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0)
        thinking = self._thinking(req)
        if thinking is not None:
            cfg = cfg.updated(thinking=thinking)
        if use is not None:
            cfg = self._with_tools(cfg, use)
        await self._compile(req, cfg, "tools" if use is not None and use.calls else None)
        lora = self._adapter(req.model)
        rid = f"{prefix}-{uuid.uuid4().hex}" if prefix == "chatcmpl" else f"{prefix}_{uuid.uuid4().hex}"
        jobs = [Job(j, f"{rid}-{j}", p, c, rid, priority=req.priority, lora=lora)
                for j, (p, c) in enumerate(expand([ids], cfg))]
        self._admit(len(jobs))
        events = run_jobs(self.engine, jobs, self.metrics, arrival, reserved=True)
        return ChatRun(rid, prompt, jobs, events, lora)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: ChatCompletionRequest = parse_body(ChatCompletionRequest, await request.body())
        run = await self.start_chat(req, arrival)
        ids, jobs, events = run.prompt_ids, run.jobs, run.events
        head = {"id": run.id, "created": int(time.time()), "model": run.lora or self.settings.model_name}
        headers = {PREAMBLE_HEADER: run.preamble} if run.preamble else None
        if req.stream:
            return SSEResponse(self._chat_stream(req, run, head), headers=headers)
        choices = await collect_choices(request, len(jobs), events)
        if choices is None:
            return Response(status_code=499)  # the client left; its requests were cancelled
        body = []
        for i, c in enumerate(choices):
            try:
                message = _message(run, c.text, cut=c.finish_reason == "length")
            except Exception as e:  # noqa: BLE001 - this request alone fails, in the API's body
                log.exception("parsing a choice's answer (thinking, tool calls) failed")
                raise tool_parse_failure() from e
            finish_reason = c.finish_reason
            trace = c.trace
            if trace is not None and run.reasoning is not None:  # the trace keeps the answer's split too
                trace = {**trace, "reasoning": message["reasoning_content"], "content": message["content"]}
            if message.get("tool_calls") and c.finish_reason == "stop":
                finish_reason = "tool_calls"
            body.append({
                "index": i,
                "message": message,
                "logprobs": self.logprobs.chat(c.token_ids, c.logprobs, c.top_logprobs) if req.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
                **self._trace_field(trace),
            })
        total = sum(len(c.token_ids) for c in choices)
        return JSONResponse({**head, "object": "chat.completion", "choices": body,
                             "usage": usage(len(ids), total, [c.speculated for c in choices])}, headers=headers)

    async def _chat_stream(self, req: ChatCompletionRequest, run: ChatRun, head: dict) -> AsyncIterator[str]:
        jobs, events = run.jobs, run.events
        head = {**head, "object": "chat.completion.chunk"}
        for job in jobs:  # the role comes first, in a chunk of its own, as OpenAI sends it
            delta = {"role": "assistant", "content": ""}
            yield sse(json.dumps({**head, "choices": [{"index": job.index, "delta": delta, "logprobs": None,
                                                       "finish_reason": None}]}))
        parsers = {job.index: run.answer() for job in jobs}
        completion_tokens, speculated = 0, {}
        try:
            async for index, event in events:
                if event.finish_reason == "error":
                    yield sse(json.dumps(engine_failure(event).body()))
                    break
                completion_tokens += len(event.token_ids)
                speculated[index] = (event.spec_draft_tokens, event.spec_accepted_tokens)
                lp = self.logprobs.chat(event.token_ids, event.logprobs, event.top_logprobs) if req.logprobs else None
                try:
                    choices = _chat_deltas(index, event, lp, parsers[index])
                except Exception:  # noqa: BLE001 - this request's answer parsing failed: it ends alone, in the API's body
                    log.exception("parsing a streamed choice's answer (thinking, tool calls) failed")
                    yield sse(json.dumps(tool_parse_failure().body()))
                    break
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


def _message(run: ChatRun, text: str, cut: bool = False) -> dict[str, Any]:
    """A whole answer as the assistant message: its content, its calls, and (with a reasoning format) its thinking
    as reasoning_content and reasoning (both names, as vLLM sends them). A call `cut` off by max_tokens is left
    out (the finish reason, "length", says so)."""
    answer = run.prompt.split(text, cut=cut)
    calls = answer.tool_calls
    message: dict[str, Any] = {"role": "assistant", "content": (answer.content or None) if calls else answer.content}
    if run.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = answer.reasoning
    if calls:
        message["tool_calls"] = [call.to_openai() for call in calls]
    return message


def _chat_deltas(index: int, event: Any, lp: dict | None, answer: AnswerParser) -> list[dict]:
    """One event as chat chunks' choices: each piece in a chunk of its own (thinking as reasoning_content and
    reasoning, the text outside calls as content, a call's id and name, then its argument text, as
    delta.tool_calls, as OpenAI sends them). Log-probs go with the first chunk, the finish with the last; an event
    with nothing to say sends none."""
    finish_reason = event.finish_reason
    pieces = answer.feed(event.text) + (answer.finish(cut=finish_reason == "length") if event.finished else [])
    deltas = [{"content": p} if isinstance(p, str) else
              {"reasoning_content": p.text, "reasoning": p.text} if isinstance(p, Thinking) else
              {"tool_calls": [p.to_openai()]} for p in pieces]
    if finish_reason == "stop" and answer.calls:
        finish_reason = "tool_calls"
    if not deltas and (event.finished or (lp and lp["content"])):
        deltas = [{}]
    last = len(deltas) - 1
    return [{"index": index, "delta": delta, "logprobs": lp if k == 0 else None,
             "finish_reason": finish_reason if k == last else None,
             "stop_reason": event.stop_reason if k == last else None} for k, delta in enumerate(deltas)]
