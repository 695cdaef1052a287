"""Ollama's API (what the `ollama` Python client, Open WebUI and many editor plugins speak): POST /api/chat and
/api/generate over the chat request path (the request translated by ollama/protocol.py, answered as NDJSON lines
or one body), /api/embed and the legacy /api/embeddings over the engine's embeddings, and the model listing
(/api/tags, /api/ps, /api/show) from `served_models`. Errors on /api/ are Ollama's `{"error": "..."}` (app.py
picks the body by path)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version as package_version
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...chat.render import ChatPrompt
from ...config import ARCHITECTURE_OF_MODEL_TYPE
from ...engine.async_engine import EngineClosedError, EngineDeadError
from ...engine.embedding import EmbeddingError
from ...text.infill import InfillError, fim_prompt
from ..http.errors import APIError, bad_request
from ..ollama.models import ServedModel, matches, ps_card, show_card, tag_card
from ..ollama.protocol import (OllamaChatRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest, OllamaGenerateRequest,
                               OllamaOptions, OllamaShowRequest, chat_body, generate_messages, generating_fields,
                               in_ollama_terms, ollama_tool_calls)
from ..openai.prompts import check_ids, completion_prompts
from ..openai.protocol import ChatCompletionRequest
from .chat import Chat, ChatRun
from .embeddings import MAX_INPUTS
from .ollama_lines import Clock, NDJSONResponse, OllamaLines, now
from .serving import collect_choices, log, parse_body, tool_parse_failure, unavailable
from .streaming import drive

DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class Ollama(Chat):
    def served_models(self) -> list[ServedModel]:
        """This model as Ollama's listings show it, under each of its served names (router.py lists every model of
        the registry: a loaded one's from here)."""
        net, config = self.network, self.network.config
        tensors = [*net.parameters(), *net.buffers()]
        first = next(net.parameters())
        size = sum(t.numel() * t.element_size() for t in tensors)
        capabilities = ("completion", *(("tools",) if self._tools_offered() else ()),
                        *(("thinking",) if self.reasoning is not None else ()), *(("vision",) if self.vision else ()))
        template = (self.tokenizer.chat_template or "") if self.tokenizer is not None else ""
        family = next((t for t, a in ARCHITECTURE_OF_MODEL_TYPE.items() if a == config.architecture),
                      config.architecture)  # Ollama's family is the model type ("llama", "qwen2")
        return [ServedModel(name, family, sum(p.numel() for p in net.parameters()), size,
                            DTYPES.get(str(first.dtype).removeprefix("torch."), str(first.dtype)),
                            self.limits.max_model_len, config.hidden_size, config.num_hidden_layers,
                            config.num_attention_heads, config.num_key_value_heads, config.vocab_size, template,
                            capabilities, self._loaded_at, size if first.device.type != "cpu" else 0)
                for name in self.settings.served_names]

    @property
    def _loaded_at(self) -> datetime:
        return datetime.fromtimestamp(self.created, timezone.utc)

    def _tools_offered(self) -> bool:
        renderer = self.renderer  # a template that renders no tools gets the call format's tools preamble
        return (renderer.call_format if renderer is not None else self.settings.tool_call_parser) is not None

    def _served(self, name: str) -> str:
        """The served name a request's `model` means (Ollama's `name:latest` too); else Ollama's 404."""
        found = next((m.name for m in self.served_models() if matches(m, name)), None)
        if found is not None:
            return found
        if name in self.adapters():
            return name
        served = ", ".join(repr(m.tagged) for m in self.served_models())
        raise APIError(404, f"model {name!r} not found: this server serves {served}", "model",
                       code="model_not_found")

    def _check_options(self, options: OllamaOptions, think: Any, model: str) -> None:
        if options.num_ctx is not None and options.num_ctx > self.limits.max_model_len:
            raise bad_request(f"options.num_ctx: {options.num_ctx} is over the {self.limits.max_model_len} tokens "
                              f"{self.limits.what.removesuffix(' is')}: send num_ctx <= {self.limits.max_model_len} "
                              "(the server's context is set at start, --max-model-len)", "options.num_ctx")
        if think not in (None, False) and self.reasoning is None:
            raise bad_request(f"{model!r} does not support thinking: its chat template has no thinking block; "
                              "leave `think` out", "think")

    # ---- /api/chat and /api/generate -------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        clock, arrival = Clock(), time.monotonic()
        req: OllamaChatRequest = parse_body(OllamaChatRequest, await request.body())
        _keep_alive(request, req)
        model = self._served(req.model)
        self._check_options(req.options, req.think, req.model)
        if not req.messages:  # Ollama's way to load a model (or, with keep_alive 0, unload it)
            return JSONResponse(self._loaded(req, {"message": {"role": "assistant", "content": ""}}))
        run = await self._start(_chat_request(chat_body(req, model, self.vision)), arrival, req.options)
        events = clock.timed(run.events)
        head = {"model": req.model}
        if req.stream:
            return NDJSONResponse(drive(events, OllamaLines(head, run, clock, "chat"), run.answer))
        choices = await collect_choices(request, 1, events)
        if choices is None:
            return Response(status_code=499)
        c = choices[0]
        message = _message(run, c.text, c.finish_reason == "length")
        return JSONResponse({**head, "created_at": now(), "message": message,
                             **clock.final(c.finish_reason, len(run.prompt_ids), len(c.token_ids))})

    async def generate(self, request: Request) -> Response:
        clock, arrival = Clock(), time.monotonic()
        req: OllamaGenerateRequest = parse_body(OllamaGenerateRequest, await request.body())
        _keep_alive(request, req)
        model = self._served(req.model)
        self._check_options(req.options, req.think, req.model)
        if not req.prompt and not req.suffix:
            return JSONResponse(self._loaded(req, {"response": ""}))
        if req.images and (req.raw or req.suffix):
            raise bad_request("images with raw or suffix are not offered: the chat template places the images; "
                              "send the prompt without raw and suffix", "images")
        chat = _chat_request({**generating_fields(req, model), "messages": generate_messages(req, self.vision)})
        context = list(req.context or [])
        check_ids(context, self.limits.vocab_size, "context")
        # the prompt as it is (or the model's fill-in-the-middle layout), else through the chat template
        prompt = await self._raw_prompt(req, context) if req.raw or req.suffix else None
        run = await self._start(chat, arrival, req.options, prompt, context)
        events = clock.timed(run.events)
        head = {"model": req.model}
        if req.stream:
            return NDJSONResponse(drive(events, OllamaLines(head, run, clock, "generate"), run.answer))
        choices = await collect_choices(request, 1, events)
        if choices is None:
            return Response(status_code=499)
        c = choices[0]
        message = _message(run, c.text, c.finish_reason == "length")
        body = {**head, "created_at": now(), "response": message["content"],
                **({"thinking": message["thinking"]} if "thinking" in message else {}),
                **clock.final(c.finish_reason, len(run.prompt_ids), len(c.token_ids)),
                "context": run.prompt_ids + c.token_ids}
        return JSONResponse(body)

    async def _start(self, chat: ChatCompletionRequest, arrival: float, options: OllamaOptions,
                     prompt: ChatPrompt | None = None, context: list[int] | None = None) -> ChatRun:
        """The chat request path (the conversation rendered after `context`, unless `prompt` is given), within
        `options.num_ctx`; its errors name Ollama's fields."""
        try:
            if prompt is None:
                prompt = await self.render(chat)
                prompt = dataclasses.replace(prompt, ids=(context or []) + prompt.ids)
            return await self.start_chat(self._within(chat, len(prompt.ids), options), arrival, "ollama", prompt)
        except APIError as e:
            raise in_ollama_terms(e) from e

    def _within(self, chat: ChatCompletionRequest, prompt: int, options: OllamaOptions) -> ChatCompletionRequest:
        """A request under a num_ctx below the served context: its prompt and answer fit in num_ctx tokens (the
        answer is cut there; a longer prompt is a 400, where Ollama would drop its start)."""
        if options.num_ctx is None or options.num_ctx >= self.limits.max_model_len:
            return chat
        room = options.num_ctx - prompt
        if room < 1:
            raise bad_request(f"the prompt has {prompt} tokens, which leaves no room for an answer in "
                              f"options.num_ctx={options.num_ctx}: raise num_ctx (up to {self.limits.max_model_len}) "
                              "or shorten the prompt", "options.num_ctx")
        return chat.model_copy(update={"max_tokens": min(chat.max_tokens or room, room)})

    async def _raw_prompt(self, req: OllamaGenerateRequest, context: list[int]) -> ChatPrompt:
        """A raw (or fill-in-the-middle) prompt: no chat template, no thinking or calls read out of the answer."""
        if req.suffix:
            try:
                ids = await asyncio.to_thread(fim_prompt, self.tokenizer, req.prompt, req.suffix)
            except InfillError as e:
                raise bad_request(str(e), "suffix") from e
        else:
            ids = (await asyncio.to_thread(completion_prompts, req.prompt, self.tokenizer, self.limits))[0]
        check_ids(ids, self.limits.vocab_size, "prompt")
        return ChatPrompt(context + ids, req.prompt, None, None, False, None)

    def _loaded(self, req: Any, empty: dict[str, Any]) -> dict[str, Any]:
        """The answer to a request with nothing to generate: the model is loaded ("load"; keep_alive 0: "unload",
        which idle unload carries out)."""
        reason = "unload" if req.keep_alive_s == 0 else "load"
        return {"model": req.model, "created_at": now(), **empty, "done": True, "done_reason": reason}

    # ---- /api/embed, /api/embeddings ---------------------------------------------------------------------------

    async def embed(self, request: Request) -> Response:
        clock = Clock()
        req: OllamaEmbedRequest = parse_body(OllamaEmbedRequest, await request.body())
        _keep_alive(request, req)
        self._served(req.model)
        self._check_options(req.options, None, req.model)
        texts = [req.input] if isinstance(req.input, str) else req.input
        if not texts:
            return JSONResponse({"model": req.model, "embeddings": []})
        prompts = await self._embedded_prompts(texts, req.truncate)
        vectors = await self._embed(prompts, True, req.dimensions)
        tokens = sum(len(p) for p in prompts)
        end = time.monotonic_ns()
        return JSONResponse({"model": req.model, "embeddings": [v.tolist() for v in vectors],
                             "total_duration": end - clock.start, "load_duration": 0, "prompt_eval_count": tokens})

    async def embeddings(self, request: Request) -> Response:
        req: OllamaEmbeddingsRequest = parse_body(OllamaEmbeddingsRequest, await request.body())
        _keep_alive(request, req)
        self._served(req.model)
        self._check_options(req.options, None, req.model)
        prompts = await self._embedded_prompts([req.prompt], True)
        vectors = await self._embed(prompts, False, None)  # the legacy route's vectors are not normalized
        return JSONResponse({"embedding": vectors[0].tolist()})

    async def _embedded_prompts(self, texts: list[str], truncate: bool) -> list[list[int]]:
        if len(texts) > MAX_INPUTS:
            raise bad_request(f"input has {len(texts)} texts, over the limit of {MAX_INPUTS} per request: split it "
                              "into several requests", "input")
        if any(not t for t in texts):
            raise bad_request("input: an input is empty; send non-empty texts", "input")
        prompts = await asyncio.to_thread(completion_prompts, texts, self.tokenizer, self.limits, "input")
        longest = max(len(p) for p in prompts)
        if longest > self.limits.max_model_len and not truncate:
            raise bad_request(f"the input length exceeds the context length: an input has {longest} tokens, "
                              f"{self.limits.what} {self.limits.max_model_len}: shorten it, or send truncate=true",
                              "input")
        return [p[: self.limits.max_model_len] for p in prompts]

    async def _embed(self, prompts: list[list[int]], normalize: bool, dimensions: int | None) -> list:
        try:
            return await self.engine.embed(prompts, self.settings.pooling, normalize, dimensions)
        except EmbeddingError as e:
            raise bad_request(str(e), "dimensions" if "dimensions" in str(e) else "input") from e
        except (EngineClosedError, EngineDeadError) as e:
            raise unavailable(e) from e

    # ---- the models --------------------------------------------------------------------------------------------

    async def tags(self) -> dict:
        return {"models": [tag_card(m) for m in self.served_models()]}

    async def ps(self) -> dict:
        return {"models": [ps_card(m) for m in self.served_models()]}

    async def show(self, request: Request) -> dict:
        req: OllamaShowRequest = parse_body(OllamaShowRequest, await request.body())
        name = req.model or req.name
        if not name:
            raise bad_request("model is required: the name of a model /api/tags lists", "model")
        served = self._served(name)
        return show_card(next(m for m in self.served_models() if m.name == served))

    async def version(self) -> dict:
        return version_card()


