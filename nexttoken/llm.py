"""The high-level API: `nexttoken.load(path)` -> LLM, with generate / stream / chat on text or token ids.

An LLM is a thin client of the continuous-batching engine: every greedy or sampled request (one prompt, a list,
a stream, a chat) is a set of engine sequences, decoded as it would be alone. The search strategies (beam
search, beam sampling, group beam, contrastive search) run the padded-batch loop, chosen by their options.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import torch

from .engine.embedding import embed, model_pooling
from .engine import EngineConfig, LLMEngine, TokenEvent, expand
from .engine.postprocess import traced
from .engine.sequence import Sequence as EngineSequence
from .errors import GenerationConfigError, TokenizerError
from .generation.completions import searched_completions
from .generation.config import GenerationConfig
from .generation.generate import length_budget, resolve_config
from .generation.modes import GenerationMode, generation_mode
from .generation.output_pipeline import Completion
from .loading import Loaded
from .loading import load as load_spec
from .loadspec import LoadSpec
from .model import Transformer
from .model.lora import read_adapter, registry_of
from .model.weights.hub import resolve_adapter
from .pretrained import DEFAULT_MODEL_DIR, Pretrained
from .text.tokenizer import Tokenizer
from .generation.values import Thinking
from .chat import ToolUse, format_named, harmony
from .chat.messages import message_images
from .chat.render import ChatPrompt, ChatRenderer
from .images import ImageInputs, ImageLimits, read_images
from .chat.tools.request import tool_options

Prompt = Union[str, Sequence[int]]
Message = dict[str, Any]

__all__ = ["DEFAULT_MODEL_DIR", "LLM", "Completion", "load"]

MAX_SLOTS = 32  # sequences decoded at once by the LLM's engine; more wait for a free slot
MIN_MODEL_LEN = 128  # the engine's smallest decode bucket: engines at least this long give every row one shape


@dataclass
class _Request:
    """One call's options, validated once, and the caller's objects that travel beside them."""

    cfg: GenerationConfig
    logits_processor: list
    stopping_criteria: list
    hooks: list | Callable[[int], list]  # StepHooks of one sequence, or sequence index -> a fresh set
    assistant: Transformer | None = None  # the draft model of speculative decoding (assistant_model)
    # the LoRA adapter every prompt decodes under, or a list with each prompt's (a name given to load; None: the base)
    lora: str | list[str | None] | None = None

    def hooks_for(self, index: int, count: int) -> list:
        """The hooks of sequence `index` of `count`: a hook holds one sequence's state, so never shared."""
        if callable(self.hooks):
            return _as_list(self.hooks(index))
        if self.hooks and count > 1:
            raise GenerationConfigError(
                f"hooks hold one sequence's state, and this call has {count} sequences: pass "
                "hooks=lambda i: [YourHook(...)] to give each sequence its own"
            )
        return self.hooks

    def lora_for(self, prompt: int) -> str | None:
        """The adapter prompt `prompt` decodes under."""
        return self.lora[prompt] if isinstance(self.lora, list) else self.lora

    def check_lora(self, count: int) -> None:
        """A per-prompt list of adapters has one entry per prompt."""
        if isinstance(self.lora, list) and len(self.lora) != count:
            raise GenerationConfigError(f"lora= lists {len(self.lora)} adapters for {count} prompt(s): give one "
                                        "name (or None for the base model) per prompt, or one name for all")

    @property
    def searched(self) -> bool:
        return generation_mode(self.cfg) not in (GenerationMode.GREEDY, GenerationMode.SAMPLE)


