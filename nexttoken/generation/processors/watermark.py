"""Green-list watermarking (Kirchenbauer et al. 2023, arXiv:2301.10226) exactly as transformers seeds it, so
text watermarked by either library is detected by both; and the detector that returns a z-score.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

import torch

from ...errors import GenerationConfigError
from ..values import WatermarkingConfig

TABLE_SIZE = 1_000_003  # transformers' fixed hashing table size


class Watermark:
    """Add `bias` to a pseudo-random green list of `greenlist_ratio * vocab` tokens seeded by the context."""

    def __init__(self, vocab_size: int, config: WatermarkingConfig | Mapping[str, Any] = WatermarkingConfig()) -> None:
        self.cfg = WatermarkingConfig.from_any(config)
        self.vocab_size = vocab_size
        self.greenlist_size = int(vocab_size * self.cfg.greenlist_ratio)
        self.rng = torch.Generator().manual_seed(self.cfg.hashing_key)
        self.fixed_table = torch.randperm(TABLE_SIZE, generator=self.rng)

    def greenlist(self, context: torch.Tensor) -> torch.Tensor:
        """The green ids after `context` (1-D ids); reseeds the generator from its last `context_width` ids."""
        tail = context[-self.cfg.context_width :].cpu()
        if self.cfg.seeding_scheme == "selfhash":
            a = self.fixed_table[tail % TABLE_SIZE] + 1
            b = self.fixed_table[tail[-1] % TABLE_SIZE] + 1
            seed = int((self.cfg.hashing_key * a * b).min())
        else:
            seed = self.cfg.hashing_key * int(tail[-1])
        self.rng.manual_seed(seed % (2**64 - 1))
        return torch.randperm(self.vocab_size, generator=self.rng)[: self.greenlist_size]

    def _selfhash_greenlist(self, context: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        best = scores.argsort(descending=True)[:40].cpu()
        keep = [t for t in best if t in self.greenlist(torch.cat([context.cpu(), t[None]]))]
        return torch.tensor(keep, dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] < self.cfg.context_width:
            return scores
        bias = torch.zeros_like(scores)
        for row in range(input_ids.shape[0]):
            if self.cfg.seeding_scheme == "selfhash":
                green = self._selfhash_greenlist(input_ids[row], scores[row])
            else:
                green = self.greenlist(input_ids[row])
            bias[row, green.to(scores.device)] = self.cfg.bias
        return scores + bias


@dataclass
class WatermarkDetection:
    num_tokens_scored: list[int]
    num_green_tokens: list[int]
    z_score: list[float]
    p_value: list[float]
    prediction: list[bool]


class WatermarkDetector:
    """Count green tokens in generated ids and turn the count into a z-score (one-proportion z-test)."""

    def __init__(
        self, vocab_size: int, config: WatermarkingConfig | Mapping[str, Any] = WatermarkingConfig(),
        bos_token_id: int | None = None, ignore_repeated_ngrams: bool = False,
    ) -> None:
        self.watermark = Watermark(vocab_size, config)
        self.bos_token_id, self.ignore_repeated = bos_token_id, ignore_repeated_ngrams
        self._is_green = lru_cache(maxsize=4096)(self._green)

    def _green(self, ngram: tuple[int, ...]) -> bool:
        selfhash = self.watermark.cfg.seeding_scheme == "selfhash"
        prefix = torch.tensor(ngram if selfhash else ngram[:-1])
        return bool((self.watermark.greenlist(prefix) == ngram[-1]).any())

    def __call__(self, input_ids: torch.Tensor, z_threshold: float = 3.0) -> WatermarkDetection:
        """`input_ids` (B, L): generated ids (better without the prompt)."""
        if self.bos_token_id is not None and int(input_ids[0, 0]) == self.bos_token_id:
            input_ids = input_ids[:, 1:]
        cfg = self.watermark.cfg
        n = cfg.context_width + 1 - int(cfg.seeding_scheme == "selfhash")
        if input_ids.shape[-1] - cfg.context_width < 1:
            raise GenerationConfigError(f"need at least {cfg.context_width + 1} tokens to score a watermark")
        out = WatermarkDetection([], [], [], [], [])
        gamma = cfg.greenlist_ratio
        for ids in input_ids.tolist():
            counts = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
            if self.ignore_repeated:
                total, green = len(counts), sum(self._is_green(g) for g in counts)
            else:
                total, green = sum(counts.values()), sum(c * self._is_green(g) for g, c in counts.items())
            z = (green - gamma * total) / math.sqrt(total * gamma * (1 - gamma))
            out.num_tokens_scored.append(total)
            out.num_green_tokens.append(green)
            out.z_score.append(z)
            out.p_value.append(0.5 * math.erfc(z / math.sqrt(2)))
            out.prediction.append(z > z_threshold)
        return out
