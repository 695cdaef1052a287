"""Diverse (group) beam search (Vijayakumar et al. 2016, arXiv:1610.02424), which transformers moved out of its
core: `num_beams` beams split into `num_beam_groups` groups that step one after the other; a group's log-probs
lose `diversity_penalty` times the number of times each token was chosen by the earlier groups at this step
(Hamming diversity, transformers 4.x `HammingDiversityLogitsProcessor`). Each group keeps its own beams and
hypotheses with the same bookkeeping as beam.py; at the end the hypotheses of all groups are ranked together.
"""

from __future__ import annotations

from typing import Any

import torch

from ...model import Transformer
from .beam import BeamBook, _stop_fn
from ..config import GenerationConfig
from ..decode import DecodePlan, DecodeState, forward_last, prefill
from ..outputs import GenerateOutput


def hamming_penalty(earlier: torch.Tensor, vocab: int, penalty: float) -> torch.Tensor:
    """earlier (B, n) tokens chosen by the previous groups -> (B, V) penalty = penalty * count."""
    counts = torch.zeros(earlier.shape[0], vocab, device=earlier.device)
    if earlier.shape[1]:
        counts.scatter_add_(1, earlier, torch.ones_like(earlier, dtype=torch.float32))
    return penalty * counts


@torch.inference_mode()
def group_beam_search(
    model: Transformer, plan: DecodePlan, cfg: GenerationConfig, streamer: Any = None
) -> GenerateOutput:
    nb, G = cfg.num_beams, cfg.num_beam_groups
    gs = nb // G
    rows, P = plan.input_ids.shape
    B = rows // nb
    max_len = P + plan.max_new_tokens
    state = DecodeState.start(plan, model)
    window = model.config.sliding_window
    dev = plan.input_ids.device
    books = [
        BeamBook.start(plan.input_ids[::nb], gs, max_len, plan.pad_token_id,
                       torch.arange(B, device=dev)[:, None] * nb + g * gs)
        for g in range(G)
    ]
    keep = max(2, 1 + len(cfg.eos_ids)) * gs
    stop = _stop_fn(plan, max_len)
    group_rows = torch.arange(rows, device=dev).view(B, G, gs)  # (B, G, gs) flat row of each beam
    scores_out, logits_out = [], []
    logits = prefill(model, state, plan, window)
    for cur_len in range(P, max_len):
        step_scores = torch.empty_like(logits)
        chosen = torch.empty(B, 0, dtype=torch.long, device=dev)  # this step's tokens of the groups done so far
        for g, book in enumerate(books):
            idx = group_rows[:, g].reshape(-1)
            ids = book.running[:, :, :cur_len].reshape(B * gs, cur_len)
            lp = logits[idx].log_softmax(dim=-1)
            if cfg.diversity_penalty:
                lp = lp - hamming_penalty(chosen, lp.shape[-1], cfg.diversity_penalty).repeat_interleave(gs, 0)
            lp = plan.processors(ids, lp)
            step_scores[idx] = lp
            book.step(lp.view(B, gs, -1), cur_len, stop, cfg, keep, None)
            chosen = torch.cat([chosen, book.running[:, :, cur_len]], dim=1)
        scores_out.append(step_scores)
        logits_out.append(logits)
        parents = torch.stack([b.parents(cur_len).view(B, gs) for b in books], dim=1).reshape(-1)  # (B*nb,)
        state.cache.reorder(parents, P, cur_len)
        if all(b.done(cfg) for b in books):
            break
        state.tokens[:, cur_len] = torch.stack([b.running[:, :, cur_len] for b in books], dim=1).reshape(rows)
        state.length = cur_len + 1
        logits = forward_last(model, state, plan, window)

    # Rank the hypotheses of all groups together, per prompt.
    seqs = torch.cat([b.sequences for b in books], dim=1)  # (B, nb, max_len)
    hyp_scores = torch.cat([b.scores for b in books], dim=1)
    indices = torch.cat([b.indices for b in books], dim=1)
    order = hyp_scores.argsort(dim=1, descending=True, stable=True)[:, : cfg.num_return_sequences]
    pick = lambda t: torch.take_along_dim(t, order.view(*order.shape, *([1] * (t.dim() - 2))), dim=1)  # noqa: E731
    seqs, hyp_scores, indices = pick(seqs).flatten(0, 1), pick(hyp_scores).flatten(), pick(indices).flatten(0, 1)
    longest = int((indices >= 0).sum(dim=1).max())
    return GenerateOutput(
        sequences=seqs[:, : P + longest],
        scores=tuple(scores_out) if cfg.output_scores else None,
        logits=tuple(logits_out) if cfg.output_logits else None,
        finished=torch.ones(seqs.shape[0], dtype=torch.bool, device=dev),
        sequences_scores=hyp_scores if cfg.output_scores else None,
        beam_indices=indices[:, :longest],
    )
