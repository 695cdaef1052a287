"""Classifier-free guidance (Sanchez et al. 2023, arXiv:2306.17806) as transformers' unbatched processor runs it:
a second, unconditional sequence (the negative prompt, or else the prompt's last token) goes through the model
alongside, with its own KV cache, and the scores become

    log_softmax(unconditional) + guidance_scale * (log_softmax(scores) - log_softmax(unconditional)).
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import GenerationConfigError
from ...model import ForwardBatch


class ClassifierFreeGuidance:
    def __init__(
        self,
        guidance_scale: float,
        model: Any,
        max_new_tokens: int,
        negative_prompt_ids: torch.Tensor | None = None,
        negative_prompt_attention_mask: torch.Tensor | None = None,
    ) -> None:
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)):
            raise GenerationConfigError(f"guidance_scale must be a number, got {guidance_scale!r}")
        ids = negative_prompt_ids
        if ids is not None and (ids.dim() != 2 or ids.dtype != torch.long):
            raise GenerationConfigError("negative_prompt_ids must be a (batch, length) int64 tensor")
        self.scale, self.model, self.max_new = float(guidance_scale), model, max_new_tokens
        self.ids, self.mask = negative_prompt_ids, negative_prompt_attention_mask
        self.cache = None
        self.tokens: torch.Tensor | None = None  # (B, N + max_new) the unconditional sequence
        self.key_valid: torch.Tensor | None = None
        self.length = 0

    def _unconditional_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.cache is None:  # first call: prefill the negative prompt (or the prompt's last token)
            ids = (self.ids if self.ids is not None else input_ids[:, -1:]).to(input_ids.device)
            mask = torch.ones_like(ids) if self.mask is None else self.mask.to(ids.device)
            B, N = ids.shape
            self.tokens = torch.zeros(B, N + self.max_new, dtype=torch.long, device=ids.device)
            self.tokens[:, :N] = ids
            self.key_valid = torch.ones_like(self.tokens, dtype=torch.bool)
            self.key_valid[:, :N] = mask.bool()
            self.cache = self.model.new_cache(B, N + self.max_new)
            positions = (self.key_valid[:, :N].long().cumsum(1) - 1).clamp(min=0)  # (B, N)
            write = torch.arange(N, device=ids.device).expand(B, N)
            start, self.length = 0, N
        else:
            col = self.length
            self.tokens[:, col] = input_ids[:, -1]
            positions = self.key_valid[:, :col].sum(dim=1, keepdim=True)  # (B, 1) real tokens so far
            write = torch.full_like(positions, col)
            start, self.length = col, col + 1
        window = getattr(self.model.config, "sliding_window", None)
        batch = ForwardBatch.build(positions, write, self.key_valid, self.length, window, write_start=start)
        return self.model(self.tokens[:, start : self.length], batch, self.cache).float()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.log_softmax(dim=-1)
        if self.scale == 1:
            return scores
        uncond = self._unconditional_logits(input_ids).log_softmax(dim=-1)
        return self.scale * (scores - uncond) + uncond