class LLM:
    """A loaded model with its tokenizer (None for token-id-only folders) and default generation options."""

    def __init__(
        self, model: Transformer, tokenizer: Tokenizer | None, generation_config: GenerationConfig, path: Path,
        name: str | None = None,
    ) -> None:
        self.model, self.tokenizer, self.generation_config, self.path = model, tokenizer, generation_config, path
        # the folder's name, the GGUF file's stem, or the Hub id (a model built in memory has no path)
        self.name = name or (Path(path).name if path is not None else type(model).__name__)
        model.generation_config = generation_config  # low-level generate(model, ...) uses the same defaults
        self._driver: _Driver | None = None
        self.tool_call_parser: str | None = None  # vLLM's --tool-call-parser name; None: read off the template
        self.reasoning_parser: str | None = None  # vLLM's --reasoning-parser name; None: read off the template
        self._renderer: ChatRenderer | None = None  # the chat renderer of these formats (probes the template once)
        self.merged_lora: str | None = None  # the adapter folded into the weights at load (merge=True)
        self.images: Any = None  # issue 43: the checkpoint's image preprocessing (images/<family>.py); None: text only
        self.image_limits = ImageLimits()  # images per request, pixels and bytes per image

    @classmethod
    def from_pretrained(cls, loaded: Pretrained) -> "LLM":
        llm = cls(loaded.model, loaded.tokenizer, loaded.generation_config, loaded.path, loaded.name)
        llm.images = loaded.images
        return llm

    @classmethod
    def from_loaded(cls, loaded: Loaded, tool_call_parser: str | None = None) -> "LLM":
        """The LLM of what `loading.load` read (its draft model, if any, is `loaded.draft`)."""
        llm = cls.from_pretrained(loaded.main)
        if tool_call_parser is not None:
            format_named(tool_call_parser)  # an unknown name fails here, not at the first chat
            llm.tool_call_parser = tool_call_parser
        if loaded.spec.merge_lora:
            llm.merged_lora = next(iter(loaded.spec.lora))  # type: ignore[arg-type]
        return llm

    # ---- prompts -----------------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self._need_tokenizer().encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError(f"a prompt is a string or a list of token ids (ints), got {type(prompt).__name__}")
        return ids

    def chat_prompt(self, messages: Sequence[Message], **template_kwargs: Any) -> list[int]:
        """The conversation through the chat template, as token ids (template_kwargs: its variables)."""
        return self.chat_renderer.render(messages, variables=template_kwargs).ids

    @property
    def chat_renderer(self) -> ChatRenderer:
        """The one chat renderer (chat/render.py: the server's too) of this model's call and thinking formats."""
        tok = self._need_tokenizer()
        current = self._renderer
        if current is None or (current.tool_call_parser, current.reasoning_parser) != (self.tool_call_parser,
                                                                                      self.reasoning_parser):
            self._renderer = current = ChatRenderer(tok, self.tool_call_parser, self.reasoning_parser)
        return current

    def close(self) -> None:
        """Stop a tensor-parallel model's other ranks (nothing to do for a model in this process alone)."""
        cluster = getattr(self.model, "cluster", None)
        if cluster is not None:
            cluster.close()

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerError(
                f"{self.path} has no tokenizer.json, so text prompts cannot be encoded: pass token ids instead"
            )
        return self.tokenizer

    # ---- embeddings --------------------------------------------------------------------------------------------
    def embed(self, texts: Prompt | Sequence[Prompt], pooling: str | None = None, normalize: bool = True,
              dimensions: int | None = None) -> list[list[float]]:
        """One embedding per text (or token-id list): the final hidden states pooled ("last", "mean", "cls"; by
        default the folder's sentence-transformers pooling, else "last"), L2-normalized unless normalize=False,
        cut to `dimensions` (and normalized again) when given. The server's /v1/embeddings computes the same."""
        single = isinstance(texts, str) or (len(texts) > 0 and isinstance(texts[0], int))  # type: ignore[index]
        prompts = [self.encode(t) for t in ([texts] if single else list(texts))]  # type: ignore[list-item]
        how = pooling or model_pooling(self.path) or "last"
        return [v.tolist() for v in embed(self.model, prompts, how, normalize, dimensions)]

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt | Sequence[Prompt], images: Sequence[Any] | None = None,
                 **options: Any) -> Completion | list[Completion]:
        """Complete one prompt (-> Completion) or a list of prompts (-> list, batched together).

        With num_return_sequences=n (or beams returning n), each prompt gives n completions, prompt-major.
        `images` (a vision-language model): the prompt's images (paths, bytes, data: URLs, PIL images, numpy
        arrays), each placed where the prompt writes the model's image placeholder (Gemma 3: `<start_of_image>`);
        with a list of prompts, a list of such lists, one per prompt."""
        single = isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], int))  # type: ignore[index]
        prompts = [prompt] if single else list(prompt)  # type: ignore[list-item]
        request = self._request(options)
        if images is None:
            return self._pick(self._complete([self.encode(p) for p in prompts], request), single)
        per_prompt = [images] if single else list(images)
        if len(per_prompt) != len(prompts):
            raise GenerationConfigError(f"images= gives {len(per_prompt)} lists for {len(prompts)} prompts: give "
                                        "one list of images per prompt")
        encoded = [self._with_images(p, list(i)) for p, i in zip(prompts, per_prompt)]
        return self._pick(self._complete([ids for ids, _ in encoded], request, [im for _, im in encoded]), single)

    @staticmethod
    def _pick(results: list[Completion], single: bool) -> Completion | list[Completion]:
        return results[0] if single and len(results) == 1 else results

    def _with_images(self, prompt: Prompt, sources: list[Any]) -> tuple[list[int], tuple]:
        """A text prompt and its images -> (prompt ids with every image's placeholders expanded, the images placed
        in them: images/prepared.py's PromptImage)."""
        if not isinstance(prompt, str):
            raise GenerationConfigError("a prompt with images must be text (its image placeholders are expanded "
                                        "before tokenizing), not token ids")
        inputs = self._read_images(sources)
        ids = self.encode(inputs.expand(prompt)) if inputs else self.encode(prompt)
        return ids, inputs.placed(ids, self.model.vision.image_token_id) if inputs else ()

    def _read_images(self, sources: list[Any]) -> ImageInputs:
        return read_images(self.images, sources, self.image_limits, f"{self.name} ({self.model.config.architecture})")

    def chat(self, messages: Sequence[Message], tools: Sequence[Any] | None = None, tool_choice: Any = None,
             parallel_tool_calls: bool | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             **options: Any) -> Completion:
        """Answer a conversation ([{"role": ..., "content": ...}, ...]) through the model's chat template, rendered
        and read as the server's chat APIs render and read it (chat/render.py).

        With `tools` (OpenAI's function definitions) the model may call them: the completion's `tool_calls` are
        the calls (arguments valid under each function's JSON Schema: they are decoded under it), its `text` the
        content outside them, and its finish_reason "tool_calls". `tool_choice` is "auto" (the default with
        tools: the model decides), "none", "required", or {"type": "function", "function": {"name": ...}};
        `parallel_tool_calls=False` allows one call. Past calls and results go in `messages` as OpenAI sends
        them (an assistant message's `tool_calls`, then `role: "tool"` messages with `tool_call_id`). The call
        format is read off the chat template, or set with `llm.tool_call_parser` (vLLM's names).
        A thinking model's thinking (its format read off the template, or `llm.reasoning_parser`) is split off
        the text into `reasoning_content` (also `reasoning`), as the server's reasoning_content; tool calls and
        structured output apply to the answer after it. `chat_template_kwargs`: the template's variables
        (e.g. {"enable_thinking": False})."""
        renderer = self.chat_renderer
        use = self.tool_use(tools, tool_choice, parallel_tool_calls)
        sources = message_images(messages)  # image parts: OpenAI's image_url, or {"type": "image", "image": source}
        inputs = self._read_images(sources) if sources else None
        prompt = renderer.render(messages, use, chat_template_kwargs, expand=inputs.expand if inputs else None)
        placed = [inputs.placed(prompt.ids, self.model.vision.image_token_id)] if inputs else None
        options = dict(options)
        if renderer.markers is not None and options.get("thinking") is None:
            options["thinking"] = Thinking(*renderer.markers)  # the grammar waits for the answer after thinking
        if use is not None:
            options = tool_options(use, self._need_tokenizer(), options)
        request = self._request(options)
        if prompt.harmony:  # gpt-oss's channel markers are special tokens: the answer's parser reads them
            cfg = request.cfg.updated(skip_special_tokens=False)
            if use is None or not use.calls:  # structured output: the final message's, after the analysis
                cfg = harmony.structured(cfg, self._need_tokenizer())
            request = dataclasses.replace(request, cfg=cfg)
        return _answered(self._complete([prompt.ids], request, placed)[0], prompt)

    def tools_prompt(self, messages: Sequence[Message], use: ToolUse) -> list[int]:
        """The conversation with `use`'s tools, as token ids: rendered by the chat template, or, when the template
        renders no tools, with the call format's tools preamble in the system message (docs/tool_calls.md)."""
        return self.chat_renderer.render(messages, use).ids

    def tool_use(self, tools: Sequence[Any] | None, tool_choice: Any = None,
                 parallel_tool_calls: bool | None = None) -> ToolUse | None:
        """A request's tools, validated against this model's call format (None without tools)."""
        if self.tokenizer is None:
            return ToolUse.of(tools, tool_choice, parallel_tool_calls, self.tool_call_parser)
        return self.chat_renderer.tool_use(tools, tool_choice, parallel_tool_calls)

    def stream(self, prompt: Prompt, images: Sequence[Any] | None = None, **options: Any) -> Iterator[str]:
        """Yield text deltas as they are generated; they concatenate to `generate(prompt).text` (`images` as
        generate's for one prompt)."""
        request = self._request(options)
        ids, placed = self._with_images(prompt, list(images)) if images else (self.encode(prompt), ())
        yield from self._stream(ids, request, placed)

    def stream_chat(self, messages: Sequence[Message], **options: Any) -> Iterator[str]:
        if options.get("tools"):
            raise GenerationConfigError("stream_chat() yields text; for tool calls use chat(..., tools=...), or "
                                        "the server's streamed delta.tool_calls")
        request = self._request(options)
        sources = message_images(messages)
        inputs = self._read_images(sources) if sources else None
        prompt = self.chat_renderer.render(messages, expand=inputs.expand if inputs else None)
        placed = inputs.placed(prompt.ids, self.model.vision.image_token_id) if inputs else ()
        yield from self._stream(prompt.ids, request, placed)

    # ---- internals ---------------------------------------------------------------------------------------------
    def _request(self, options: dict[str, Any]) -> _Request:
        """Validate the options once against the model's defaults; the caller's hooks travel beside them."""
        options = dict(options)
        objects = {k: _as_list(options.pop(k, None)) for k in ("logits_processor", "stopping_criteria")}
        hooks = options.pop("hooks", None)
        hooks = hooks if callable(hooks) and not isinstance(hooks, (list, tuple)) else _as_list(hooks)
        assistant = self._assistant(options.pop("assistant_model", None))
        lora = self._lora(options.pop("lora", None))
        request = _Request(resolve_config(self.model, None, options), hooks=hooks, assistant=assistant, lora=lora,
                           **objects)
        if request.searched and any(n is not None for n in (lora if isinstance(lora, list) else [lora])):
            raise GenerationConfigError(
                f"lora= works with greedy decoding and sampling, not {generation_mode(request.cfg).value}: load "
                "the adapter with merge=True to run search strategies under it")
        if request.searched and (assistant is not None or request.cfg.prompt_lookup_num_tokens is not None):
            raise GenerationConfigError(
                f"speculative decoding (assistant_model, prompt_lookup_num_tokens) works with greedy decoding and "
                f"sampling, not {generation_mode(request.cfg).value}")
        return request

    def _lora(self, lora: Any) -> str | list[str | None] | None:
        """The adapters a call names: one name (or None) for every prompt, or a list with one per prompt (vLLM's
        lora_request list), each resolved by the model's registry (the merged adapter's name is the base model's);
        None when no prompt has one. A list's length is checked against the prompts (_Request.check_lora)."""
        names = list(lora) if isinstance(lora, (list, tuple)) else [lora]
        bad = [n for n in names if n is not None and not isinstance(n, str)]
        if bad:
            raise GenerationConfigError(f"lora must name a loaded adapter (a string), or give one name (or None) per "
                                        f"prompt in a list, got {bad[0]!r}")
        registry, base = registry_of(self.model), [self.merged_lora] if self.merged_lora else []
        resolved = [registry.resolve(n, base) for n in names]  # an unknown name raises, naming the loaded ones
        return resolved if isinstance(lora, (list, tuple)) else resolved[0]

    # ---- LoRA adapters -----------------------------------------------------------------------------------------
    @property
    def loras(self) -> list[str]:
        """The names of the adapters calls may choose with lora=name."""
        return registry_of(self.model).names

    def load_lora(self, name: str, path: str | Path) -> None:
        """Serve one more PEFT LoRA adapter (a folder, or a Hub id fetched into the Hub cache) under `name`. More
        adapters than load's max_loras slots may be loaded: a request's adapter takes a slot when it runs."""
        registry = registry_of(self.model)
        adapter = read_adapter(name, path, self.model.config, registry.max_rank, resolve_adapter)
        registry.register(adapter, [self.merged_lora] if self.merged_lora else [])

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (refused while a stream decodes under it)."""
        if self._driver is not None:
            self._driver.engine.unload_lora(name)
        else:
            registry_of(self.model).unregister(name)

    def _assistant(self, assistant: Any) -> Transformer | None:
        """transformers' assistant_model: an LLM (or a bare model) that shares this one's tokenizer."""
        if assistant is None or isinstance(assistant, Transformer):
            return assistant
        if not isinstance(assistant, LLM):
            raise GenerationConfigError(
                f"assistant_model must be a loaded nexttoken LLM or model, got {type(assistant).__name__}")
        mine, theirs = self.tokenizer, assistant.tokenizer
        if mine is not None and theirs is not None and mine.backend.get_vocab() != theirs.backend.get_vocab():
            raise GenerationConfigError(
                f"assistant_model {assistant.path} has a different tokenizer from {self.path}: a draft model must "
                "share the tokenizer (the same token ids for the same text)")
        return assistant.model

    def _complete(self, prompts: list[list[int]], request: _Request,
                  images: list[tuple] | None = None) -> list[Completion]:
        """`images`: each prompt's placed images (PromptImage), or None for text alone."""
        if not prompts:
            return []
        cfg = request.cfg
        if request.searched and images is not None and any(images):
            raise GenerationConfigError(f"images work with greedy decoding and sampling, not "
                                        f"{generation_mode(cfg).value}")
        if request.searched:
            if request.hooks:
                raise GenerationConfigError(f"hooks work with greedy decoding and sampling, not {generation_mode(cfg).value}")
            return searched_completions(self.model, self.tokenizer, prompts, cfg, self._pad_id(cfg),
                                        request.logits_processor, request.stopping_criteria)
        request.check_lora(len(prompts))
        driver = self._driver_for(prompts, cfg)
        each = expand(prompts, cfg)  # prompt-major: sequence i is prompt i // num_return_sequences's
        n = cfg.num_return_sequences
        seqs = [driver.submit(p, c, request, request.hooks_for(i, len(each)), request.lora_for(i // n),
                              images[i // n] if images is not None else ()) for i, (p, c) in enumerate(each)]
        driver.run(seqs)
        return [self._completion(s) for s in seqs]

    def _stream(self, prompt: list[int], request: _Request, images: tuple = ()) -> Iterator[str]:
        if request.searched or request.cfg.num_return_sequences != 1:
            raise GenerationConfigError(
                "stream() yields one greedy or sampled sequence: leave num_beams, penalty_alpha and "
                "num_return_sequences at their defaults (use generate() for those)"
            )
        if request.cfg.trace:
            raise GenerationConfigError("stream() yields text and has nowhere to put a trace: use generate() or "
                                        "chat() with trace=True (the server's streams carry it on the last chunk)")
        self._need_tokenizer()
        request.check_lora(1)
        driver = self._driver_for([prompt], request.cfg)
        seq = driver.submit(prompt, request.cfg, request, request.hooks_for(0, 1), request.lora_for(0), images)
        for event in driver.events(seq):
            _check_event(event)
            if event.text:
                yield event.text

    def _completion(self, seq: EngineSequence) -> Completion:
        if seq.finish_reason == "error":
            raise GenerationConfigError(f"generation failed: {seq.out.stop_reason}")
        prompt_text = ""
        if seq.params.echo and self.tokenizer is not None:
            prompt_text = self.tokenizer.decode(seq.prompt_ids, skip_special_tokens=seq.params.skip_special_tokens)
        completion = seq.out.completion(seq.prompt_ids, seq.prompt_logprobs, prompt_text)
        if seq.spec is not None:  # speculative decoding: the drafts verified for this sequence
            completion = dataclasses.replace(completion, accepted_draft_tokens=seq.spec.accepted,
                                             rejected_draft_tokens=seq.spec.drafted - seq.spec.accepted)
        if seq.trace is None:
            return completion
        return dataclasses.replace(completion, trace={**traced(seq), "model": str(self.path)})

    def _driver_for(self, prompts: list[list[int]], cfg: GenerationConfig) -> "_Driver":
        """The engine, rebuilt larger when this call needs more slots or a longer context than it has. Its length
        is a power of two (>= the decode buckets), so a row attends over the same span in any engine."""
        context = self.model.config.max_position_embeddings
        needed = max(len(p) + length_budget(cfg, len(p), context) for p in prompts)
        length = min(context, max(MIN_MODEL_LEN, 1 << (needed - 1).bit_length()))
        slots = min(MAX_SLOTS, len(prompts) * cfg.num_return_sequences)
        current = self._driver
        if current is None or current.engine.max_model_len < length or current.engine.scheduler.num_slots < slots:
            if current is not None:
                length = max(length, current.engine.max_model_len)
                slots = max(slots, current.engine.scheduler.num_slots)
            config = EngineConfig(max_num_seqs=slots, max_model_len=length, enable_prefix_caching=False,
                                  max_num_batched_tokens=512)
            self._driver = _Driver(LLMEngine(self.model, self.tokenizer, config, self.generation_config))
        return self._driver

    def _pad_id(self, cfg: GenerationConfig) -> int:
        for candidate in (cfg.pad_token_id, self.tokenizer and self.tokenizer.pad_token_id, *cfg.eos_ids):
            if candidate is not None:
                return int(candidate)
        return 0


class _Driver:
    """Steps a synchronous engine for the calls waiting on it; a stream's events queue up while another call
    steps the engine, so several streams of one LLM may be read in turns."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.queues: dict[str, deque[TokenEvent]] = {}

    def submit(self, prompt: list[int], cfg: GenerationConfig, request: _Request, hooks: list,
               lora: str | None = None, images: tuple = ()) -> EngineSequence:
        return self.engine.add_request(prompt, cfg, logits_processor=request.logits_processor,
                                       stopping_criteria=request.stopping_criteria, hooks=hooks,
                                       draft_model=request.assistant, lora=lora, images=images)

    def run(self, seqs: list[EngineSequence]) -> None:
        """Step until every one of seqs has finished."""
        while any(s.finish_reason is None for s in seqs):
            self._step()

    def events(self, seq: EngineSequence) -> Iterator[TokenEvent]:
        """seq's events as they come; closing the iterator early aborts it."""
        rid, finished = seq.request_id, False
        queue = self.queues[rid] = deque()
        try:
            while not finished:
                while not queue:
                    self._step()
                event = queue.popleft()
                finished = event.finished
                yield event
        finally:
            self.queues.pop(rid, None)
            if not finished:
                self.engine.abort(rid)

    def _step(self) -> None:
        for event in self.engine.step():
            queue = self.queues.get(event.request_id)
            if queue is not None:
                queue.append(event)


def _answered(completion: Completion, prompt: ChatPrompt) -> Completion:
    """A chat completion's text split as the server splits it: thinking into reasoning_content, calls into
    tool_calls (finish_reason "tool_calls"), the content outside them as the text."""
    if prompt.calls is None and prompt.reasoning is None:
        return completion
    answer = prompt.split(completion.text, cut=completion.finish_reason == "length")
    fields: dict[str, Any] = {"text": answer.content, "reasoning_content": answer.reasoning}
    if answer.tool_calls:
        fields["tool_calls"] = answer.tool_calls
        if completion.finish_reason == "stop":
            fields["finish_reason"] = "tool_calls"
    if completion.trace is not None and prompt.reasoning is not None:  # the trace keeps the split, as the server's
        fields["trace"] = {**completion.trace, "reasoning": answer.reasoning, "content": answer.content}
    return dataclasses.replace(completion, **fields)


def _check_event(event: TokenEvent) -> None:
    if event.finish_reason == "error":
        raise GenerationConfigError(f"generation failed: {event.stop_reason}")


def _as_list(items: Any) -> list:
    if items is None:
        return []
    if callable(items) and not isinstance(items, (list, tuple)):
        return [items]
    return list(items)


def load(
    path: str | Path | LoadSpec | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    quantize: str | None = None,
    tool_call_parser: str | None = None,
    tensor_parallel_size: int = 1,
    tensor_parallel_timeout: float = 60.0,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    gguf_file: str | None = None,
    tokenizer: str | Path | None = None,
    lora: dict[str, str | Path] | None = None,
    merge: bool = False,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    max_cpu_loras: int | None = None,
    dequantize: bool = False,
    gguf_activations: str | None = None,
    prefill: str | None = None,
    threads: int | None = None,
) -> LLM:
    """Load a model (the packaged default model when path is None): a Hugging Face model folder, a GGUF file
    ("model.gguf"), or a Hugging Face Hub id ("org/name" at `revision`; "org/name:Q4_K_M" or `gguf_file=` for one
    of its GGUF files), resolved in the Hub cache (`download_dir`, or huggingface_hub's) and downloaded unless
    HF_HUB_OFFLINE=1. `tokenizer`: a folder or Hub id whose tokenizer replaces the model's. `path` may also be a
    `nexttoken.LoadSpec` holding every loading option (then give no other option but tool_call_parser). Each
    value is checked before a file is read (loadspec.py): a bad one raises ModelLoadError naming it.

    quantize="int8": weight-only int8 (per-row scales), about half of bf16's bytes read per token;
    quantize="int4": 4-bit groups of 32 with float16 scales (llama.cpp's Q4_0 scheme), 4.5 bits per weight;
    quantize="bf16": bfloat16 weights with float32 activations (llama.cpp's bf16), the float32 fast path.
    dtype: by default on CPU a bf16 checkpoint keeps bf16 weights with float32 activations (what quantize="bf16"
    builds; exact against transformers float32 on the same file), anything else float32; "float32" widens,
    "bfloat16" runs every module in bf16 (docs/models.md, Precision).
    A GGUF file's quantized matrices stay in their blocks (Q4_K, Q8_0, ...) and are multiplied natively, by default
    with float32 activations on the blocks dequantized in registers: the answers of the file's own weights in
    float32 (gguf_activations="int8": 8-bit activations per block as llama.cpp does, faster and inexact; "int16"
    in between; None: the arithmetic policy's default, model/arithmetic.py); dequantize=True loads the float32
    model of their exact dequantized values. prefill: how prompts' rows are multiplied, "float32" (exact, the
    default) or "bfloat16" (llama.cpp's bf16 GEMMs: faster, inexact).
    threads: torch's intra-op threads for this process (default: torch's choice).
    tool_call_parser: the format the model writes tool calls in (vLLM's names: "hermes", "llama3_json",
    "mistral"); by default it is read off the chat template.
    tensor_parallel_size=N: the model sharded over N ranks (docs/tensor_parallel.md): N-1 local worker
    processes are started (under torchrun, the ranks torchrun started are used); `LLM.close()` stops them. A rank
    that dies or stays silent for tensor_parallel_timeout seconds makes every later call raise.
    lora={"name": folder, ...}: PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) that each
    call may choose with generate(..., lora="name"), or per prompt with a list (lora=["a", None, "b"]); requests
    of different adapters share batches, each row applying its own (docs/lora.md). max_loras (default: len(lora),
    at least 1) adapter slots of rank max_lora_rank (default: the largest adapter's) serve them; llm.load_lora adds
    more adapters than slots (a slot is taken when a request runs, the least recently used idle adapter's when none
    is free), up to max_cpu_loras (default: max_loras when that is given, else no limit: vLLM's pair). merge=True
    folds the one adapter into the weights (no per-row products: the base model's speed; lora="name" then names the
    model itself). With quantize, the adapter is merged into the float weights first and the sum quantized once; a
    quantized base serving unmerged adapters keeps its quantized product and adds the low-rank products in float32
    beside it.
    """
    if isinstance(path, LoadSpec):  # the whole specification at once (the CLI, the server and the bench build one)
        return LLM.from_loaded(load_spec(path), tool_call_parser)
    spec = LoadSpec.of(model=path, dtype=dtype, device=device, quantize=quantize,
                       tensor_parallel_size=tensor_parallel_size, tensor_parallel_timeout=tensor_parallel_timeout,
                       revision=revision, download_dir=download_dir, gguf_file=gguf_file, tokenizer=tokenizer,
                       lora=lora, merge_lora=merge, max_loras=max_loras, max_lora_rank=max_lora_rank,
                       max_cpu_loras=max_cpu_loras,
                       dequantize=dequantize, gguf_activations=gguf_activations, prefill=prefill,
                       threads=threads)
    return LLM.from_loaded(load_spec(spec), tool_call_parser)
