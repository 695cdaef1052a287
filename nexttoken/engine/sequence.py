"""Sequence: all the state of one request inside the engine, and TokenEvent, what the engine reports per step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ..generation.processors import ProcessorChain
from ..generation.sampling import Sampler
from .params import SamplingParams

TopLogprobs = list[tuple[int, float]]  # (token id, log-probability), most likely first


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for a cache slot
    RUNNING = "running"  # owns a slot: prefilling its prompt in chunks, or decoding one token per step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. Its K/V live in cache slot `slot`, columns [0, num_cached); column = position."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # the request's max_tokens, cut to what fits the engine's max_model_len
    processors: ProcessorChain
    sampler: Sampler  # owns this request's torch.Generator: its draws do not depend on batch-mates
    detokenizer: Any = None  # IncrementalDetokenizer, or None for token-id-only models
    arrival_time: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    num_cached: int = 0  # tokens whose K/V are in the slot
    prefix_hit_tokens: int = 0  # of them, copied from the prefix cache
    text: str = ""  # generated text so far (cut at a stop string once one is found)
    streamed: int = 0  # characters of `text` already reported
    logprobs: list[float] = field(default_factory=list)  # chosen tokens, raw model distribution
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, TopLogprobs] | None] | None = None  # position 0 has none
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    scheduled_time: float | None = None  # first admitted to a slot
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncached(self) -> int:
        """Tokens still to run through the model: >1 while prefilling, 1 while decoding."""
        return self.num_tokens - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


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
    prompt_logprobs: list[tuple[float, TopLogprobs] | None] | None = None  # with the first event only
    prefix_hit_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
