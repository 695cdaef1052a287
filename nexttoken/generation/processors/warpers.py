"""Sampling warpers (transformers' names and arithmetic): temperature and the truncation rules that keep a
head of the distribution: top-k, top-p, min-p, top-H, typical, epsilon and eta.

`min_tokens_to_keep` is > 1 only in beam sampling, where every beam needs a non-EOS continuation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import GenerationConfigError

NEG_INF = -math.inf


def _in_range(name: str, v: Any, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        raise GenerationConfigError(f"{name} must be a number in {left}{lo}, {hi}{right}, got {v!r}")
    return float(v)


def _keep(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise GenerationConfigError(f"min_tokens_to_keep must be an integer >= 1, got {v!r}")
    return v


def _protect_top(scores: torch.Tensor, remove: torch.Tensor, n: int) -> torch.Tensor:
    """Never remove the n best-scored tokens."""
    return remove & (scores < torch.topk(scores, min(n, scores.shape[-1])).values[..., -1:])


class Temperature:
    def __init__(self, temperature: float) -> None:
        self.temperature = _in_range("temperature", temperature, 0.0, math.inf, lo_open=True)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


class TopK:
    """Keep the k highest scores (ties with the k-th included)."""

    def __init__(self, top_k: int, min_tokens_to_keep: int = 1) -> None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0:
            raise GenerationConfigError(f"top_k must be a positive integer, got {top_k!r}")
        self.top_k = max(top_k, _keep(min_tokens_to_keep))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1:]  # (B, 1)
        return scores.masked_fill(scores < kth, NEG_INF)


class TopP:
    """Nucleus sampling: keep the smallest set of top tokens whose probability reaches `top_p`."""

    def __init__(self, top_p: float, min_tokens_to_keep: int = 1) -> None:
        self.top_p = _in_range("top_p", top_p, 0.0, 1.0)
        self.min_tokens_to_keep = _keep(min_tokens_to_keep)

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
        self.min_p = _in_range("min_p", min_p, 0.0, 1.0)
        self.min_tokens_to_keep = _keep(min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = scores.softmax(dim=-1)
        remove = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
        keep = torch.topk(probs, min(self.min_tokens_to_keep, probs.shape[-1]), dim=-1).indices
        remove = remove.scatter(-1, keep, False)
        return scores.masked_fill(remove, NEG_INF)


class TopH:
    """Top-H (transformers' `top_h`): among the 100 best tokens keep the head whose cumulative entropy
    contribution stays within `top_h` times the entropy of that top-100 distribution."""

    TOP_N = 100

    def __init__(self, top_h: float) -> None:
        self.top_h = _in_range("top_h", top_h, 0.0, 1.0, lo_open=True)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n = min(self.TOP_N, scores.shape[-1])
        top, idx = torch.topk(scores, n, dim=-1)  # (B, n) sorted
        probs = top.softmax(dim=-1)
        terms = -probs * torch.log(probs)
        tau = torch.distributions.Categorical(logits=top).entropy()[:, None] * self.top_h
        select = terms.cumsum(dim=-1) <= tau
        select[:, 0] = True
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, select)
        return scores.masked_fill(~keep, NEG_INF)


class Typical:
    """Locally typical sampling (Meister et al. 2022): keep tokens whose surprise is closest to the entropy,
    up to `typical_p` mass."""

    def __init__(self, mass: float, min_tokens_to_keep: int = 1) -> None:
        self.mass = _in_range("typical_p", mass, 0.0, 1.0, lo_open=True, hi_open=True)
        self.min_tokens_to_keep = _keep(min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = scores.log_softmax(dim=-1)
        entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
        shifted = (-logp - entropy).abs()
        sorted_shifted, order = torch.sort(shifted, descending=False)
        cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (cumulative < self.mass).sum(dim=1).clamp(max=scores.shape[-1] - 1)
        remove_sorted = sorted_shifted > sorted_shifted.gather(1, last.view(-1, 1))
        remove_sorted[..., : self.min_tokens_to_keep] = False
        return scores.masked_fill(remove_sorted.scatter(1, order, remove_sorted), NEG_INF)


class Epsilon:
    """Epsilon sampling (Hewitt et al. 2022): drop tokens with probability below `epsilon`."""

    def __init__(self, epsilon: float, min_tokens_to_keep: int = 1) -> None:
        self.epsilon = _in_range("epsilon_cutoff", epsilon, 0.0, 1.0, lo_open=True, hi_open=True)
        self.min_tokens_to_keep = _keep(min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        remove = _protect_top(scores, scores.softmax(dim=-1) < self.epsilon, self.min_tokens_to_keep)
        return scores.masked_fill(remove, NEG_INF)


class Eta:
    """Eta sampling (Hewitt et al. 2022): the cutoff is min(eta, sqrt(eta) * exp(-entropy))."""

    def __init__(self, epsilon: float, min_tokens_to_keep: int = 1) -> None:
        self.epsilon = _in_range("eta_cutoff", epsilon, 0.0, 1.0, lo_open=True, hi_open=True)
        self.min_tokens_to_keep = _keep(min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        eps = torch.tensor(self.epsilon, device=scores.device)
        entropy = torch.distributions.Categorical(logits=scores).entropy()
        eta = torch.min(eps, eps.sqrt() * torch.exp(-entropy))[..., None]
        remove = _protect_top(scores, scores.softmax(dim=-1) < eta, self.min_tokens_to_keep)
        return scores.masked_fill(remove, NEG_INF)
