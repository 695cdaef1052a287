"""Beam search and beam sampling, with transformers' (v4.50+) vectorized bookkeeping so that sequences,
sequences_scores and beam_indices come out identical.

Per prompt: `num_beams` running beams and `num_beams` finished hypotheses, all in fixed-size tensors. Each step
keeps the best (or sampled) K = max(2, 1 + #EOS) * num_beams continuations, so that num_beams of them are still
running even when the best ones all end; finished ones enter the hypotheses with score / len ** length_penalty.
The KV cache follows the running beams with `KVCache.reorder` on the generated columns only: the beams of a
prompt share its prompt columns, so those are never copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...model import Transformer
from ..config import GenerationConfig
from ..decode import DecodePlan, DecodeState, forward_last, prefill
from ..outputs import GenerateOutput

BIG = 1.0e9  # transformers' "very large" score offset; kept identical so ties break the same way


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t (B, N, ...) indexed along dim 1 by idx (B, K) -> (B, K, ...)."""
    while idx.dim() < t.dim():
        idx = idx.unsqueeze(-1)
    return torch.take_along_dim(t, idx, dim=1)


@dataclass
class BeamBook:
    """The running beams and finished hypotheses of B prompts (or B groups) with `beams` beams each."""

    running: torch.Tensor  # (B, beams, max_len) ids
    running_scores: torch.Tensor  # (B, beams) summed log-probs
    running_indices: torch.Tensor  # (B, beams, max_new) flat row each token came from, -1 unset
    sequences: torch.Tensor  # (B, beams, max_len) finished hypotheses
    scores: torch.Tensor  # (B, beams) their length-penalized scores (-1e9: empty slot)
    indices: torch.Tensor  # (B, beams, max_new)
    is_finished: torch.Tensor  # (B, beams) bool: slot holds a finished hypothesis
    improvable: torch.Tensor  # (B, 1) bool: a running beam may still beat the worst finished one
    hits: torch.Tensor  # (B, beams) bool: the last kept continuations hit a stopping criterion
    prompt_len: int
    row_offset: torch.Tensor  # (B, 1) flat row of each prompt's first beam

    @classmethod
    def start(cls, prompts: torch.Tensor, beams: int, max_len: int, fill: int, row_offset: torch.Tensor) -> "BeamBook":
        """prompts (B, P): every beam starts as its prompt; only beam 0 is live at first (the others -1e9)."""
        B, P = prompts.shape
        dev = prompts.device
        running = torch.full((B, beams, max_len), fill, dtype=torch.long, device=dev)
        running[:, :, :P] = prompts[:, None]
        scores = torch.zeros(B, beams, device=dev)
        scores[:, 1:] = -BIG
        indices = torch.full((B, beams, max_len - P), -1, dtype=torch.long, device=dev)
        return cls(
            running, scores, indices, running.clone(), torch.full((B, beams), -BIG, device=dev), indices.clone(),
            torch.zeros(B, beams, dtype=torch.bool, device=dev), torch.ones(B, 1, dtype=torch.bool, device=dev),
            torch.zeros(B, beams, dtype=torch.bool, device=dev), P, row_offset,
        )

    @property
    def beams(self) -> int:
        return self.running.shape[1]

    def step(
        self,
        log_probs: torch.Tensor,
        cur_len: int,
        stop: Callable[[torch.Tensor], torch.Tensor],
        cfg: GenerationConfig,
        keep: int,
        generator: torch.Generator | None,
    ) -> None:
        """One beam step from processed log-probs (B, beams, V); `stop(ids (N, cur_len + 1)) -> (N,)` bool."""
        B, nb, V = log_probs.shape
        acc = (log_probs + self.running_scores[:, :, None]).reshape(B, nb * V)
        # c. the top K continuations over all beams (or K sampled without replacement)
        if generator is not None:
            top_idx = torch.multinomial(acc.softmax(dim=-1), keep, generator=generator)
            # ordered best first, as top-k's are (transformers >= 5.24): the finished and running beams kept below
            # are then the best of the sample, not its first draws
            top_lp, order = acc.gather(1, top_idx).sort(dim=-1, descending=True)
            top_idx = top_idx.gather(1, order)
        else:
            top_lp, top_idx = acc.topk(keep)
        parent = top_idx // V
        top_running = _gather(self.running, parent)
        top_running[:, :, cur_len] = top_idx % V
        top_indices = _gather(self.running_indices, parent)
        top_indices[:, :, cur_len - self.prompt_len] = parent + self.row_offset
        # d. which continuations are done
        hits = stop(top_running[:, :, : cur_len + 1].reshape(B * keep, -1)).view(B, keep)
        # e. the best num_beams continuations that are not done keep running
        live_lp = top_lp + hits.float() * -BIG
        nxt = live_lp.topk(nb).indices
        self.running, self.running_scores = _gather(top_running, nxt), _gather(live_lp, nxt)
        self.running_indices = _gather(top_indices, nxt)
        # f. done continuations among the first num_beams join the hypotheses if they score better
        first = torch.zeros(keep, dtype=torch.bool, device=hits.device)
        first[:nb] = True
        just_done = hits & first
        cand = top_lp / ((cur_len + 1 - self.prompt_len) ** cfg.length_penalty)
        full = self.is_finished.all(dim=-1, keepdim=True) & (cfg.early_stopping is True)
        cand = cand + full.float() * -BIG + (~self.improvable).float() * -BIG + (~just_done).float() * -BIG
        merged = torch.cat([self.scores, cand], dim=1)
        best = merged.topk(nb).indices
        self.sequences = _gather(torch.cat([self.sequences, top_running], dim=1), best)
        self.scores = _gather(merged, best)
        self.indices = _gather(torch.cat([self.indices, top_indices], dim=1), best)
        self.is_finished = _gather(torch.cat([self.is_finished, just_done], dim=1), best)
        self.hits = hits
        self._update_improvable(cur_len + 1, cfg)

    def _update_improvable(self, cur_len: int, cfg: GenerationConfig) -> None:
        """transformers' early-stop heuristic: can the best running beam still beat the worst hypothesis?"""
        max_len = self.running.shape[2]
        if cfg.early_stopping == "never" and cfg.length_penalty > 0.0:
            length = max_len - self.prompt_len
        else:
            length = cur_len - self.prompt_len
        best_running = self.running_scores[:, :1] / (length**cfg.length_penalty)
        worst_done = torch.where(self.is_finished, self.scores.min(dim=1, keepdim=True).values, -BIG)
        self.improvable = self.improvable & (best_running > worst_done).any(dim=-1, keepdim=True)

    def done(self, cfg: GenerationConfig) -> bool:
        improvement_possible = bool(self.improvable.any())
        open_beam = not (bool(self.is_finished.all()) and cfg.early_stopping is True)
        can_continue = not bool(self.hits.all())
        return not (improvement_possible and open_beam and can_continue)

    def parents(self, cur_len: int) -> torch.Tensor:
        """(B*beams,) the flat row each running beam continues (what the KV cache must be reordered by)."""
        return self.running_indices[:, :, cur_len - self.prompt_len].reshape(-1)


