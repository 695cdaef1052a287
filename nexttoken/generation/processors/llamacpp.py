"""Samplers from llama.cpp that transformers lacks: DRY, XTC, top-n-sigma and mirostat v2.

Each follows its published definition; the source is cited on the class. DRY, XTC and top-n-sigma are
processors; mirostat v2 chooses the token itself (it truncates, samples and then updates its target from the
surprise of the token it drew), so it is a chooser like `Sampler`, with per-row state.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ...errors import GenerationConfigError
from ..config import DRY_BASE_LIMIT, DRY_MULTIPLIER_LIMIT

NEG_INF = -math.inf
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _number(name: str, v: Any, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and not math.isnan(v)
    ok = ok and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        raise GenerationConfigError(f"{name} must be a number {'>' if lo_open else '>='} {lo} and <= {hi}, got {v!r}")
    return float(v)


def _generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


class DRY:
    """"Don't Repeat Yourself" (p-e-w, oobabooga/text-generation-webui PR #5677; llama.cpp `dry_*` options).

    If the text ends with a sequence s (length n, containing no sequence breaker) that occurred before and was
    followed there by token t, t's logit drops by `multiplier * base ** (n - allowed_length)` when
    n >= allowed_length. n is the longest such match per t (capped at 50); `penalty_last_n` > 0 limits the
    history searched to the last tokens.
    """

    MAX_MATCH = 50

    def __init__(
        self,
        multiplier: float,
        base: float = 1.75,
        allowed_length: int = 2,
        penalty_last_n: int = 0,
        sequence_breakers: Sequence[int] = (),
    ) -> None:
        self.multiplier = _number("dry_multiplier", multiplier, 0.0, DRY_MULTIPLIER_LIMIT)
        self.base = _number("dry_base", base, 1.0, DRY_BASE_LIMIT, lo_open=True)
        if isinstance(allowed_length, bool) or not isinstance(allowed_length, int) or allowed_length < 1:
            raise GenerationConfigError(f"dry_allowed_length must be an integer >= 1, got {allowed_length!r}")
        if isinstance(penalty_last_n, bool) or not isinstance(penalty_last_n, int) or penalty_last_n < 0:
            raise GenerationConfigError(f"dry_penalty_last_n must be an integer >= 0 (0: all), got {penalty_last_n!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in sequence_breakers):
            raise GenerationConfigError(f"dry_sequence_breakers must be token ids, got {sequence_breakers!r}")
        self.allowed_length, self.last_n = allowed_length, penalty_last_n
        self.breakers = set(sequence_breakers)

    def match_lengths(self, ids: list[int]) -> dict[int, int]:
        """{token that followed an earlier occurrence of the text's suffix: longest such suffix length}."""
        if not ids or ids[-1] in self.breakers:
            return {}
        last, lengths = ids[-1], {}
        for i in range(len(ids) - 1):
            if ids[i] != last or ids[i + 1] in self.breakers:
                continue
            n = 1
            while n < self.MAX_MATCH and i - n >= 0:
                prev = ids[-(n + 1)]
                if ids[i - n] != prev or prev in self.breakers:
                    break
                n += 1
            follower = ids[i + 1]
            lengths[follower] = max(n, lengths.get(follower, 0))
        return lengths

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.multiplier == 0:
            return scores
        window = input_ids[:, -self.last_n :] if self.last_n else input_ids
        penalty = torch.zeros_like(scores)
        for row, ids in enumerate(window.tolist()):
            for token, n in self.match_lengths(ids).items():
                if n >= self.allowed_length:
                    # at most 100 * 10 ** 49: past float32's range, so clamped (a ban either way, never inf - inf)
                    penalty[row, token] = min(self.multiplier * self.base ** (n - self.allowed_length), FLOAT32_MAX)
        return scores - penalty


class XTC:
    """Exclude Top Choices (p-e-w, oobabooga/text-generation-webui PR #6335; llama.cpp `llama_sampler_xtc`).

    With probability `probability`, every token whose probability is >= `threshold` is removed except the
    least likely of them; nothing happens when fewer than two tokens reach the threshold.
    """

    def __init__(
        self, threshold: float, probability: float, seed: int | None = None, device: torch.device | str = "cpu",
        min_tokens_to_keep: int = 1,
    ) -> None:
        self.threshold = _number("xtc_threshold", threshold, 0.0, 1.0)
        self.probability = _number("xtc_probability", probability, 0.0, 1.0)
        self.min_keep = min_tokens_to_keep
        self.generator = _generator(seed, device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        draw = torch.rand(scores.shape[0], generator=self.generator, device=self.generator.device)
        active = (draw.to(scores.device) < self.probability)[:, None]  # (B, 1)
        probs = scores.softmax(dim=-1)
        above = probs >= self.threshold
        # The least likely token that still reaches the threshold survives; everything above it goes.
        floor = probs.masked_fill(~above, math.inf).amin(dim=-1, keepdim=True)
        remove = above & (probs > floor)
        enough = (above.sum(dim=-1, keepdim=True) >= 2) & ((~remove).sum(dim=-1, keepdim=True) >= self.min_keep)
        return scores.masked_fill(remove & enough & active, NEG_INF)


class TopNSigma:
    """Top-nσ (Tang et al. 2024, arXiv:2411.07641; llama.cpp `llama_sampler_top_n_sigma`): keep tokens whose
    logit is >= max - n * std, std being the population standard deviation of the finite logits."""

    def __init__(self, n: float) -> None:
        self.n = _number("top_n_sigma", n, 0.0)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        finite = scores.isfinite()
        count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
        vals = scores.masked_fill(~finite, 0.0)
        mean = vals.sum(dim=-1, keepdim=True) / count
        std = (((vals - mean) ** 2) * finite).sum(dim=-1, keepdim=True).div(count).sqrt()
        top = scores.masked_fill(~finite, NEG_INF).amax(dim=-1, keepdim=True)
        return scores.masked_fill(scores < top - self.n * std, NEG_INF)


class MirostatV2:
    """Mirostat v2 (Basu et al. 2021, arXiv:2007.14966, Alg. 2; llama.cpp `llama_sampler_mirostat_v2`).

    Per row: drop tokens whose surprise -log2 p exceeds mu (keeping at least the best), sample from the
    renormalized rest, then mu -= eta * (surprise of the drawn token under that distribution - tau).
    mu starts at 2 * tau.
    """

    def __init__(self, tau: float, eta: float, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.tau = _number("mirostat_tau", tau, 0.0, lo_open=True)
        self.eta = _number("mirostat_eta", eta, 0.0, lo_open=True)
        self.generator = _generator(seed, device)
        self.mu: torch.Tensor | None = None  # (B,) the current surprise target of each row
        self.greedy = False

    def truncate(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores restricted to tokens whose surprise is <= mu (the best token always kept)."""
        if self.mu is None:
            self.mu = torch.full((scores.shape[0],), 2 * self.tau, device=scores.device)
        surprise = -scores.log_softmax(dim=-1) / math.log(2)
        best = scores.argmax(dim=-1, keepdim=True)
        drop = (surprise > self.mu[:, None]).scatter(1, best, False)
        return scores.masked_fill(drop, NEG_INF)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """(B, V) scores -> (B,) ids; updates mu from each row's drawn token."""
        kept = self.truncate(scores)
        logp = kept.log_softmax(dim=-1)
        chosen = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(1)
        observed = -logp.gather(1, chosen[:, None]).squeeze(1) / math.log(2)
        assert self.mu is not None
        self.mu = self.mu - self.eta * (observed - self.tau)
        return chosen
