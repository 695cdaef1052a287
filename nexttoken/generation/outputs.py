"""What `generate(..., return_dict_in_generate=True)` returns, whichever strategy ran."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .decode import GenerationCache


@dataclass
class GenerateOutput:
    """What `generate(..., return_dict_in_generate=True)` returns."""

    sequences: torch.Tensor  # (B, P + new) prompts then generated ids; finished rows padded with pad_token_id
    scores: tuple[torch.Tensor, ...] | None = None  # per step (B, V): processed scores, when output_scores
    logits: tuple[torch.Tensor, ...] | None = None  # per step (B, V): raw logits, when output_logits
    finished: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))  # (B,) stopped, not cut
    sequences_scores: torch.Tensor | None = None  # (B*n,) beam modes with output_scores: length-penalized score
    beam_indices: torch.Tensor | None = None  # (B*n, new) beam modes: the flat beam row each token came from
    logprobs: torch.Tensor | None = None  # (B, new) log p of each chosen token under the model's raw distribution
    top_logprobs: torch.Tensor | None = None  # (B, new, N) when top_logprobs=N: the N best raw log-probs
    top_logprob_ids: torch.Tensor | None = None  # (B, new, N) their token ids
    prompt_logprobs: torch.Tensor | None = None  # (B, P) when prompt_logprobs: log p(prompt token | before)
    past_key_values: GenerationCache | None = None  # pass back with longer input_ids to continue