def _stop_fn(plan: DecodePlan, max_len: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def stop(ids: torch.Tensor) -> torch.Tensor:
        hit = plan.stopping(ids, None)
        return hit | (ids.shape[1] >= max_len)  # MaxLength: the column just filled was the last one

    return stop


def _beam_output(book: BeamBook, cfg: GenerationConfig, recorded: dict[str, list], P: int) -> GenerateOutput:
    n = cfg.num_return_sequences
    seqs = book.sequences[:, :n].reshape(-1, book.sequences.shape[-1])
    scores = book.scores[:, :n].reshape(-1)
    indices = book.indices[:, :n].reshape(-1, book.indices.shape[-1])
    longest = int((indices >= 0).sum(dim=1).max())  # a hypothesis may end before the last step
    return GenerateOutput(
        sequences=seqs[:, : P + longest],
        scores=tuple(recorded["scores"]) if cfg.output_scores else None,
        logits=tuple(recorded["logits"]) if cfg.output_logits else None,
        finished=torch.ones(seqs.shape[0], dtype=torch.bool, device=seqs.device),
        sequences_scores=scores if cfg.output_scores else None,
        beam_indices=indices[:, :longest],
    )


@torch.inference_mode()
def beam_search(model: Transformer, plan: DecodePlan, cfg: GenerationConfig, streamer: Any = None) -> GenerateOutput:
    """Beam search (do_sample=False) or beam sampling (do_sample=True) over plan.input_ids (B*num_beams, P)."""
    nb = cfg.num_beams
    rows, P = plan.input_ids.shape
    B = rows // nb
    max_len = P + plan.max_new_tokens
    state = DecodeState.start(plan, model)
    window = model.config.sliding_window
    offsets = torch.arange(B, device=plan.input_ids.device)[:, None] * nb
    book = BeamBook.start(plan.input_ids[::nb], nb, max_len, plan.pad_token_id, offsets)
    keep = max(2, 1 + len(cfg.eos_ids)) * nb
    generator = getattr(plan.sampler, "generator", None) if not cfg.greedy else None
    recorded: dict[str, list] = {"scores": [], "logits": []}
    stop = _stop_fn(plan, max_len)
    logits = prefill(model, state, plan, window)
    for cur_len in range(P, max_len):
        flat = book.running[:, :, :cur_len].reshape(rows, cur_len)
        log_probs = plan.processors(flat, logits.log_softmax(dim=-1))  # (B*nb, V)
        recorded["scores"].append(log_probs)
        recorded["logits"].append(logits)
        book.step(log_probs.view(B, nb, -1), cur_len, stop, cfg, keep, generator)
        state.cache.reorder(book.parents(cur_len), P, cur_len)  # generated columns follow their beams
        if book.done(cfg):
            break
        state.tokens[:, cur_len] = book.running[:, :, cur_len].reshape(rows)
        state.length = cur_len + 1
        logits = forward_last(model, state, plan, window)
    return _beam_output(book, cfg, recorded, P)