def version_card() -> dict:
    """/api/version: nexttoken's version (Ollama's route says Ollama's)."""
    try:
        return {"version": package_version("nexttoken")}
    except PackageNotFoundError:  # a source tree that is not installed
        return {"version": "0.0.0"}


def _keep_alive(request: Request, req: Any) -> None:
    """A keep_alive the request gives, in seconds, kept on the request: the router sets it as the model's idle time
    (router.py; without one, the server's --idle-unload-seconds holds)."""
    request.state.keep_alive_s = None if req.keep_alive is None else req.keep_alive_s


def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return parse_body(ChatCompletionRequest, json.dumps(body).encode())
    except APIError as e:
        raise in_ollama_terms(e) from e


def _message(run: ChatRun, text: str, cut: bool) -> dict[str, Any]:
    """A whole answer as Ollama's message: content, thinking (with a reasoning format), the calls."""
    try:
        answer = run.prompt.split(text, cut=cut)
    except Exception as e:  # noqa: BLE001 - this request alone fails, in the API's body
        log.exception("parsing an answer (thinking, tool calls) failed")
        raise tool_parse_failure() from e
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning:
        message["thinking"] = answer.reasoning
    if answer.tool_calls:
        message["tool_calls"] = ollama_tool_calls(answer.tool_calls)
    return message
