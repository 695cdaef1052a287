"""What every API's handlers share: the engine, the request limits and defaults, options and grammar checks, tool
use, traces, and how an engine failure becomes an HTTP error. Each API (completions.py, chat.py, ...) is a class
over this state; app.py builds one of each and routes to them."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from pydantic import BaseModel, ValidationError

from ..catalog import TAG  # Ollama's `name:latest` names the served `name` on every API
from ...engine import LLMEngine
from ...engine.async_engine import AsyncEngine, EngineClosedError, EngineDeadError
from ...errors import ImageError, NextTokenError, UnknownLoraError
from ...images import ImageInputs, read_images
from ...generation.config import no_token_left
from ...generation.processors.structured import CONSTRAINTS, constraint_of
from ...generation.values import Thinking
from ...model.lora import AdapterRegistry, registry_of
from ...chat import ToolsError, ToolUse
from ...chat.render import ChatRenderer
from ...chat.reasoning import EFFORT_BUDGETS, ReasoningFormat
from ...chat.tools.request import tool_options
from ..http.errors import APIError, bad_request, client_error, from_validation_error
from ..http.shutdown import MESSAGE as SHUTTING_DOWN
from ..images import ImageLoader, ImagePolicy, ImageRef, refuse_images
from ..http.request_log import current_request
from ..http.streams import ClientGone, collect
from ..metrics import ServerMetrics
from ..openai.options import (APPLIED_FIELDS, applied, constraint_field, model_defaults, request_field,
                              request_options, server_defaults)
from ..openai.outputs import Choice, LogprobFormatter
from ..openai.prompts import TEMPLATE_LIMITS, Limits, longest_token_bytes, new_tokens
from ..settings import ServerSettings
from .grammars import GrammarCompiler
from .traces import TraceStore

log = logging.getLogger("nexttoken.server")
RETRY_AFTER_S = 1  # a full queue drains as sequences finish: a client retries after this many seconds


def chat_renderer(core: LLMEngine, settings: ServerSettings) -> ChatRenderer | None:
    """The server's chat renderer (None without a tokenizer): its call and thinking formats, the render limits."""
    if core.tokenizer is None:
        return None
    return ChatRenderer(core.tokenizer, settings.tool_call_parser, settings.reasoning_parser, TEMPLATE_LIMITS,
                        settings.special_tokens_in_content)


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from e


