"""The thinking budget: a reasoning model's thinking block closed after `budget` tokens.

A processor, not an engine rule: (B, L) ids, (B, V) scores -> scores where, in a row whose open block has run its
budget, every token but the end marker is -inf. So the next token closes the block, for greedy and sampled rows
alike, in the engine and the padded loop, and what the model writes after it is an answer like any other (the
structured-output mask, which waits for the block to close, then applies). Where the block is, is read off the
tokens (values.Thinking): the processor keeps no state but each row's prompt verdict.
"""

from __future__ import annotations

import math

import torch

from ..values import Thinking


class ThinkingBudget:
    def __init__(self, thinking: Thinking, prompt_length: int) -> None:
        if thinking.budget is None:
            raise ValueError("ThinkingBudget needs a budget")
        self.thinking, self.prompt_length = thinking, prompt_length
        self.opened: list[bool] | None = None  # per row: the prompt left the block open (read on the first call)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        P, t = self.prompt_length, self.thinking
        if self.opened is None or len(self.opened) != input_ids.shape[0]:
            self.opened = [t.open_after(input_ids[r, :P].tolist()) for r in range(input_ids.shape[0])]
        over = []
        for row in range(input_ids.shape[0]):
            generated = input_ids[row, P:].tolist()
            begun, after = t.span(self.opened[row], generated)
            if begun is not None and after is None and len(generated) - (begun + 1) >= t.budget:  # type: ignore[operator]
                over.append(row)
        if not over:
            return scores
        out = scores.clone()
        keep = out[over, t.end_id].clone()
        out[over] = -math.inf
        out[over, t.end_id] = torch.where(torch.isfinite(keep), keep, torch.zeros_like(keep))
        return out
