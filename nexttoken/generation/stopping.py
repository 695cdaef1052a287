"""Stopping criteria: `(input_ids (B, L), scores (B, V)) -> (B,) bool`, True where a row is done."""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence

import torch

from ..errors import GenerationConfigError

StoppingCriterion = Callable[[torch.Tensor, torch.Tensor], Any]


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class EosToken:
    """Done when the last token is one of the end-of-sequence ids."""

    def __init__(self, eos_ids: Sequence[int]) -> None:
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.eos = self.eos.to(input_ids.device)
        return torch.isin(input_ids[:, -1], self.eos)


class MaxLength:
    """Done when the sequence (prompt included) reaches `max_length` columns."""

    def __init__(self, max_length: int) -> None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise GenerationConfigError(f"max_length must be an integer >= 1, got {max_length!r}")
        self.max_length = max_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        done = input_ids.shape[-1] >= self.max_length
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class MaxTime:
    """Done, for every row, once `max_time` seconds passed since `start` (default: construction) on `clock`
    (default: a monotonic clock, which wall-clock changes do not move)."""

    def __init__(self, max_time: float, start: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(max_time, bool) or not isinstance(max_time, (int, float)) or not max_time > 0:
            raise GenerationConfigError(f"max_time must be a number of seconds > 0, got {max_time!r}")
        self.max_time, self.clock = float(max_time), clock
        self.start = clock() if start is None else start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        done = self.clock() - self.start > self.max_time
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class StopStrings:
    """Done when the generated text contains a stop string, wherever token boundaries fall.

    Only a window of recent tokens is decoded each step: a stop string of n characters spans at most 4n
    byte-fallback tokens (every non-special token yields at least one byte), plus a margin for the decoder's
    context (a SentencePiece decoder strips the window's leading space).
    """

    def __init__(self, tokenizer: Decoder, stop_strings: Sequence[str], prompt_length: int) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = list(stop_strings)
        self.prompt_length = prompt_length
        self.window = 4 * max(len(s) for s in self.stop_strings) + 4

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        start = max(self.prompt_length, input_ids.shape[1] - self.window)
        tails = input_ids[:, start:].tolist()
        return torch.tensor(
            [any(s in self.tokenizer.decode(row, skip_special_tokens=True) for s in self.stop_strings) for row in tails],
            device=input_ids.device,
        )


class StoppingChain:
    """A row is done when any criterion says so. Criteria may return a (B,) bool tensor or one bool."""

    def __init__(self, criteria: Sequence[StoppingCriterion]) -> None:
        self.criteria = list(criteria)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for criterion in self.criteria:
            result = criterion(input_ids, scores)
            done |= torch.as_tensor(result, dtype=torch.bool, device=input_ids.device).expand_as(done)
        return done


def stop_string_holdback(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string.

    A stream holds that tail back: it may still grow into a stop string, and text once shown cannot be retracted.
    """
    best = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
