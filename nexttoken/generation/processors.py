"""Logits processors: pure transforms `(input_ids (B, L), scores (B, V)) -> scores (B, V)`.

Each validates its arguments once, at construction, and never writes into its input. The numerics follow
transformers' processors of the same name (`generation/logits_process.py`) so that processed scores match.
Any callable with the same signature works in a chain, transformers' `LogitsProcessor` objects included.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ..errors import GenerationConfigError
from .config import GenerationConfig

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
NEG_INF = -math.inf


class RepetitionPenalty:
    """Divide positive (multiply negative) scores of tokens already in the sequence by `penalty` (CTRL paper).

    `ignore_before` (B,) skips each row's first columns: the left padding, whose pad id is no real token.
    """

    def __init__(self, penalty: float, ignore_before: torch.Tensor | None = None) -> None:
        if not (isinstance(penalty, (int, float)) and penalty > 0):
            raise GenerationConfigError(f"repetition_penalty must be > 0, got {penalty!r}")
        self.penalty = float(penalty)
        self.ignore_before = ignore_before

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        if self.ignore_before is not None:
            cols = torch.arange(input_ids.shape[1], device=input_ids.device)
            # Ignored columns point at an extra, discarded vocabulary slot.
            input_ids = input_ids.masked_fill(cols < self.ignore_before[:, None].to(input_ids.device), vocab)
        seen = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
        seen.scatter_(1, input_ids.clamp(max=vocab), True)
        penalized = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(seen[:, :vocab], penalized, scores)


class Temperature:
    def __init__(self, temperature: float) -> None:
        if not (isinstance(temperature, (int, float)) and temperature > 0 and math.isfinite(temperature)):
            raise GenerationConfigError(f"temperature must be a finite number > 0 here, got {temperature!r}")
        self.temperature = float(temperature)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


class TopK:
    """Keep the k highest scores (ties with the k-th included)."""

    def __init__(self, top_k: int, min_tokens_to_keep: int = 1) -> None:
        if not (isinstance(top_k, int) and top_k > 0):
            raise GenerationConfigError(f"top_k must be a positive integer, got {top_k!r}")
        self.top_k = max(top_k, min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1:]  # (B, 1)
        return scores.masked_fill(scores < kth, NEG_INF)


class TopP:
    """Nucleus sampling: keep the smallest set of top tokens whose probability reaches `top_p`."""

    def __init__(self, top_p: float, min_tokens_to_keep: int = 1) -> None:
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise GenerationConfigError(f"top_p must be in (0, 1], got {top_p!r}")
        self.top_p, self.min_tokens_to_keep = float(top_p), min_tokens_to_keep

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - self.top_p)  # the low tail whose total mass is <= 1 - top_p
        remove_sorted[..., -self.min_tokens_to_keep :] = False
        remove = remove_sorted.scatter(1, order, remove_sorted)
        return scores.masked_fill(remove, NEG_INF)


class MinP:
    """Drop tokens whose probability is below `min_p` times the top token's."""

    def __init__(self, min_p: float, min_tokens_to_keep: int = 1) -> None:
        if not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
            raise GenerationConfigError(f"min_p must be in [0, 1], got {min_p!r}")
        self.min_p, self.min_tokens_to_keep = float(min_p), min_tokens_to_keep

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = scores.softmax(dim=-1)
        remove = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
        keep = torch.topk(probs, min(self.min_tokens_to_keep, probs.shape[-1]), dim=-1).indices
        remove = remove.scatter(-1, keep, False)
        return scores.masked_fill(remove, NEG_INF)


class ProcessorChain:
    """Processors applied in order; an empty chain returns the scores unchanged."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for p in self.processors:
            scores = p(input_ids, scores)
        return scores

    def __len__(self) -> int:
        return len(self.processors)


def build_processors(
    cfg: GenerationConfig,
    user: Sequence[LogitsProcessor] = (),
    padding: torch.Tensor | None = None,
) -> ProcessorChain:
    """The chain transformers' `_get_logits_processor` builds for these options, in its order.

    Penalties come first, then the user's processors, then (only when sampling) the warpers: temperature before
    top_k/top_p/min_p so that the truncation sees the distribution that will be sampled.
    """
    chain: list[LogitsProcessor] = []
    if cfg.repetition_penalty != 1.0:
        chain.append(RepetitionPenalty(cfg.repetition_penalty, ignore_before=padding))
    chain.extend(user)
    if not cfg.greedy:
        if cfg.temperature != 1.0:
            chain.append(Temperature(cfg.temperature))
        if cfg.top_k:
            chain.append(TopK(cfg.top_k))
        if cfg.top_p < 1.0:
            chain.append(TopP(cfg.top_p))
        if cfg.min_p is not None:
            chain.append(MinP(cfg.min_p))
    return ProcessorChain(chain)
