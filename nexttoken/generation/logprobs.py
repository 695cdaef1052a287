"""Log-probabilities of generated tokens: per-token values with the top-N alternatives, and transformers'
`compute_transition_scores` (the per-step score of each chosen token, following beams back through
`beam_indices`).
"""

from __future__ import annotations

from typing import Sequence

import torch


class LogprobCollector:
    """Chosen-token log-probs (and, when top_n > 0, the best N with their ids), one step at a time, so no step's
    (B, V) logits outlive it: holding every step's logits would cost steps x B x V floats (0.5 MB per row and
    step for a 128k vocabulary)."""

    def __init__(self, top_n: int = 0) -> None:
        self.top_n = top_n
        self.picked: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, chosen: torch.Tensor) -> None:
        """(B, V) raw logits of a step and the (B,) ids chosen at it."""
        logp = logits.float().log_softmax(dim=-1)  # (B, V)
        self.picked.append(logp.gather(1, chosen[:, None]).squeeze(1))
        if self.top_n > 0:
            top = logp.topk(min(self.top_n, logp.shape[-1]), dim=-1)
            self.values.append(top.values)
            self.ids.append(top.indices)

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(B, T) chosen log-probs; (B, T, N) best log-probs and their ids (sorted, best first) or None, None."""
        out = torch.stack(self.picked, dim=1)
        if self.top_n <= 0:
            return out, None, None
        return out, torch.stack(self.values, dim=1), torch.stack(self.ids, dim=1)


def compute_transition_scores(
    sequences: torch.Tensor,
    scores: Sequence[torch.Tensor],
    beam_indices: torch.Tensor | None = None,
    normalize_logits: bool = False,
) -> torch.Tensor:
    """transformers' `compute_transition_scores`: (B*n, new) score of each generated token at its step.

    `scores` are the per-step (rows, V) scores of the output (`output_scores=True`); for beam outputs pass
    `beam_indices`, which says which row of each step's scores produced the token. Steps after a beam finished
    score 0. With beam search and normalize_logits=False, summing a row and dividing by
    len ** length_penalty gives `sequences_scores`.
    """
    vocab = scores[0].shape[-1]
    if beam_indices is None:
        beam_indices = torch.arange(scores[0].shape[0], device=sequences.device).view(-1, 1).expand(-1, len(scores))
    stacked = torch.stack(scores).reshape(len(scores), -1).transpose(0, 1)  # (rows * V, steps)
    if normalize_logits:
        stacked = stacked.reshape(-1, vocab, stacked.shape[-1]).log_softmax(dim=1).reshape(-1, stacked.shape[-1])
    finished = beam_indices < 0
    longest = int((~finished).sum(-1).max())
    rows = beam_indices[:, :longest].clone()
    finished = finished[:, :longest]
    rows[finished] = 0
    index = sequences[:, sequences.shape[-1] - longest :] + rows * vocab
    out = stacked.gather(0, index.to(stacked.device))
    out[finished] = 0
    return out
