"""Contrastive search (Su et al. 2022, arXiv:2202.06417), which transformers moved out of its core.

Each step takes the top_k tokens of the processed distribution, runs every candidate through the model, and
picks the one maximising (1 - alpha) * p(candidate) - alpha * max cosine(h(candidate), h(context token)), with h
the last hidden state (the final norm's output). The cache holds top_k rows per prompt with identical history:
all candidates of a prompt run in one batched forward, and the winner's new column is then copied to its
siblings (one column, not the cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...errors import GenerationConfigError
from ...model import Transformer
from ..config import GenerationConfig
from ..decode import DecodePlan, DecodeState, forward_last, prefill
from ..logprobs import LogprobCollector
from ..outputs import GenerateOutput


class HiddenStates:
    """Captures the output of the model's final norm (the last hidden states) during a forward pass."""

    def __init__(self, model: Transformer) -> None:
        norm = getattr(model, "norm", None)
        if norm is None:
            raise GenerationConfigError(
                "contrastive search needs the model's final norm (model.norm) to read hidden states"
            )
        self.last: torch.Tensor | None = None
        self.handle = norm.register_forward_hook(lambda mod, args, out: setattr(self, "last", out.float()))

    def close(self) -> None:
        self.handle.remove()


def degeneration_scores(
    context: torch.Tensor, context_valid: torch.Tensor, candidates: torch.Tensor, probs: torch.Tensor, alpha: float
) -> torch.Tensor:
    """context (B, L, H), context_valid (B, L) bool, candidates (B, K, H), probs (B, K) -> (B, K) contrastive score.

    transformers 4.x `_ranking_fast`: (1 - alpha) * prob - alpha * max over valid context of cosine similarity.
    """
    ctx = context / context.norm(dim=-1, keepdim=True)
    cand = candidates / candidates.norm(dim=-1, keepdim=True)
    cosine = cand @ ctx.transpose(1, 2)  # (B, K, L)
    cosine = cosine.masked_fill(~context_valid[:, None, :], torch.finfo(cosine.dtype).min)
    return (1.0 - alpha) * probs - alpha * cosine.amax(dim=-1)


@torch.inference_mode()
def contrastive_search(
    model: Transformer, plan: DecodePlan, cfg: GenerationConfig, streamer: Any = None
) -> GenerateOutput:
    k, alpha = int(cfg.top_k), float(cfg.penalty_alpha)  # type: ignore[arg-type]
    B, P = plan.input_ids.shape
    wide = dataclasses.replace(plan, input_ids=plan.input_ids.repeat_interleave(k, 0),
                               attention_mask=plan.attention_mask.repeat_interleave(k, 0), prompt_logprobs=False)
    state = DecodeState.start(wide, model)
    window = model.config.sliding_window
    rows = torch.arange(B, device=plan.input_ids.device) * k  # (B,) first row of each prompt
    hidden = HiddenStates(model)
    try:
        # Prefill: all positions' hidden states are the first context.
        logits = prefill(model, state, wide, window, all_positions=True)[rows, -1]
        context = hidden.last[rows]  # (B, P, H)
        valid = plan.attention_mask.bool()
        unfinished = torch.ones(B, dtype=torch.bool, device=rows.device)
        tokens: list[torch.Tensor] = []
        kept_scores: list[torch.Tensor] = []
        kept_logits: list[torch.Tensor] = []
        logprobs = LogprobCollector(cfg.top_logprobs)  # step by step: no step's (B, V) logits outlive it
        for step in range(plan.max_new_tokens):
            ids = state.tokens[rows, : state.length]
            scores = plan.processors(ids, logits)
            top_p, top_ids = scores.softmax(dim=-1).topk(k, dim=-1)  # (B, K)
            state.tokens[:, state.length] = top_ids.reshape(-1)
            state.length += 1
            cand_logits = forward_last(model, state, plan, window).view(B, k, -1)
            cand_hidden = hidden.last.view(B, k, -1)
            best = degeneration_scores(context, valid, cand_hidden, top_p, alpha).argmax(dim=-1)  # (B,)
            chosen = top_ids.gather(1, best[:, None]).squeeze(1)
            chosen = torch.where(unfinished, chosen, plan.pad_token_id)
            winners = (rows + best).repeat_interleave(k)  # (B*K,) every sibling copies its prompt's winner
            state.cache.reorder(winners, state.length - 1, state.length)
            state.tokens[:, state.length - 1] = chosen.repeat_interleave(k)
            context = torch.cat([context, cand_hidden[torch.arange(B), best][:, None]], dim=1)
            valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
            finished = plan.stopping(state.tokens[rows, : state.length], scores) & unfinished
            unfinished = unfinished & ~finished
            tokens.append(chosen)
            logprobs.add(logits, chosen)
            if cfg.output_scores:
                kept_scores.append(scores)
            if cfg.output_logits:
                kept_logits.append(logits)
            logits = cand_logits[torch.arange(B), best]
            if not unfinished.any():
                break
    finally:
        hidden.close()
    new = torch.stack(tokens, dim=1)
    out = GenerateOutput(
        sequences=torch.cat([plan.input_ids, new], dim=1),
        scores=tuple(kept_scores) if cfg.output_scores else None,
        logits=tuple(kept_logits) if cfg.output_logits else None,
        finished=~unfinished,
    )
    out.logprobs, out.top_logprobs, out.top_logprob_ids = logprobs.result()
    return out
