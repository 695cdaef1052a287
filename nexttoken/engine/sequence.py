"""Sequence: all the state of one request inside the engine, and TokenEvent, what the engine reports per step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..generation.config import GenerationConfig
from ..generation.decode import StepHook
from ..generation.output_pipeline import OutputPipeline, PromptLogprobs, TopLogprobs
from ..generation.processors.chain import ProcessorChain
from ..generation.stopping import StoppingChain
from ..generation.processors.structured import GrammarMask
from ..generation.speculative import DraftLength
from ..generation.trace.recorder import TraceRecorder


@dataclass
class Speculation:
    """One request's speculation: where its drafts come from and what they achieved."""

    length: DraftLength
    ngram: int | None = None  # prompt lookup's longest n-gram; None when a draft model proposes
    drafter: Any = None  # speculation.Drafter: the draft model and its cache
    draft_cached: int = 0  # tokens whose K/V are in the draft model's slot
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, kept
    steps: int = 0  # verification passes


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: its blocks freed, its tokens recomputed when it runs again)
    RUNNING = "running"  # holds KV blocks: prefilling its prompt in chunks, or decoding one token per step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. Its K/V live in the KV pool's blocks `block_table`, columns [0, num_cached); column = position
    (column s in block block_table[s // block_size])."""

    request_id: str
    prompt_ids: list[int]
    params: GenerationConfig  # the request's options, validated once where the request came in
    out: OutputPipeline  # its tokens, text, log-probs and stop decisions
    processors: ProcessorChain
    sampler: Callable[[torch.Tensor], torch.Tensor]  # owns this request's generator: draws ignore batch-mates
    stopping: StoppingChain | None = None  # a caller's stopping criteria and max_time; None when there are none
    hooks: list[StepHook] = field(default_factory=list)
    grammar: GrammarMask | None = None  # structured output's mask, in `processors`: its next mask is prefetched
    trace: TraceRecorder | None = None  # GenerationConfig.trace: each step recorded (None: nothing extra runs)
    spec: Speculation | None = None  # its draft source and counts when it decodes speculatively
    group: str = ""  # the client request it belongs to: free places go to the requests in turn
    priority: int = 0  # lower runs first (--scheduling-policy priority), as vLLM's
    lora: str | None = None  # the LoRA adapter it decodes under (model.adapters' name); None: the base model
    lora_key: str | None = None  # that adapter's prefix-cache key (its name and which load of it)
    # issue 43: its images, in prompt order (images/prepared.py's PromptImage: prepared alone, hash, prompt span)
    images: tuple = ()
    # M-RoPE (Qwen2.5-VL, a prompt with images): the prompt's (3, P) positions (rope.mrope_index) and the offset
    # every later token's position adds to its column; None / 0: each token's column is its position
    mrope_positions: Any = None
    rope_delta: int = 0
    arrival_time: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None  # its place among the running (0 .. max_num_seqs - 1): a draft model's cache row
    block_table: list[int] = field(default_factory=list)  # its KV pool blocks, in column order
    num_preemptions: int = 0
    num_cached: int = 0  # tokens whose K/V are in its blocks
    prefix_hit_tokens: int = 0  # of them, copied from the prefix cache
    restore_key: Any = None  # a hybrid's hit: the key of the recurrent-state checkpoint its slot starts from
    prompt_logprobs: PromptLogprobs | None = None  # position 0 has none
    scheduled_time: float | None = None  # first admitted
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.out.token_ids

    @property
    def max_tokens(self) -> int:
        return self.out.max_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.out.finish_reason

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.out.token_ids

    @property
    def last_token(self) -> int:
        return self.out.token_ids[-1] if self.out.token_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.out.token_ids)

    @property
    def num_uncached(self) -> int:
        """Tokens still to run through the model: >1 while prefilling, 1 while decoding."""
        return self.num_tokens - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def hook_inputs(self) -> dict[str, Any]:
        """Extra model inputs from this request's hooks for its next forward ({} without hooks)."""
        extra: dict[str, Any] = {}
        for hook in self.hooks:
            extra.update(hook.model_inputs(HookState(self)))
        return extra


class HookState:
    """What a StepHook reads on the engine path: DecodeState's names, for a batch of one row."""

    def __init__(self, seq: Sequence) -> None:
        self.request_id = seq.request_id
        self.ids = torch.tensor([seq.token_ids])  # (1, L) the prompt, then the generated ids
        self.length = seq.num_tokens
        self.next_position = torch.tensor([[seq.num_tokens]])  # (1, 1) position of the next token to be written
        self.unfinished = torch.tensor([seq.finish_reason is None])  # (1,)


@dataclass(frozen=True)
class TokenEvent:
    """What one step added to one request: a self-contained snapshot, safe to hand to another thread."""

    request_id: str
    token_ids: list[int]  # new ids this step (one, or none when only the finish is reported)
    text: str  # new text that is final (never retracted: a possible stop-string start is held back)
    logprobs: list[float]
    top_logprobs: list[TopLogprobs]
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    time: float
    arrival_time: float
    scheduled_time: float | None
    prompt_logprobs: PromptLogprobs | None = None  # with the first event only
    prefix_hit_tokens: int = 0
    trace: dict | None = None  # with the last event of a traced request: its trace (generation/trace/recorder.py)
    spec_draft_tokens: int = 0  # speculative decoding, so far in this request: draft tokens verified
    spec_accepted_tokens: int = 0  # of them, kept
    hidden_stop: bool = False  # the last of token_ids is a stop id the text leaves out (output_pipeline.Delta)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
