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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence as Seq

import torch

from ..detokenizer import IncrementalDetokenizer
from ..errors import GenerationConfigError, LoraError, PromptTooLongError, TensorParallelError, UnknownLoraError
from ..generation.config import GenerationConfig
from ..generation.decode import StepHook
from ..generation.generate import length_budget, model_generation_config
from ..generation.modes import GenerationMode, generation_mode
from ..generation.output_pipeline import OutputPipeline
from ..generation.processors.chain import ChainInputs, LogitsProcessor, build_processors
from ..generation.sampling import Sampler, make_sampler
from ..generation.speculative import DraftLength
from ..generation.stopping import MaxTime, StoppingChain, StoppingCriterion
from ..generation.processors.structured import GrammarMask
from .embedding import EmbeddingError, embed
from ..generation.trace.recorder import TraceRecorder, options_of
from ..model import Transformer
from ..model.lora import AdapterSet, LoraAdapter, Resolver, read_adapter
from .distributed import DistributedRunner
from .block_manager import BlockManager, pool_blocks
from .model_runner import ModelRunner
from .postprocess import advance, advance_greedy, fail, guarded, plain_greedy, snapshot
from .scheduler import POLICIES, Scheduler, StepPlan
from .sequence import Sequence, Speculation, TokenEvent
from .speculation import DEFAULT_NGRAM, Drafter, SpeculativeConfig, Speculator

log = logging.getLogger("nexttoken.engine")


def _prefetch(seqs: list[Sequence]) -> None:
    for seq in seqs:
        try:
            seq.grammar.mask_for(seq.out.token_ids)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - the same error comes back from the processor, and ends that request only
            pass


# Options only the low-level, transformers-shaped generate() returns: the engine reports per-token events.
_LOW_LEVEL_ONLY = ("return_dict_in_generate", "output_scores", "output_logits")


