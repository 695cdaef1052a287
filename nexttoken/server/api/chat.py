"""POST /v1/chat/completions: OpenAI's Chat Completions API (the chat template, tools and their calls, log-probs,
n, streaming)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...engine import expand
from ...chat import ToolUse, harmony
from ...chat.answer import AnswerParser, Thinking
from ...chat.render import ChatPrompt
from ...chat.reasoning import ReasoningFormat
from ..http.errors import APIError
from ..http.streams import Job, SSEResponse, run_jobs, sse
from ..images import image_parts
from ..openai.outputs import usage
from ..openai.prompts import PREAMBLE_HEADER, check_ids, render_request, template_kwargs
from ..openai.protocol import ChatCompletionRequest
from .serving import Serving, collect_choices, log, parse_body, tool_parse_failure
from .streaming import EventEncoder, Step, Tally, drive


@dataclass
class ChatRun:
    """A chat request on its way through the engine: what every chat-shaped API (Chat Completions, Responses,
    Messages) formats in its own way."""

    id: str
    prompt: ChatPrompt  # the rendered conversation, and what its answer is read with (chat/render.py)
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
        if self.renderer is not None:  # harmony's reasoning effort is a template variable
            variables = self.renderer.with_effort(variables, req.reasoning_effort, req.thinking_token_budget)
        refs = image_parts([m.model_dump(include={"content"}, exclude_none=True) for m in req.messages])
        images = await self.image_inputs(refs, req.model)
        prompt = await asyncio.to_thread(  # untrusted template work: off the event loop
            render_request, req, self.renderer, use, variables, self.limits, images)
        check_ids(prompt.ids, self.limits.vocab_size, "messages")
        return prompt

    async def start_chat(self, req: ChatCompletionRequest, arrival: float, prefix: str = "chatcmpl",
                         prompt: ChatPrompt | None = None) -> ChatRun:
        """The one chat request path: tools checked, the template rendered, the options translated and the
        grammar compiled, then the jobs queued on the engine. `prompt`: rendered already (Ollama's /api/generate
        with a `context` or `raw`), over `req`'s options."""
        prompt = prompt if prompt is not None else await self.render(req)
        use, ids = prompt.use, prompt.ids
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        cfg = self._options(req, [ids], max_tokens, "messages", top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0)
        thinking = self._thinking(req)
        if thinking is not None:
            cfg = cfg.updated(thinking=thinking)
        if use is not None:
            cfg = self._with_tools(cfg, use)
        if prompt.harmony:  # the channels' markers are special tokens: the parser must see them
            cfg = cfg.updated(skip_special_tokens=False)
            if use is None or not use.calls:  # structured output: the final message's, after the analysis
                cfg = harmony.structured(cfg, self.tokenizer)
        await self._compile(req, cfg, "tools" if use is not None and use.calls else None)
        lora = self._adapter(req.model)
        rid = f"{prefix}-{uuid.uuid4().hex}" if prefix == "chatcmpl" else f"{prefix}_{uuid.uuid4().hex}"
        images = self.placed(getattr(prompt, "images", None), ids, "messages")
        jobs = [Job(j, f"{rid}-{j}", p, c, rid, priority=req.priority, lora=lora, images=images)
                for j, (p, c) in enumerate(expand([ids], cfg))]
        self._admit(len(jobs))
        events = run_jobs(self.engine, jobs, self.metrics, arrival, reserved=True, model=self.settings.model_name)
        return ChatRun(rid, prompt, jobs, events, lora)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req: ChatCompletionRequest = parse_body(ChatCompletionRequest, await request.body())
        run = await self.start_chat(req, arrival)
        ids, jobs, events = run.prompt_ids, run.jobs, run.events
        head = {"id": run.id, "created": int(time.time()), "model": self._reported(req.model, run.lora)}
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
                "logprobs": (self.logprobs.chat(c.token_ids, c.logprobs, c.top_logprobs, c.hidden_stop)
                             if req.logprobs else None),
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
                **self._trace_field(trace),
            })
        total = sum(len(c.token_ids) for c in choices)
        return JSONResponse({**head, "object": "chat.completion", "choices": body,
                             "usage": usage(len(ids), total, [c.speculated for c in choices])}, headers=headers)

    def _chat_stream(self, req: ChatCompletionRequest, run: ChatRun, head: dict) -> AsyncIterator[str]:
        return drive(run.events, _ChatChunks(self, req, run, {**head, "object": "chat.completion.chunk"}), run.answer)


class _ChatChunks(EventEncoder):
    """Chat Completions' stream: the role first, then each piece of an answer in a chunk of its own, the usage
    (with stream_options.include_usage) and [DONE] at the end, after an error too."""

    ends_after_failure = True

    def __init__(self, api: Chat, req: ChatCompletionRequest, run: ChatRun, head: dict) -> None:
        self.api, self.req, self.run, self.head = api, req, run, head

    def start(self) -> list[str]:
        # the role comes first, in a chunk of its own, as OpenAI sends it
        return [sse({**self.head, "choices": [{"index": job.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}) for job in self.run.jobs]

    def step(self, step: Step, tally: Tally) -> list[str]:
        event = step.event
        lp = (self.api.logprobs.chat(event.token_ids, event.logprobs, event.top_logprobs, event.hidden_stop)
              if self.req.logprobs else None)
        choices = _chat_deltas(step.index, event, lp, step.pieces or [], step.calls)
        if choices:
            choices[-1].update(self.api._trace_field(event.trace))
        return [sse({**self.head, "choices": [choice]}) for choice in choices]

    def failed(self, error: APIError, tally: Tally) -> list[str]:
        return [sse(error.body())]

    def end(self, tally: Tally) -> list[str]:
        frames = []
        if self.req.stream_options and self.req.stream_options.include_usage:
            frames.append(sse({**self.head, "choices": [], "usage": usage(
                len(self.run.prompt_ids), tally.tokens, list(tally.speculated.values()))}))
        return frames + [sse("[DONE]")]


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


def _chat_deltas(index: int, event: Any, lp: dict | None, pieces: list[Any], calls: bool) -> list[dict]:
    """One event's answer pieces as chat chunks' choices: each piece in a chunk of its own (thinking as
    reasoning_content and reasoning, the text outside calls as content, a call's id and name, then its argument
    text, as delta.tool_calls, as OpenAI sends them). Log-probs go with the first chunk, the finish with the last
    ("tool_calls" when the answer made `calls`); an event with nothing to say sends none."""
    finish_reason = event.finish_reason
    deltas = [{"content": p} if isinstance(p, str) else
              {"reasoning_content": p.text, "reasoning": p.text} if isinstance(p, Thinking) else
              {"tool_calls": [p.to_openai()]} for p in pieces]
    if finish_reason == "stop" and calls:
        finish_reason = "tool_calls"
    if not deltas and (event.finished or (lp and lp["content"])):
        deltas = [{}]
    last = len(deltas) - 1
    return [{"index": index, "delta": delta, "logprobs": lp if k == 0 else None,
             "finish_reason": finish_reason if k == last else None,
             "stop_reason": event.stop_reason if k == last else None} for k, delta in enumerate(deltas)]