class Serving:
    """The state the APIs share: one per server, each API class built over it."""

    def __init__(self, core: LLMEngine, engine: AsyncEngine, metrics: ServerMetrics, settings: ServerSettings,
                 traces: TraceStore | None = None, renderer: ChatRenderer | None = None,
                 grammars: GrammarCompiler | None = None, processor: Any = None) -> None:
        self.tokenizer, self.engine, self.metrics, self.settings = core.tokenizer, engine, metrics, settings
        # The Transformer (not `self.model`: Models.model is a route): its LoRA adapter slots are read here, the
        # engine's thread changes them.
        self.network = core.model
        self.limits = Limits(core.max_seq_tokens, core.model.config.vocab_size, settings.max_n,
                             longest_token_bytes(core.tokenizer), core.max_seq_tokens < core.max_model_len)
        # The model file's sampling defaults for requests that leave a field out (--generation-config auto)
        self.model_defaults = model_defaults(core.generation_config) if settings.generation_config == "auto" else {}
        self.base = server_defaults(core.generation_config, settings.structured_whitespace,
                                    settings.strict_json_schema, self.model_defaults)
        self.logprobs = LogprobFormatter(core.tokenizer)
        self.created = int(time.time())
        self.traces = traces or TraceStore(settings.model_name)  # traced requests' explain pages (one per server)
        # grammar compiles: their own pool and time budget (one per server)
        self.grammars = grammars or GrammarCompiler(core.tokenizer, self.limits.vocab_size,
                                                    settings.grammar_compile_timeout_s)
        # The one chat renderer (chat/render.py, LLM.chat's too; one per server, `chat_renderer`): what the chat
        # template renders of tool use, probed once (a template without a tools section gets the tools preamble of
        # the call format, said in each response's header and, once, in the log: `preamble_notice`), the thinking
        # format and its markers.
        self.renderer = renderer or chat_renderer(core, settings)
        self.reasoning: ReasoningFormat | None = self.renderer.reasoning if self.renderer else None
        self.markers: tuple[int, int] | None = self.renderer.markers if self.renderer else None
        # Images in requests: the model's preprocessing (images/<family>.py; None: it takes no images) and the
        # loader under the server's limits
        self.processor = processor if getattr(core.model, "vision", None) is not None else None
        self.vision = self.processor is not None
        self.images = ImageLoader(ImagePolicy.of(settings))

    async def image_inputs(self, refs: Sequence[ImageRef], model: str | None,
                           what: str = "content parts of type 'image_url' are not supported") -> ImageInputs | None:
        """A request's images (None without any), loaded under the server's limits and prepared by the model's
        preprocessing, off the event loop; a 400 naming the part that cannot be used, or (`what`) any image sent
        to a model that takes none."""
        if not refs:
            return None
        if not self.vision:
            refuse_images(refs, self._reported(model, None), what)
        images = await self.images.load(refs)
        try:
            return await asyncio.to_thread(read_images, self.processor, images, self.images.policy.limits)
        except ImageError as e:
            raise bad_request(str(e), refs[0].param) from e

    def placed(self, inputs: ImageInputs | None, ids: list[int], param: str) -> tuple:
        """The request's images placed in its final prompt ids (images/prepared.py's PromptImage)."""
        if inputs is None:
            return ()
        try:
            return inputs.placed(ids, self.network.vision.image_token_id)
        except ImageError as e:
            raise bad_request(str(e), param) from e

    def preamble_notice(self) -> None:
        """The log line that says requests with tools get the tools preamble (app.py calls it once per server)."""
        format = self.renderer.preamble_format if self.renderer is not None else None
        if format is not None:
            log.warning("the chat template renders no tools: requests with tools get the %s tools preamble in the "
                        "system message (docs/tool_calls.md; another format: --tool-call-parser)", format)

    def _thinking(self, req: Any) -> Thinking | None:
        """The request's thinking block for the engine (its markers and budget), None without a reasoning format.
        The budget: thinking_token_budget, else reasoning_effort's, else --reasoning-budget. Harmony (gpt-oss) has
        none: its effort is the system message's level (ChatRenderer.with_effort)."""
        if self.reasoning is None or (self.renderer is not None and self.renderer.harmony):
            return None
        budget = req.thinking_token_budget
        if budget is None and req.reasoning_effort is not None:
            budget = EFFORT_BUDGETS[req.reasoning_effort]
        if budget is None:
            budget = self.settings.reasoning_budget
        if self.markers is None:
            if budget is not None:
                raise bad_request(f"a thinking budget needs {self.reasoning.start!r} and {self.reasoning.end!r} to "
                                  "be single tokens, and this tokenizer splits them: leave the budget out",
                                  "thinking_token_budget")
            return None
        return Thinking(*self.markers, budget=budget)

    def _check_model(self, name: str | None) -> None:
        """A request's `model` is the base model or a served adapter (they share the tokenizer); else a 404."""
        self._adapter(name)

    def _adapter(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, resolved by the model's adapter registry (None: the base
        model, by any of its served names or none given); an unknown name is OpenAI's 404 model_not_found, naming
        what is served."""
        try:
            return self.registry().resolve(name, self.settings.served_names)
        except UnknownLoraError:
            if name is not None and name.endswith(f":{TAG}"):  # a name as Ollama's /api/tags lists it, on any API
                return self._adapter(name.removesuffix(f":{TAG}"))
            served = ", ".join(repr(n) for n in [*self.settings.served_names, *self.adapters()])
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served}", "model",
                           code="model_not_found") from None

    def _reported(self, name: str | None, lora: str | None) -> str:
        """The `model` a response reports: the adapter's name, else the served name the request used (vLLM's), else
        the first served name."""
        return lora or (name if name in self.settings.served_names else self.settings.model_name)

    def registry(self) -> AdapterRegistry:
        """The model's adapter registry: the one map from adapter names to adapters (model/lora/registry.py)."""
        return registry_of(self.network)

    def adapters(self) -> list[str]:
        """The names of the LoRA adapters served now (a snapshot: the engine's thread changes them)."""
        return self.registry().names

    def _options(self, req: Any, prompts: list[list[int]], max_tokens: int | None, param: str, **extra: Any) -> Any:
        """The request's GenerationConfig: its fields through the one translation table, the length checked."""
        count = len(prompts) * req.n
        if count > self.settings.max_seqs_per_request:
            raise bad_request(
                f"this request asks for {len(prompts)} prompts x n={req.n} = {count} sequences, over this server's "
                f"limit of {self.settings.max_seqs_per_request} (--max-seqs-per-request): split it", "prompt")
        wanted = new_tokens(prompts, max_tokens, req.n, self.limits, param)
        if max_tokens is None and "max_new_tokens" in self.model_defaults:  # the model's, within the context
            wanted = min(wanted, self.model_defaults["max_new_tokens"])
        cfg = request_options(req, self.base, max_new_tokens=wanted, **extra)
        record = current_request()
        if record is not None:
            record.sampling = applied(cfg)
        for name, ids in cfg.ids_outside(self.limits.vocab_size).items():  # bad_words_ids, logit_bias, ...
            raise bad_request(f"{name} contains token ids {ids[:5]} outside the vocabulary [0, "
                              f"{self.limits.vocab_size})", name)
        banned = cfg.bans_every_token(self.limits.vocab_size)  # suppress_tokens = every id, ...: nothing to draw
        if banned is not None:
            raise bad_request(no_token_left(request_field(banned[0]), banned[1], self.limits.vocab_size),
                              request_field(banned[0]))
        return cfg

    def generation_defaults(self) -> dict:
        """What applies to a request that leaves a field out (the model's generation_config.json over OpenAI's
        defaults); `max_tokens` None: all the context has room for. The chat page shows these."""
        values = {name: getattr(self.base, name) for name in APPLIED_FIELDS}
        from_model = ["max_tokens" if name == "max_new_tokens" else name for name in self.model_defaults]
        return {**values, "max_tokens": self.model_defaults.get("max_new_tokens"), "from_model": from_model}

    def _admit(self, count: int) -> None:
        """Refuse (429, with Retry-After) a request whose `count` sequences would queue more than
        --max-waiting-seqs behind the running ones: the queue, and the memory it holds, stays bounded (by the
        limit plus one request's sequences: a request is admitted to an empty queue whatever its size, which
        --max-seqs-per-request bounds)."""
        limit = self.settings.max_waiting_seqs
        if not self.engine.reserve(count, limit):
            self.metrics.finished.labels("rejected").inc()
            raise APIError(
                429, f"the server is busy: {self.engine.num_waiting} sequences are waiting for a slot and this "
                     f"request adds {count}, over the limit of {limit} (--max-waiting-seqs); retry later", None,
                "rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def _compile(self, req: Any, cfg: Any, field: str | None = None) -> None:
        """Compile the request's grammar on the compile pool, within its budget (the engine then finds it cached);
        a constraint that cannot be enforced, or did not compile in time, is a 400 naming what (and the field that
        carried it), before any work is queued."""
        if constraint_of(cfg) is None:
            return
        try:
            compiled = await self.grammars.compile(cfg)
        except NextTokenError as e:
            raise bad_request(str(e), field or constraint_field(req)) from e
        self.metrics.grammar(compiled)  # type: ignore[arg-type]

    def _trace_field(self, trace: dict | None) -> dict:
        """A traced choice's `trace` (its id and the URLs of its explain page and JSON); {} when not traced."""
        return {} if trace is None else {"trace": self.traces.add(trace)}

    def _tool_use(self, tools: list | None, tool_choice: Any, parallel: bool | None) -> ToolUse | None:
        try:
            if self.renderer is not None:
                return self.renderer.tool_use(tools, tool_choice, parallel)
            return ToolUse.of(tools, tool_choice, parallel, self.settings.tool_call_parser)
        except ToolsError as e:
            raise bad_request(str(e), e.param) from e

    def _with_tools(self, cfg: Any, use: ToolUse) -> Any:
        """The request's options with what its tools need (the calls' grammar; special tokens kept in the text
        when a call marker is one)."""
        try:
            options = {n: getattr(cfg, n) for n in (*CONSTRAINTS, "strict_json_schema")}
            return cfg.updated(**tool_options(use, self.tokenizer, options))
        except ToolsError as e:
            raise bad_request(str(e), e.param) from e
        except NextTokenError as e:
            raise bad_request(str(e), "tools") from e


async def collect_choices(request: Request, n: int, events: AsyncIterator) -> list[Choice] | None:
    """Every event of a non-streaming request, gathered per choice; None when the client left first."""
    choices = [Choice() for _ in range(n)]
    try:
        for index, event in await collect(request, events):
            choices[index].add(event)
    except ClientGone:
        return None
    except (EngineClosedError, EngineDeadError) as e:  # before NextTokenError, their base: a 503
        raise unavailable(e) from e
    except NextTokenError as e:
        raise client_error(e) from e
    failed = next((c for c in choices if c.finish_reason == "error"), None)
    if failed is not None:
        raise engine_failure(failed)
    return choices


def unavailable(e: Exception) -> APIError:
    """The engine is closed (shutting down) or dead: a 503, retryable elsewhere or later."""
    if isinstance(e, EngineClosedError):
        return APIError(503, SHUTTING_DOWN, type="service_unavailable_error", code="server_shutting_down")
    return APIError(503, "the engine stopped: this server cannot generate; see its log", type="internal_server_error")


def engine_failure(event: Any) -> APIError:
    """A request that failed inside the engine (its own options at run time; the others go on): a 500 in
    OpenAI's body for it alone. What failed is logged here, not sent."""
    log.error("a request failed inside the engine: %s", event.stop_reason)
    return APIError(500, "generation failed inside the engine for this request (other requests are not "
                         "affected); the server log has the details", type="internal_server_error")


def tool_parse_failure() -> APIError:
    """The model's text could not be parsed into tool calls by this server's parser: a 500 for this request alone
    (what failed is in the log)."""
    return APIError(500, "parsing the model's tool calls failed for this request (other requests are not "
                         "affected); the server log has the details", type="internal_server_error")