# Verification runs the runner's rows outside the step plan the ranks receive: not with tensor parallelism yet.
_SPEC_TP = ("speculative decoding does not run on a tensor-parallel model yet: drop assistant_model / "
            "prompt_lookup_num_tokens (or --speculative-*), or load the model with tensor_parallel_size=1")


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

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "chunk_size", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GenerationConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise GenerationConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        for name in ("block_size", "kv_cache_memory", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise GenerationConfigError(f"{name} must be an integer >= 1 (or unset), got {value!r}")
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
        self.speculative = speculative  # the default for requests that ask for no speculation themselves
        if speculative is not None and getattr(model, "cluster", None) is not None:
            raise GenerationConfigError(_SPEC_TP)
        self.generation_config = generation_config or model_generation_config(model)
        self.config = config = config or EngineConfig()
        context = model.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or context, context)
        block_size = config.tokens_per_block
        cache_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or model.dtype
        num_blocks = pool_blocks(model, config.max_num_seqs, self.max_model_len, block_size,
                                 config.kv_cache_memory, config.num_kv_blocks, cache_dtype)
        self.blocks = BlockManager(num_blocks, block_size, config.chunk_size, config.enable_prefix_caching)
        # One request alone may fill the pool, never more: a longer one could not run even with all others preempted.
        self.max_seq_tokens = min(self.max_model_len, self.blocks.capacity_tokens)
        self.scheduler = Scheduler(config.max_num_seqs, config.chunk_size, config.max_num_batched_tokens,
                                   self.blocks, config.scheduling_policy)
        # A tensor-parallel model (engine/launch.py) has ranks to drive: its runner broadcasts each step's plan.
        runner = DistributedRunner if getattr(model, "cluster", None) is not None else ModelRunner
        self.runner = runner(model, num_blocks, block_size, self.max_model_len, cache_dtype)
        self.runner.blocks = self.blocks
        cache = getattr(self.runner, "cache", None)
        self.blocks.release = cache.release if cache is not None else None  # freed blocks' pages back when idle
        self.requests: dict[str, Sequence] = {}
        self.speculator = Speculator(self.runner)
        self._drafters: dict[int, Drafter] = {}  # id(draft model) -> its slot cache
        self._spec_totals = [0, 0, 0]  # drafted, accepted, verification passes of finished requests
        self._masks: ThreadPoolExecutor | None = None  # computes grammar masks while the forward pass runs
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
    ) -> Sequence:
        """Queue one sequence. `params` is a validated GenerationConfig for one greedy or sampled sequence
        (`expand` turns num_return_sequences into several). Its text continues the prompt's. `group` names the
        client request it belongs to (default: its own id): waiting requests get free places in turn. `priority`:
        lower runs first under the engine's `priority` scheduling policy (ignored under fcfs).
        `draft_model` (sharing the vocabulary) drafts tokens for speculative decoding, as
        params.prompt_lookup_num_tokens does from the request's own ids (engine/speculation.py). `lora` names a
        loaded adapter (load_lora) that this sequence decodes under; None: the base model."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise GenerationConfigError(f"request id {request_id!r} is already running: use a new id")
        self._check_options(params)
        params.check_vocabulary(self.model.config.vocab_size)  # ids past it: a bad option now, not a crash later
        self._check_prompt(prompt_ids)
        lora_key = None if lora is None else self._adapters(lora).key(lora)  # an unknown name: UnknownLoraError
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
            trace=self._recorder(prompt_ids, params, max_tokens) if params.trace else None,
            group=group if group is not None else request_id,
            priority=priority,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            lora=lora,
            lora_key=lora_key,
        )
        seq.spec = self._speculation(seq, draft_model)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self._prompt_tokens += len(prompt_ids)
        return seq

    # ---- LoRA adapters ----------------------------------------------------------------------------------------
    def load_lora(self, name: str, source: str | Path, resolve: Resolver | None = None) -> LoraAdapter:
        """Read a PEFT LoRA adapter (a folder; other sources through `resolve`, e.g. a Hub id) and serve it under
        `name`, in one of the model's adapter slots (model.adapters: lora.attach set their number and rank).
        Between steps only: the engine's thread calls this (AsyncEngine.call)."""
        adapter = read_adapter(name, source, self.model.config, self._slots().max_rank, resolve)
        self.add_lora(adapter)
        return adapter

    def add_lora(self, adapter: LoraAdapter) -> None:
        """Serve an adapter read already (read_adapter, off the engine's thread) in a free slot."""
        self._slots().add(adapter)

    def _slots(self) -> AdapterSet:
        adapters = self.model.adapters
        if adapters is None:
            raise LoraError("this model has no adapter slots: load it with lora={...} or max_loras=N, or serve "
                            "with --max-loras N (or --lora-modules)")
        return adapters

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`; refused while a request decodes under it."""
        adapters = self._adapters(name)
        users = [s.request_id for s in self.requests.values() if s.lora == name]
        if users:
            raise LoraError(f"LoRA adapter {name!r} is in use by {len(users)} running request(s) "
                            f"({', '.join(users[:3])}): unload it when they have finished")
        adapters.remove(name)

    def _adapters(self, name: str | None) -> AdapterSet:
        adapters = self.model.adapters
        if adapters is None:
            raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded: this model serves no adapters (load "
                                   "it with lora={name: folder}, or serve with --lora-modules / --max-loras)")
        if name is not None:
            adapters.slot(name)
        return adapters

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
        """One forward round: admit, prefill chunks and decode one token per running request, free finished.

        Whatever one request's own work raises (its hooks' inputs, grammar mask, processors, sampler, detokenizer,
        speculation) ends that request alone with finish_reason "error" and the step goes on for the others; an
        error in the shared forward pass ends the requests of this step, and the engine keeps serving."""
        plan = self.scheduler.schedule()
        events: list[TokenEvent] = []
        stepped = self._check_hooks(plan, events)
        speculative = [s for s in plan.decode if s.spec is not None]
        if speculative:
            plan.decode = [s for s in plan.decode if s.spec is None]
        masks = self._prefetch_masks()
        start = time.perf_counter()
        try:
            groups = self.runner.run(plan)
        except TensorParallelError:
            raise  # a rank died: the sharded model cannot answer anything (the server exits)
        except Exception as e:  # noqa: BLE001 - no row to blame: this step's requests end, the engine goes on
            log.exception("a forward pass failed; its %d requests end with an error", len(plan.seqs()))
            groups, speculative = [], []
            events += [fail(seq, e) for seq in plan.seqs()]
            stepped += plan.seqs()
        forward_s = time.perf_counter() - start
        for seqs, logits in groups:  # (rows, V) per group computed together
            for seq in seqs:
                if seq.trace is not None:
                    seq.trace.forward_done(forward_s)
            if masks is not None:  # the rows' processors read the masks computed meanwhile
                masks.result()
                masks = None
            greedy = [i for i, seq in enumerate(seqs) if plain_greedy(seq)]
            if greedy:  # all-greedy rows: one argmax, one log-softmax
                rows = logits if len(greedy) == len(seqs) else logits[greedy]
                events += advance_greedy([seqs[i] for i in greedy], rows)
            events += [guarded(seq, lambda: advance(seq, logits[i : i + 1]))  # noqa: B023 - called at once
                       for i, seq in enumerate(seqs) if not plain_greedy(seq)]
            stepped += seqs
        if speculative:
            try:
                events += self.speculator.step(speculative)
            except TensorParallelError:
                raise
            except Exception as e:  # noqa: BLE001 - the verification's shared forward: these requests end
                log.exception("a verification pass failed; its %d requests end with an error", len(speculative))
                events += [fail(seq, e) for seq in speculative if seq.finish_reason is None]
            stepped += speculative
        if masks is not None:
            masks.result()  # the worker holds no matcher past the step (the mask prefetch never raises)
        for seq in [s for s in stepped if s.finish_reason is not None]:
            self.scheduler.release(seq)
            self.requests.pop(seq.request_id, None)
            if seq.spec is not None:
                self._count_speculation(seq)
        self._steps += 1
        self._generated_tokens += sum(len(e.token_ids) for e in events)
        return events

    def _check_hooks(self, plan: StepPlan, events: list[TokenEvent]) -> list[Sequence]:
        """Ask each hooked request of the plan for its extra model inputs before the forward: one whose hook
        raises leaves the plan and ends alone (the runner would raise inside a forward shared with others)."""
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
        return failed

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
            **self._speculation_totals(running),
        )

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _speculation(self, seq: Sequence, draft_model: Transformer | None) -> Speculation | None:
        """The request's speculation, or None without prompt lookup or a draft model; options it cannot serve
        exactly raise here."""
        params = seq.params
        lookup = params.prompt_lookup_num_tokens
        default = self.speculative
        if (draft_model is not None or lookup is not None) and getattr(self.model, "cluster", None) is not None:
            raise GenerationConfigError(_SPEC_TP)
        if draft_model is None and lookup is None and default is not None and self._can_speculate(seq):
            if default.draft_model is not None:
                return Speculation(DraftLength(default.num_tokens), drafter=self._drafter(default.draft_model))
            return Speculation(DraftLength(default.num_tokens), ngram=default.ngram)
        if draft_model is None and lookup is None:
            if params.max_matching_ngram_size is not None:
                raise GenerationConfigError(
                    "max_matching_ngram_size sets prompt lookup's n-gram: set prompt_lookup_num_tokens too")
            return None
        if draft_model is not None and lookup is not None:
            raise GenerationConfigError(
                "a draft model (assistant_model) and prompt_lookup_num_tokens both propose draft tokens: use one")
        if not self._can_speculate(seq):
            raise GenerationConfigError(
                "speculative decoding works with greedy decoding and sampling, without hooks, structured output, "
                "mirostat or a LoRA adapter: drop assistant_model / prompt_lookup_num_tokens for this request")
        if lookup is not None:
            return Speculation(DraftLength(lookup), ngram=params.max_matching_ngram_size or DEFAULT_NGRAM)
        return Speculation(DraftLength(params.num_assistant_tokens, params.num_assistant_tokens_schedule),
                           drafter=self._drafter(draft_model))

    @staticmethod
    def _can_speculate(seq: Sequence) -> bool:
        return seq.lora is None and not seq.hooks and seq.grammar is None and isinstance(seq.sampler, Sampler)

    def _drafter(self, draft: Transformer) -> Drafter:
        if not isinstance(draft, Transformer):
            raise GenerationConfigError(f"draft_model must be a nexttoken Transformer, got {type(draft).__name__}")
        if draft.config.vocab_size != self.model.config.vocab_size:
            raise GenerationConfigError(
                f"the draft model's vocabulary has {draft.config.vocab_size} tokens and this model's "
                f"{self.model.config.vocab_size}: a draft model must share the tokenizer")
        if draft.config.max_position_embeddings < self.max_model_len:
            raise GenerationConfigError(
                f"the draft model's context ({draft.config.max_position_embeddings}) is shorter than this engine's "
                f"max_model_len ({self.max_model_len}): use a draft with a context at least as long")
        if id(draft) not in self._drafters:
            self._drafters[id(draft)] = Drafter(draft, self.scheduler.num_slots, self.max_model_len)
        return self._drafters[id(draft)]

    def _count_speculation(self, seq: Sequence) -> None:
        self._spec_totals[0] += seq.spec.drafted
        self._spec_totals[1] += seq.spec.accepted
        self._spec_totals[2] += seq.spec.steps

    def _speculation_totals(self, running: list[Sequence]) -> dict[str, int]:
        live = [s.spec for s in running if s.spec is not None]
        return dict(
            spec_draft_tokens_total=self._spec_totals[0] + sum(s.drafted for s in live),
            spec_accepted_tokens_total=self._spec_totals[1] + sum(s.accepted for s in live),
            spec_steps_total=self._spec_totals[2] + sum(s.steps for s in live),
        )

    def _prefetch_masks(self) -> Future | None:
        """Start computing the next grammar mask of every constrained running request, on a worker thread, so it
        is ready when the forward pass returns (llguidance releases the GIL while it computes)."""
        constrained = [s for s in self.scheduler.running if s.grammar is not None]
        if not constrained:
            return None
        if self._masks is None:
            self._masks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nexttoken-grammar")
        return self._masks.submit(_prefetch, constrained)

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

    def _recorder(self, prompt_ids: list[int], params: GenerationConfig, max_tokens: int) -> TraceRecorder:
        tok = self.tokenizer
        decode = None if tok is None else (lambda i: tok.decode([i], skip_special_tokens=False))
        meta = {"prompt_ids": list(prompt_ids), "options": options_of(params), "max_tokens": max_tokens,
                "prompt_text": None if tok is None else tok.decode(prompt_ids, skip_special_tokens=False),
                # what else decides the logits' last bits: a replay elsewhere names the ones that differ
                "engine": {"chunk_size": self.config.chunk_size, "kv_cache_dtype": self.config.kv_cache_dtype,
                           "threads": torch.get_num_threads(),
                           "dtype": str(self.model.dtype), "device": str(self.model.device),
                           "torch": torch.__version__}}
        return TraceRecorder(params.trace_top_n, meta, decode)

    def _detokenizer(self, prompt_ids: list[int], params: GenerationConfig):  # noqa: ANN202
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, prompt_ids=prompt_ids)

