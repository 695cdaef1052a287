"""Speculative decoding's pure parts: proposing draft tokens by prompt lookup, the draft-length schedule, and the
rejection rule that keeps the output distribution the target's.

A step drafts k tokens cheaply, runs the target once over the last token and the k drafts (k + 1 positions), and
keeps the drafts the target agrees with, plus one token of its own. Greedy: a draft is kept while it equals the
target's argmax at its position, and the target's token replaces the first that does not, so the output is the
target's greedy output exactly (the engine's verification computes each position's numbers as a single step
would). Sampling: Leviathan et al. 2023 / Chen et al. 2023 (`accept_or_resample`): the kept tokens are
distributed as the target's processed distribution whatever the draft proposes.

The draft model proposer needs a KV cache, so it lives in the engine (engine/speculation.py); this module has
what is a function of token ids and probabilities alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch



def prompt_lookup(ids: list[int], num_tokens: int, max_ngram: int) -> list[int]:
    """Up to `num_tokens` ids that followed the earliest earlier occurrence of the sequence's last n-gram, trying
    n = max_ngram down to 1 (transformers' PromptLookupCandidateGenerator). [] when nothing matches."""
    n_ids = len(ids)
    for n in range(min(max_ngram, n_ids - 1), 0, -1):
        tail = ids[n_ids - n:]
        for start in range(0, n_ids - n):  # windows ids[start:start+n], the tail's own excluded
            if ids[start : start + n] == tail:
                follow = ids[start + n : start + n + num_tokens]
                if follow:
                    return follow
    return []


@dataclass
class DraftLength:
    """How many tokens to draft next: transformers' num_assistant_tokens with its schedule. "heuristic" adds 2
    after a step that kept every draft and takes 1 away (down to 1) after one that did not."""

    num_tokens: int
    schedule: str = "constant"

    def update(self, drafted: int, accepted: int) -> None:
        if self.schedule != "heuristic" or drafted == 0:
            return
        self.num_tokens = self.num_tokens + 2 if accepted == drafted else max(1, self.num_tokens - 1)


def accept_or_resample(p: torch.Tensor, q: torch.Tensor | None, draft: int,
                       generator: torch.Generator | None) -> tuple[int, bool]:
    """The rejection rule for one drafted position. p: (V,) the target's processed probabilities there; q: (V,)
    the draft's (None: the draft was chosen deterministically, q one-hot at `draft`, as prompt lookup's are).

    Keep `draft` with probability min(1, p[draft] / q[draft]); otherwise draw from max(p - q, 0), normalised.
    The token returned is then distributed as p exactly. Returns (token, kept)."""
    q_draft = 1.0 if q is None else float(q[draft])
    p_draft = float(p[draft])
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if q_draft > 0 and u * q_draft < p_draft:  # u < p/q without dividing (p/q may exceed 1)
        return draft, True
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    total = float(residual.sum())
    if total <= 0.0:  # p == q up to rounding: the residual is empty, and p itself is the exact choice
        residual, total = p, float(p.sum())
    return int(torch.multinomial(residual / total, 1, generator=generator)), False
