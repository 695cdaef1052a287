"""LLMEngine: continuous batching over a paged KV pool. Requests join and leave at every step.

    engine = LLMEngine(model, tokenizer)
    engine.add_request(prompt_ids, GenerationConfig(...))   # options validated where the request came in
    while engine.has_unfinished():
        for event in engine.step(): ...

`step()` is schedule -> forward -> choose/stop per request -> free finished requests' blocks. The engine is synchronous
and single-threaded; `AsyncEngine` runs it on a thread for the server.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence as Seq

import torch

from ..text.detokenizer import IncrementalDetokenizer
from ..errors import GenerationConfigError, ImageError, LoraError, PromptTooLongError, TensorParallelError
from ..images.prepared import PromptImage
from ..generation.config import GenerationConfig
from ..generation.decode import StepHook
from ..generation.generate import length_budget, model_generation_config
from ..generation.modes import GenerationMode, generation_mode
from ..generation.output_pipeline import OutputPipeline
from ..generation.processors.chain import ChainInputs, LogitsProcessor, build_processors
from ..generation.sampling import make_sampler
from ..generation.stopping import MaxTime, StoppingChain, StoppingCriterion
from ..generation.processors.mask_prefetch import MaskPrefetch
from ..generation.processors.structured import GrammarMask
from .embedding import EmbeddingError, embed
from ..generation.trace.recorder import request_recorder
from ..model import Transformer
from ..model.recurrent import StateSlots, state_specs
from ..model.lora import AdapterRegistry, LoraAdapter, Resolver, read_adapter, registry_of
from .distributed import DistributedRunner
from .block_manager import BlockManager, pool_blocks
from .encoder import DEFAULT_ENCODER_CACHE_BYTES, EncoderCache
from .model_runner import ModelRunner, check_state_memory, recurrent_layers
from .postprocess import advance, advance_greedy, fail, guarded, plain_greedy, snapshot
from .scheduler import POLICIES, Scheduler, StepPlan
from .sequence import Sequence, TokenEvent
from .speculation import SpeculativeConfig, Speculator
from .state_checkpoints import StateCheckpoints

log = logging.getLogger("nexttoken.engine")


# Options only the low-level, transformers-shaped generate() returns: the engine reports per-token events.
_LOW_LEVEL_ONLY = ("return_dict_in_generate", "output_scores", "output_logits")


def expand(prompts: list[list[int]], cfg: GenerationConfig) -> list[tuple[list[int], GenerationConfig]]:
    """A request's sequences: each prompt's num_return_sequences choices, prompt-major. With a seed, the i-th
    sequence draws from seed + i, so identical prompts in one request still sample differently and the first
    sequence equals the same prompt sent alone."""
    one = dataclasses.replace(cfg, num_return_sequences=1)
    out = []
    for prompt in prompts:
        for _ in range(cfg.num_return_sequences):
            seed = None if cfg.seed is None else (cfg.seed + len(out)) % 2**63
            out.append((prompt, one if seed is None else dataclasses.replace(one, seed=seed)))
    return out


KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32  # sequences running at once (the batch limit; memory is the KV pool's)
    max_model_len: int | None = None  # tokens per request (prompt + output); default: the model's context
    chunk_size: int = 64  # prefill chunk; prefix-cache hits are whole chunks
    max_num_batched_tokens: int = 256  # tokens computed per step (decode rows + prefill chunks)
    enable_prefix_caching: bool = True  # full prompt blocks shared between requests by reference
    block_size: int | None = None  # tokens per KV block; default: 16 (or the chunk size's largest divisor <= 16)
    kv_cache_memory: int | None = None  # bytes of the KV pool; default: a fraction of the memory available
    num_kv_blocks: int | None = None  # the KV pool in blocks instead of bytes
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), float32, bf16 or int8 (per token and head scales)
    scheduling_policy: str = "fcfs"  # fcfs, or priority (a request's `priority`, lower first, as vLLM)
    encoder_cache_memory: int = DEFAULT_ENCODER_CACHE_BYTES  # bytes of image features kept (a model with a tower)
    # hybrid models (recurrent layers): copies of a sequence's state kept where cached prefixes end, each the size
    # of one sequence's state (reserved before the KV pool is sized); None: max_num_seqs; 0: no prefix caching
    state_checkpoints: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "chunk_size", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GenerationConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise GenerationConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if isinstance(self.encoder_cache_memory, bool) or not isinstance(self.encoder_cache_memory, int) \
                or self.encoder_cache_memory < 0:
            raise GenerationConfigError(f"encoder_cache_memory must be an integer >= 0 (bytes), got "
                                        f"{self.encoder_cache_memory!r}")
        for name in ("block_size", "kv_cache_memory", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise GenerationConfigError(f"{name} must be an integer >= 1 (or unset), got {value!r}")
        if self.state_checkpoints is not None and (isinstance(self.state_checkpoints, bool)
                                                   or not isinstance(self.state_checkpoints, int)
                                                   or self.state_checkpoints < 0):
            raise GenerationConfigError(
                f"state_checkpoints must be an integer >= 0 (or unset), got {self.state_checkpoints!r}")
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise GenerationConfigError("give kv_cache_memory or num_kv_blocks, not both: each sizes the KV pool")
        if self.block_size is not None and self.chunk_size % self.block_size:
            raise GenerationConfigError(
                f"block_size {self.block_size} must divide chunk_size {self.chunk_size}: a prefill chunk fills whole "
                "blocks")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise GenerationConfigError(
                f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in POLICIES:
            raise GenerationConfigError(
                f"scheduling_policy must be one of {list(POLICIES)}, got {self.scheduling_policy!r}")

    @property
    def tokens_per_block(self) -> int:
        return self.block_size or math.gcd(16, self.chunk_size)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_slots: int  # max_num_seqs: the running-batch limit
    kv_tokens_used: int  # tokens the running sequences hold in the KV pool
    kv_tokens_total: int  # tokens the pool holds
    kv_blocks_total: int
    kv_blocks_free: int  # free, or holding a cached prefix nobody holds (handed out again when needed)
    kv_blocks_cached: int  # holding a cached prefix block
    kv_block_size: int
    kv_cache_bytes: int  # the pool's size
    preemptions_total: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prompt_tokens_total: int  # prompt tokens of admitted requests
    generated_tokens_total: int
    steps_total: int
    spec_draft_tokens_total: int = 0  # speculative decoding: draft tokens verified
    spec_accepted_tokens_total: int = 0  # of them, kept
    spec_steps_total: int = 0  # verification passes (each adds the kept drafts and one token of the target's)
    state_checkpoints: int = 0  # hybrid models: recurrent-state checkpoints held where cached prefixes end
    state_checkpoint_bytes: int = 0  # their reserved memory

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens_total / self.spec_draft_tokens_total if self.spec_draft_tokens_total else 0.0

    @property
    def kv_usage(self) -> float:
        """Blocks in use / blocks of the pool."""
        used = self.kv_blocks_total - self.kv_blocks_free
        return used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


class LLMEngine:
    """`generation_config`: the model folder's defaults, which requests are resolved against at the edge."""

    def __init__(
        self,
        model: Transformer,
        tokenizer=None,  # noqa: ANN001
        config: EngineConfig | None = None,
        generation_config: GenerationConfig | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.generation_config = generation_config or model_generation_config(model)
        self.config = config = config or EngineConfig()
        context = model.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or context, context)
        block_size = config.tokens_per_block
        cache_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or model.dtype
        # issue 41's hybrids: a state slot per running sequence for each recurrent layer, and the prefix cache's
        # checkpoints of that state (sized and checked first, both)
        self.recurrent = recurrent_layers(model)
        checkpoints = 0
        if self.recurrent and config.enable_prefix_caching:
            checkpoints = config.max_num_seqs if config.state_checkpoints is None else config.state_checkpoints
        state_memory = check_state_memory(model, config.max_num_seqs, checkpoints) if self.recurrent else 0
        self.vision = getattr(model, "vision", None)  # issue 43: the vision tower (None: a text model)
        encoder_memory = config.encoder_cache_memory if self.vision is not None else 0
        num_blocks = pool_blocks(model, config.max_num_seqs, self.max_model_len, block_size, config.kv_cache_memory,
                                 config.num_kv_blocks, cache_dtype, reserved=state_memory + encoder_memory)
        prefix_caching = config.enable_prefix_caching and (not self.recurrent or checkpoints > 0)
        if config.enable_prefix_caching and not prefix_caching:
            log.warning("prefix caching is off for this model (%s): its %s layers keep a recurrent state that a "
                        "cached prefix's K/V blocks do not hold, and state_checkpoints is 0",
                        model.config.architecture, ", ".join(sorted(set(self.recurrent.values()))))
        self.blocks = BlockManager(num_blocks, block_size, config.chunk_size, prefix_caching)
        # One request alone may fill the pool, never more: a longer one could not run even with all others preempted.
        self.max_seq_tokens = min(self.max_model_len, self.blocks.capacity_tokens)
        self.scheduler = Scheduler(config.max_num_seqs, config.chunk_size, config.max_num_batched_tokens,
                                   self.blocks, config.scheduling_policy, adapters=registry_of(model))
        # A tensor-parallel model (engine/launch.py) has ranks to drive: its runner broadcasts each step's plan.
        runner = DistributedRunner if getattr(model, "cluster", None) is not None else ModelRunner
        self.runner = runner(model, num_blocks, block_size, self.max_model_len, cache_dtype)
        self.runner.blocks = self.blocks
        if self.vision is not None:
            self.runner.encoder = EncoderCache(self.vision, encoder_memory)
        if self.recurrent:
            specs = state_specs(model.config)
            self.runner.states = StateSlots(specs, config.max_num_seqs, model.dtype, model.device)
            if prefix_caching:
                self.runner.checkpoints = self.blocks.checkpoints = StateCheckpoints(specs, checkpoints, model.dtype,
                                                                                     model.device)
        cache = getattr(self.runner, "cache", None)
        self.blocks.release = cache.release if cache is not None else None  # freed blocks' pages back when idle
        self.requests: dict[str, Sequence] = {}
        # `speculative`: the default for requests that ask for no speculation themselves
        self.speculator = Speculator(self.runner, self.scheduler.num_slots, speculative)
        self.masks = MaskPrefetch()  # computes grammar masks while the forward pass runs
        self._ids = itertools.count()
        self._prompt_tokens = self._generated_tokens = self._steps = 0

    # ---- requests ----------------------------------------------------------------------------------------------
    def embed(self, prompts: list[list[int]], pooling: str, normalize: bool = True,
              dimensions: int | None = None) -> list[torch.Tensor]:
        """Each prompt's embedding: its final hidden states pooled (embedding.py), computed between steps on the
        engine's model (the server's AsyncEngine calls this on the engine thread)."""
        if not hasattr(self.model, "last_hidden_state"):
            raise EmbeddingError("this model (sharded over ranks) does not compute embeddings: serve it unsharded")
        return embed(self.model, prompts, pooling, normalize, dimensions)

    def add_request(
        self,
        prompt_ids: list[int],
        params: GenerationConfig,
        request_id: str | None = None,
        arrival_time: float | None = None,
        *,
        group: str | None = None,
        priority: int = 0,
        logits_processor: Seq[LogitsProcessor] = (),
        stopping_criteria: Seq[StoppingCriterion] = (),
        hooks: Seq[StepHook] = (),
        draft_model: Transformer | None = None,
        lora: str | None = None,
        images: Seq[PromptImage] = (),
    ) -> Sequence:
        """Queue one sequence. `params` is a validated GenerationConfig for one greedy or sampled sequence
        (`expand` turns num_return_sequences into several). Its text continues the prompt's. `group` names the
        client request it belongs to (default: its own id): waiting requests get free places in turn. `priority`:
        lower runs first under the engine's `priority` scheduling policy (ignored under fcfs).
        `draft_model` (sharing the vocabulary) drafts tokens for speculative decoding, as
        params.prompt_lookup_num_tokens does from the request's own ids (engine/speculation.py). `lora` names a
        loaded adapter (load_lora) that this sequence decodes under; None: the base model. `images`: the prompt's
        images (images/prepared.py's PromptImage, in prompt order; their placeholders already in prompt_ids), each
        encoded before the prefill chunk that holds it, through the encoder cache."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise GenerationConfigError(f"request id {request_id!r} is already running: use a new id")
        self._check_options(params)
        params.check_vocabulary(self.model.config.vocab_size)  # ids past it: a bad option now, not a crash later
        self._check_prompt(prompt_ids)
        lora_key = None if lora is None else self._adapters().key(lora)  # an unknown name: UnknownLoraError
        images = tuple(images)
        if images:
            self._check_images(prompt_ids, images, draft_model)
        if params.stop_string_list and self.tokenizer is None:
            raise GenerationConfigError("stop strings need a tokenizer, and this model folder has none")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise GenerationConfigError(f"priority must be an integer (lower runs first), got {priority!r}")
        max_tokens = length_budget(params, len(prompt_ids), self.max_seq_tokens)
        if params.trace and params.seed is None and not params.greedy:  # a traced draw names its seed: replayable
            params = dataclasses.replace(params, seed=secrets.randbelow(2**63))
        criteria = list(stopping_criteria)
        if params.max_time is not None:
            criteria.insert(0, MaxTime(params.max_time))  # the clock starts when the request is queued
        processors = self._processors(prompt_ids, params, max_tokens, logits_processor)
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            out=OutputPipeline(params, max_tokens, self._detokenizer(prompt_ids, params)),
            processors=processors,
            sampler=make_sampler(params, self.model.device),
            stopping=StoppingChain(criteria) if criteria else None,
            hooks=list(hooks),
            grammar=next((p for p in processors.processors if isinstance(p, GrammarMask)), None),
            trace=request_recorder(params, prompt_ids, max_tokens, self.tokenizer, self._trace_facts())
            if params.trace else None,
            group=group if group is not None else request_id,
            priority=priority,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            lora=lora,
            lora_key=lora_key,
            images=images,
        )
        if images and hasattr(self.vision, "rope_index"):  # M-RoPE (Qwen2.5-VL): the images' 3-D positions
            seq.mrope_positions, seq.rope_delta = self.vision.rope_index(seq.prompt_ids, images)
        seq.spec = self.speculator.setup(seq, draft_model)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self._prompt_tokens += len(prompt_ids)
        return seq

    # ---- LoRA adapters ----------------------------------------------------------------------------------------
    def load_lora(self, name: str, source: str | Path, resolve: Resolver | None = None) -> LoraAdapter:
        """Read a PEFT LoRA adapter (a folder; other sources through `resolve`, e.g. a Hub id) and serve it under
        `name` (the model's registry: lora.attach set its slots and rank). Between steps only: the engine's thread
        calls this (AsyncEngine.call)."""
        adapter = read_adapter(name, source, self.model.config, self._adapters().max_rank, resolve)
        self.add_lora(adapter)
        return adapter

    def add_lora(self, adapter: LoraAdapter, base: Seq[str] = ()) -> None:
        """Serve an adapter read already (read_adapter, off the engine's thread); `base`: names it may not take
        (the base model's own)."""
        self._adapters().register(adapter, base)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`; refused while a request (running or waiting) decodes under it."""
        adapters = self._adapters()
        adapters.resolve(name)  # an unknown name: UnknownLoraError
        users = [s.request_id for s in self.requests.values() if s.lora == name]
        if users:
            raise LoraError(f"LoRA adapter {name!r} is in use by {len(users)} running request(s) "
                            f"({', '.join(users[:3])}): unload it when they have finished")
        adapters.unregister(name)

    def _adapters(self) -> AdapterRegistry:
        """The model's adapter registry (the scheduler's, too: it holds slots for the sequences it admits)."""
        registry = registry_of(self.model)
        self.scheduler.adapters = registry  # the same object unless adapters were attached after this engine
        return registry

    def abort(self, request_id: str) -> TokenEvent | None:
        """Cancel a request; its blocks are free for the next step. Returns its final event (None if unknown)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.release(seq)
        return snapshot(seq, seq.out.finish("abort"), time.monotonic())

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One forward round: schedule (admit, prefill chunks, one decode row per running request), run the model,
        choose each request's next token (the speculative ones: draft, verify, accept), emit; free the finished.

        Whatever one request's own work raises (its hooks' inputs, grammar mask, processors, sampler, detokenizer,
        speculation) ends that request alone with finish_reason "error" and the step goes on for the others; an
        error in the shared forward pass ends the requests of this step, and the engine keeps serving."""
        plan = self.scheduler.schedule()
        events, unhooked = self._check_hooks(plan)
        speculative = self.speculator.take(plan)  # verified apart from the plan
        masks = self.masks.start([(s.grammar, s.out.token_ids) for s in self.scheduler.running
                                  if s.grammar is not None])
        groups = self._run(plan, events)  # (rows, logits) per group computed together; None: the forward failed
        for seqs, logits in groups or []:
            masks.wait()  # the rows' processors read the masks computed meanwhile
            events += self._choose(seqs, logits)
        if groups is not None:
            events += self.speculator.run(speculative)
        masks.wait()  # the worker holds no matcher past the step
        self._release([*unhooked, *plan.seqs(), *speculative], events)
        return events

    def _run(self, plan: StepPlan, events: list[TokenEvent]) -> list[tuple[list[Sequence], torch.Tensor]] | None:
        """The plan's forward pass: logits per group of rows. A failure ends the plan's requests (their events go
        to `events`) and gives None; a tensor-parallel rank's failure goes up (the sharded model cannot answer)."""
        start = time.perf_counter()
        try:
            groups = self.runner.run(plan)
        except TensorParallelError:
            raise
        except Exception as e:  # noqa: BLE001 - no row to blame: this step's requests end, the engine goes on
            log.exception("a forward pass failed; its %d requests end with an error", len(plan.seqs()))
            events += [fail(seq, e) for seq in plan.seqs()]
            return None
        forward_s = time.perf_counter() - start
        for seq in [seq for seqs, _ in groups for seq in seqs if seq.trace is not None]:
            seq.trace.forward_done(forward_s)
        return groups

    @staticmethod
    def _choose(seqs: list[Sequence], logits: torch.Tensor) -> list[TokenEvent]:
        """Each row's next token from the (rows, V) logits computed together: the plain greedy rows in one argmax
        (`advance_greedy`), the others one by one under their own options (`advance`); a row whose own work
        raises ends alone."""
        greedy = [i for i, seq in enumerate(seqs) if plain_greedy(seq)]
        events: list[TokenEvent] = []
        if greedy:  # all-greedy rows: one argmax, one log-softmax
            rows = logits if len(greedy) == len(seqs) else logits[greedy]
            events += advance_greedy([seqs[i] for i in greedy], rows)
        events += [guarded(seq, lambda: advance(seq, logits[i : i + 1]))  # noqa: B023 - called at once
                   for i, seq in enumerate(seqs) if not plain_greedy(seq)]
        return events

    def _release(self, stepped: list[Sequence], events: list[TokenEvent]) -> None:
        """Free the blocks of the step's finished requests, and count the step."""
        for seq in [s for s in stepped if s.finish_reason is not None]:
            self.scheduler.release(seq)
            self.requests.pop(seq.request_id, None)
            self.speculator.finished(seq)
        self._steps += 1
        self._generated_tokens += sum(len(e.token_ids) for e in events)

    def _check_hooks(self, plan: StepPlan) -> tuple[list[TokenEvent], list[Sequence]]:
        """Ask each hooked request of the plan for its extra model inputs before the forward: one whose hook
        raises leaves the plan and ends alone (the runner would raise inside a forward shared with others).
        Their events, and them."""
        events: list[TokenEvent] = []
        failed = []
        for seq in [s for s in plan.seqs() if s.hooks]:
            try:
                seq.hook_inputs()
            except Exception as e:  # noqa: BLE001 - this request ends; the step goes on without it
                events.append(fail(seq, e))
                failed.append(seq)
        if failed:
            plan.decode = [s for s in plan.decode if s not in failed]
            plan.prefill = [c for c in plan.prefill if c.seq not in failed]
        return events, failed

    def generate(self, prompts: list[list[int]], params: GenerationConfig) -> list[Sequence]:
        """Run a request's prompts to completion (batched by the scheduler); finished Sequences, prompt-major."""
        seqs = [self.add_request(p, sp) for p, sp in expand(prompts, params)]
        while self.has_unfinished():
            self.step()
        return seqs

    def stats(self) -> EngineStats:
        running = list(self.scheduler.running)
        blocks, pool = self.blocks, self.runner.cache
        return EngineStats(
            num_running=len(running),
            num_waiting=self.scheduler.num_waiting,
            num_slots=self.scheduler.num_slots,
            kv_tokens_used=sum(s.num_cached for s in running),
            kv_tokens_total=blocks.capacity_tokens,
            kv_blocks_total=blocks.num_blocks - 1,
            kv_blocks_free=blocks.num_free,
            kv_blocks_cached=blocks.num_cached,
            kv_block_size=blocks.block_size,
            kv_cache_bytes=pool.nbytes,
            preemptions_total=self.scheduler.num_preemptions,
            prefix_queried_tokens=blocks.queried_tokens,
            prefix_hit_tokens=blocks.hit_tokens,
            prompt_tokens_total=self._prompt_tokens,
            generated_tokens_total=self._generated_tokens,
            steps_total=self._steps,
            **self.speculator.totals(running),
            **self._checkpoint_stats(),
        )

    def _checkpoint_stats(self) -> dict[str, int]:
        checkpoints = getattr(self.runner, "checkpoints", None)
        if checkpoints is None:
            return {}
        return dict(state_checkpoints=len(checkpoints), state_checkpoint_bytes=checkpoints.nbytes)

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _check_prompt(self, prompt_ids: list[int]) -> None:
        vocab = self.model.config.vocab_size
        if not prompt_ids:
            raise GenerationConfigError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise GenerationConfigError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens but at most {self.max_model_len - 1} fit "
                f"(max_model_len {self.max_model_len}, one new token at least): shorten it"
            )
        if len(prompt_ids) >= self.max_seq_tokens:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens but the KV pool holds {self.blocks.capacity_tokens} "
                f"({self.blocks.num_blocks - 1} blocks of {self.blocks.block_size}), one new token at least: shorten "
                "it, or give the server a larger pool (--kv-cache-memory, --num-kv-blocks)"
            )

    def _check_images(self, prompt_ids: list[int], images: tuple[PromptImage, ...], draft_model: object) -> None:
        """A request's images fit its prompt: a model with a vision tower, each image's span inside the prompt and
        after the one before, and as many placeholder ids in the prompt as the images' encoder rows."""
        if self.vision is None:
            raise ImageError(f"this model ({self.model.config.architecture}) reads text only and cannot take images: "
                             "load a vision-language checkpoint (docs/models.md, 'Images') or send text")
        if draft_model is not None:
            raise GenerationConfigError("a draft model does not see the request's images: speculate with "
                                        "prompt_lookup_num_tokens, or without a draft model")
        end = 0
        for image in images:
            if not (end <= image.start < image.end <= len(prompt_ids)):
                raise ImageError(f"image placeholders at prompt columns [{image.start}, {image.end}) are not inside "
                                 f"the {len(prompt_ids)}-token prompt after the image before")
            end = image.end
        found = sum(t == self.vision.image_token_id for t in prompt_ids)
        if found != sum(image.tokens for image in images):
            raise ImageError(f"the prompt holds {found} image placeholder tokens but its {len(images)} image(s) "
                             f"take {sum(image.tokens for image in images)}: expand each image's placeholder with "
                             "the model's processor, and do not type its image tokens into the text")

    def _check_options(self, params: GenerationConfig) -> None:
        mode = generation_mode(params)
        if mode not in (GenerationMode.GREEDY, GenerationMode.SAMPLE) or params.num_return_sequences != 1:
            raise GenerationConfigError(
                f"the engine decodes one greedy or sampled sequence per request, not {mode.value} with "
                f"num_return_sequences={params.num_return_sequences}: run search strategies through LLM.generate "
                "or nexttoken.generate, and split n sequences with engine.expand"
            )
        for name in _LOW_LEVEL_ONLY:
            if getattr(params, name):
                raise GenerationConfigError(
                    f"{name} is an output of the low-level nexttoken.generate(model, input_ids, ...); "
                    "the engine reports log-probs per token (top_logprobs, prompt_logprobs) instead"
                )

    def _processors(self, prompt_ids: list[int], params: GenerationConfig, max_tokens: int,
                    user: Seq[LogitsProcessor]):  # noqa: ANN202
        inputs = ChainInputs(
            prompt_ids=torch.tensor([prompt_ids], device=self.model.device),
            max_new_tokens=max_tokens,
            vocab_size=self.model.config.vocab_size,
            tokenizer=self.tokenizer,
            model=self.model,  # classifier-free guidance runs its unconditional row through it
        )
        return build_processors(params, list(user), inputs=inputs)

    def _trace_facts(self) -> dict:
        """What of this engine decides a traced request's logits' last bits (a replay elsewhere names the ones
        that differ)."""
        return {"chunk_size": self.config.chunk_size, "kv_cache_dtype": self.config.kv_cache_dtype,
                "dtype": str(self.model.dtype), "device": str(self.model.device)}

    def _detokenizer(self, prompt_ids: list[int], params: GenerationConfig):  # noqa: ANN202
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, prompt_ids=prompt_ids)

