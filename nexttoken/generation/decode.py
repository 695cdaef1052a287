"""The decode loop: prefill, then forward -> processors -> choose -> stop -> emit, one step at a time.

Everything else (which processors, when to stop, what to collect, how to print) is decided before the loop
starts, in a DecodePlan, and consumed after it, from the StepOutputs it yields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ..model import ForwardBatch, Transformer
from .processors import ProcessorChain
from .sampling import Sampler
from .stopping import StoppingChain


@dataclass
class DecodePlan:
    """What one generation call will do, fixed before the first forward pass."""

    input_ids: torch.Tensor  # (B, P) left-padded prompts
    attention_mask: torch.Tensor  # (B, P) 1 for real tokens, 0 for padding
    max_new_tokens: int
    pad_token_id: int
    processors: ProcessorChain
    sampler: Sampler
    stopping: StoppingChain


@dataclass
class DecodeState:
    """The growing sequences. Buffers are allocated once at full length and filled column by column."""

    tokens: torch.Tensor  # (B, P + max_new) prompt then generated ids; columns >= length not yet written
    key_valid: torch.Tensor  # (B, P + max_new) bool: column holds a real token (the attention mask)
    next_position: torch.Tensor  # (B, 1) rotary position of the token to be written next
    length: int  # columns written so far
    unfinished: torch.Tensor  # (B,) bool

    @classmethod
    def start(cls, plan: DecodePlan) -> "DecodeState":
        B, P = plan.input_ids.shape
        total = P + plan.max_new_tokens
        tokens = torch.full((B, total), plan.pad_token_id, dtype=torch.long, device=plan.input_ids.device)
        tokens[:, :P] = plan.input_ids
        key_valid = torch.ones((B, total), dtype=torch.bool, device=tokens.device)
        key_valid[:, :P] = plan.attention_mask.bool()
        next_position = plan.attention_mask.sum(dim=1, keepdim=True)  # real tokens so far = next position
        unfinished = torch.ones(B, dtype=torch.bool, device=tokens.device)
        return cls(tokens, key_valid, next_position, P, unfinished)

    def prompt_positions(self) -> torch.Tensor:
        """(B, P) positions of the prompt tokens: left padding shifts each row so its first real token is 0."""
        mask = self.key_valid[:, : self.length].long()
        return (mask.cumsum(dim=1) - 1).clamp(min=0)

    def append(self, next_tokens: torch.Tensor) -> None:
        self.tokens[:, self.length] = next_tokens
        self.length += 1

    @property
    def ids(self) -> torch.Tensor:
        return self.tokens[:, : self.length]


@dataclass
class StepOutput:
    tokens: torch.Tensor  # (B,) the ids chosen this step (pad for rows finished earlier)
    logits: torch.Tensor  # (B, V) float32, as the model produced them
    scores: torch.Tensor  # (B, V) float32, after the processors
    finished: torch.Tensor  # (B,) bool: the row stopped at this step (EOS, stop string or user criterion)
    unfinished: torch.Tensor  # (B,) bool: the row is still running after this step


def prefill(model: Transformer, state: DecodeState, cache, sliding_window: int | None) -> torch.Tensor:
    P = state.length
    write_index = torch.arange(P, device=state.tokens.device).expand(state.tokens.shape[0], P)
    batch = ForwardBatch.build(
        state.prompt_positions(), write_index, state.key_valid, P, sliding_window, write_start=0
    )
    return model(state.ids, batch, cache).float()


def forward_last(model: Transformer, state: DecodeState, cache, sliding_window: int | None) -> torch.Tensor:
    """Run the newest token of every row through the model; (B, V) float32 logits."""
    col = state.length - 1
    write_index = torch.full_like(state.next_position, col)
    batch = ForwardBatch.build(
        state.next_position, write_index, state.key_valid, state.length, sliding_window, write_start=col
    )
    state.next_position = state.next_position + 1
    return model(state.tokens[:, col : col + 1], batch, cache).float()


@torch.inference_mode()
def decode_steps(model: Transformer, plan: DecodePlan) -> Iterator[StepOutput]:
    """Yield one StepOutput per generated column until every row stops or max_new_tokens is reached."""
    state = DecodeState.start(plan)
    if plan.max_new_tokens == 0:
        return
    window = model.config.sliding_window
    cache = model.new_cache(state.tokens.shape[0], state.tokens.shape[1])
    logits = prefill(model, state, cache, window)
    for step in range(plan.max_new_tokens):
        scores = plan.processors(state.ids, logits)
        chosen = torch.where(state.unfinished, plan.sampler(scores), plan.pad_token_id)
        state.append(chosen)
        finished = plan.stopping(state.ids, scores) & state.unfinished
        state.unfinished = state.unfinished & ~finished
        yield StepOutput(chosen, logits, scores, finished, state.unfinished)
        if step + 1 == plan.max_new_tokens or not state.unfinished.any():
            return
        logits = forward_last(model, state, cache, window)
