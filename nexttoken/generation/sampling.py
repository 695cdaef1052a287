"""Choosing the next token from processed scores: argmax, or a draw from the caller's own generator."""

from __future__ import annotations

from typing import Callable

import torch

from ..model import kernels
from .config import GenerationConfig
from .processors.llamacpp import MirostatV2


class Sampler:
    """Greedy or multinomial choice over (B, V) scores. The generator is owned here, seeded once per call."""

    def __init__(self, greedy: bool, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.greedy = greedy
        self.generator: torch.Generator | None = None
        if not greedy:
            self.generator = torch.Generator(device=device)
            if seed is None:
                self.generator.seed()  # fresh entropy: unseeded calls differ, as users expect
            else:
                self.generator.manual_seed(seed)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """(B, V) float scores -> (B,) token ids."""
        if self.greedy:
            return kernels.argmax(scores)  # torch.argmax's answer, without its ~30 us per step on a large vocabulary
        probs = scores.softmax(dim=-1)
        # torch.multinomial with a generator seeded like torch.manual_seed(s) draws what transformers draws.
        return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)


def make_sampler(cfg: GenerationConfig, device: torch.device | str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Mirostat v2 when asked (it samples itself), else argmax or a draw from the request's own generator."""
    if cfg.mirostat_tau is not None and not cfg.greedy:
        return MirostatV2(cfg.mirostat_tau, cfg.mirostat_eta, cfg.seed, device)
    return Sampler(cfg.greedy, cfg.seed, device)
