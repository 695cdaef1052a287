"""One loaded model as the server serves it (ModelService): its engine on its own thread, its chat renderer and
grammar compiler, and each API's handlers over it; and the loader that makes one from a catalog entry (load the
spec, fit its memory to the budget, build the engine)."""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any, Callable

from ..collector import thaw_heap
from ..engine import EngineConfig, EngineStats, LLMEngine, SpeculativeConfig
from ..engine.async_engine import AsyncEngine
from ..engine.embedding import model_pooling
from ..engine.fit import Fit, fit_memory, fitted_config, runtime_bytes, weights_bytes
from ..engine.llm_engine import KV_CACHE_DTYPES
from ..model.memory import release_freed_memory
from .api.chat import Chat
from .api.completions import Completions
from .api.embeddings import Embeddings
from .api.grammars import GrammarCompiler
from .api.infill import Infill
from .api.lora import LoraAdapters
from .api.messages import Messages
from .api.models import Models
from .api.ollama import Ollama
from .api.responses import ResponseStore, Responses
from .api.serving import chat_renderer
from .api.traces import TraceStore
from .catalog import ModelChoice
from .metrics import ServerMetrics
from .settings import ServerSettings

log = logging.getLogger("nexttoken.server")


class ModelService:
    """A loaded model's engine and APIs. `traces` and `stored` are the server's (one store for every model: a
    trace or stored response is read back by id alone); `on_step` is called on the engine thread after each step."""

    def __init__(self, core: LLMEngine, settings: ServerSettings, metrics: ServerMetrics, traces: TraceStore,
                 stored: ResponseStore | None = None, memory: Fit | None = None,
                 on_step: Callable[[EngineStats], None] | None = None, processor: Any = None) -> None:
        self.core, self.settings, self.metrics = core, settings, metrics
        self.engine = AsyncEngine(core, on_step=on_step or metrics.on_step)
        self.memory = memory or measured(core)
        renderer = chat_renderer(core, settings)  # one: the chat template's probes run once per model
        self.grammars = GrammarCompiler(core.tokenizer, core.model.config.vocab_size,
                                        settings.grammar_compile_timeout_s)
        self.completions, self.chat, self.models, self.responses, self.messages, self.embeddings, self.infill, \
            self.loras, self.ollama = (
                api(core, self.engine, metrics, settings, traces, renderer=renderer, grammars=self.grammars,
                    processor=processor)
                for api in (Completions, Chat, Models, Responses, Messages, Embeddings, Infill, LoraAdapters, Ollama))
        if stored is not None:
            self.responses.stored = stored
        self.chat.preamble_notice()

    def start(self) -> None:
        self.engine.start()
        self.metrics.watch(self.settings.model_name, self.stats)  # its vllm:* gauges, under its name

    def close(self, reason: str) -> None:
        self.engine.close(reason)

    def shutdown(self) -> None:
        """Stop the engine thread and hand the model's memory back (the registry drops its last reference)."""
        self.metrics.watch(self.settings.model_name, None)
        self.engine.shutdown()
        self.grammars.close()
        self.core = None  # type: ignore[assignment]
        thaw_heap()  # the server froze its startup heap (cli.py): a model loaded then is collectable again
        gc.collect()
        release_freed_memory()

    def stats(self) -> EngineStats:
        return self.engine.stats

    def adapters(self) -> list[str]:
        return self.models.adapters()


def measured(core: LLMEngine, budget: int = 0) -> Fit:
    """The memory of an engine sized by flags (not fitted): its weights, its pool, the runtime estimate."""
    stats = core.stats()
    block = stats.kv_cache_bytes // max(stats.kv_blocks_total, 1)
    return Fit(weights_bytes(core.model), stats.kv_cache_bytes, runtime_bytes(core.model, core.config),
               core.max_model_len, stats.kv_tokens_total, budget, block)


@dataclasses.dataclass
class Loader:
    """Makes a ModelService of a catalog entry (the registry calls it on a thread): the command line's engine
    config and settings with the entry's own over them; the pool and context fitted to the room the budget
    leaves, unless the entry gives a pool size."""

    engine: EngineConfig  # the command line's
    settings: ServerSettings  # the command line's (model_name: replaced by the entry's)
    metrics: ServerMetrics
    traces: TraceStore
    stored: ResponseStore
    speculative: dict[str, Any]  # the command line's speculative_ngram and num_speculative_tokens
    on_step: Callable[[EngineStats], None] | None = None
    on_failure: Callable[[str], None] | None = None  # a tensor-parallel rank died (loading.load's)

    def __call__(self, choice: ModelChoice, room: int | None) -> ModelService:
        from ..loading import load

        config = dataclasses.replace(self.engine, **choice.engine)  # checked: GenerationConfigError
        result = load(choice.spec, on_failure=self.on_failure)
        loaded = result.main
        if choice.chat_template is not None and loaded.tokenizer is not None:
            loaded.tokenizer.use_chat_template(choice.chat_template)
        memory = None
        if room is not None and config.kv_cache_memory is None and config.num_kv_blocks is None:  # no pool size
            dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or loaded.model.dtype
            memory = fit_memory(loaded.model, config, room, dtype)
            config = fitted_config(config, memory)
        core = LLMEngine(loaded.model, loaded.tokenizer, config, loaded.generation_config,
                         self._speculative(choice, result.draft))
        settings = self.settings_of(choice, loaded.path)
        return ModelService(core, settings, self.metrics, self.traces, self.stored,
                            memory or measured(core, room or 0), self.on_step, processor=loaded.images)

    def settings_of(self, choice: ModelChoice, path: Any) -> ServerSettings:
        """The entry's ServerSettings: its names, and its own settings over the command line's."""
        pooling = model_pooling(path) or choice.server.get("pooling", self.settings.pooling)
        return dataclasses.replace(self.settings, model_name=choice.name, aliases=choice.aliases,
                                   **{**choice.server, "pooling": pooling})

    def _speculative(self, choice: ModelChoice, draft: Any) -> SpeculativeConfig | None:
        options = {**self.speculative, **choice.speculative}
        tokens = options.get("num_speculative_tokens", 4)
        if options.get("speculative_ngram"):
            return SpeculativeConfig(tokens)
        return SpeculativeConfig(tokens, draft.model) if draft is not None else None
