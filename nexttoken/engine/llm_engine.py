"""LLMEngine: continuous batching over a slot KV cache. Requests join and leave at every step.

    engine = LLMEngine(model, tokenizer)
    engine.add_request("a", prompt_ids, SamplingParams(...))
    while engine.has_unfinished():
        for event in engine.step(): ...

`step()` is schedule -> forward -> choose/stop per request -> free finished slots. The engine is synchronous
and single-threaded; `AsyncEngine` runs it on a thread for the server.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from ..detokenizer import IncrementalDetokenizer
from ..errors import GenerationConfigError, PromptTooLongError
from ..generation.constraints import MinNewTokens
from ..generation.processors import ChainInputs, build_processors
from ..generation.sampling import Sampler
from ..model import Transformer
from .model_runner import ModelRunner
from .params import SamplingParams
from .postprocess import advance, snapshot
from .prefix_cache import PrefixCache
from .scheduler import Scheduler
from .sequence import Sequence, TokenEvent


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32  # cache slots = requests decoding at once; the KV memory bound
    max_model_len: int | None = None  # tokens per slot (prompt + output); default: the model's context
    chunk_size: int = 64  # prefill chunk, also the prefix-cache block
    max_num_batched_tokens: int = 256  # tokens computed per step (decode rows + prefill chunks)
    prefix_cache_blocks: int = 256  # blocks of chunk_size tokens kept for prefix reuse (0: off)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "chunk_size", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GenerationConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.prefix_cache_blocks, int) or self.prefix_cache_blocks < 0:
            raise GenerationConfigError(f"prefix_cache_blocks must be an integer >= 0, got {self.prefix_cache_blocks!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise GenerationConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_slots: int
    kv_tokens_used: int  # tokens held in the slots
    kv_tokens_total: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prompt_tokens_total: int  # prompt tokens of admitted requests
    generated_tokens_total: int
    steps_total: int

    @property
    def kv_usage(self) -> float:
        return self.kv_tokens_used / self.kv_tokens_total if self.kv_tokens_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer=None, config: EngineConfig | None = None) -> None:  # noqa: ANN001
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        context = model.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or context, context)
        mc = model.config
        self.prefix_cache = PrefixCache(
            config.prefix_cache_blocks, config.chunk_size, mc.num_hidden_layers, mc.num_key_value_heads,
            mc.head_dim, model.dtype, model.device,
        )
        self.scheduler = Scheduler(
            config.max_num_seqs, config.chunk_size, config.max_num_batched_tokens, self.prefix_cache
        )
        self.runner = ModelRunner(model, config.max_num_seqs, self.max_model_len, self.prefix_cache)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._prompt_tokens = self._generated_tokens = self._steps = 0

    # ---- requests ----------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request. Its text continues the prompt's (keeps a leading space the decoder would strip)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise GenerationConfigError(f"request id {request_id!r} is already running: use a new id")
        self._check_prompt(prompt_ids)
        if params.stop and self.tokenizer is None:
            raise GenerationConfigError("stop strings need a tokenizer, and this model folder has none")
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            max_tokens=min(params.max_tokens, self.max_model_len - len(prompt_ids)),
            processors=self._processors(prompt_ids, params),
            sampler=Sampler(params.greedy, params.generation.seed, self.model.device),
            detokenizer=self._detokenizer(prompt_ids, params),
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self._prompt_tokens += len(prompt_ids)
        return seq

    def abort(self, request_id: str) -> TokenEvent | None:
        """Cancel a request; its slot is free for the next step. Returns its final event (None if unknown)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        self.scheduler.release(seq)
        return snapshot(seq, [], [], [], time.monotonic())

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One forward round: admit, prefill chunks and decode one token per running request, free finished."""
        plan = self.scheduler.schedule()
        logits = self.runner.run(plan)
        events = [self._advance(seq, row) for seq, row in logits.items()]
        for seq in [s for s in logits if s.finish_reason is not None]:
            self.scheduler.release(seq)
            self.requests.pop(seq.request_id, None)
        self._steps += 1
        self._generated_tokens += sum(len(e.token_ids) for e in events)
        return events

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run prompts to completion (all admitted at once, batched by the scheduler); finished Sequences in order."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, each)]
        while self.has_unfinished():
            self.step()
        return seqs

    def stats(self) -> EngineStats:
        running = list(self.scheduler.running)
        return EngineStats(
            num_running=len(running),
            num_waiting=self.scheduler.num_waiting,
            num_slots=self.scheduler.num_slots,
            kv_tokens_used=sum(s.num_cached for s in running),
            kv_tokens_total=self.scheduler.num_slots * self.max_model_len,
            prefix_queried_tokens=self.prefix_cache.queried_tokens,
            prefix_hit_tokens=self.prefix_cache.hit_tokens,
            prompt_tokens_total=self._prompt_tokens,
            generated_tokens_total=self._generated_tokens,
            steps_total=self._steps,
        )

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

    def _processors(self, prompt_ids: list[int], params: SamplingParams):  # noqa: ANN202
        inputs = ChainInputs(
            prompt_ids=torch.tensor([prompt_ids], device=self.model.device),
            max_new_tokens=params.max_tokens,
            vocab_size=self.model.config.vocab_size,
        )
        user = []
        banned = sorted(set(params.generation.eos_ids) | set(params.stop_token_ids))
        if params.min_tokens and banned:
            user.append(MinNewTokens(len(prompt_ids), params.min_tokens, banned))
        return build_processors(params.generation, user, inputs=inputs)

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):  # noqa: ANN202
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, prompt_ids=prompt_ids)

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> TokenEvent:
        try:
            return advance(seq, logits, frozenset(seq.params.generation.eos_ids), self.max_model_len)
        except Exception as e:  # noqa: BLE001 - a request whose options fail at run time ends alone; the rest go on
            seq.finish_reason, seq.stop_reason = "error", f"{type(e).__name__}: {e}"
            return snapshot(seq, [], [], [], time.monotonic())
