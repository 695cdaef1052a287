"""Which decoding strategy a GenerationConfig asks for, decided once at the edge (transformers' flag rules).

`generate` looks the mode up in its table of runners; no loop inspects the flags again.
"""

from __future__ import annotations

from enum import Enum

from ..errors import GenerationConfigError
from .config import GenerationConfig


class GenerationMode(str, Enum):
    GREEDY = "greedy"
    SAMPLE = "sample"
    BEAM_SEARCH = "beam_search"
    BEAM_SAMPLE = "beam_sample"
    GROUP_BEAM_SEARCH = "group_beam_search"
    CONTRASTIVE_SEARCH = "contrastive_search"


def generation_mode(cfg: GenerationConfig) -> GenerationMode:
    """The strategy for these options; contradictory combinations raise GenerationConfigError."""
    if cfg.num_beams > 1:
        if cfg.num_return_sequences > cfg.num_beams:
            raise GenerationConfigError(
                f"num_return_sequences={cfg.num_return_sequences} is more than num_beams={cfg.num_beams}: "
                "beam search returns at most num_beams sequences per prompt"
            )
        if cfg.num_beam_groups > 1:
            if cfg.num_beams % cfg.num_beam_groups:
                raise GenerationConfigError(
                    f"num_beams={cfg.num_beams} must be divisible by num_beam_groups={cfg.num_beam_groups}"
                )
            if not cfg.greedy:
                raise GenerationConfigError("diverse (group) beam search does not sample: set do_sample=False")
            return GenerationMode.GROUP_BEAM_SEARCH
        return GenerationMode.BEAM_SEARCH if cfg.greedy else GenerationMode.BEAM_SAMPLE
    if cfg.num_beam_groups > 1:
        raise GenerationConfigError("num_beam_groups > 1 needs num_beams > 1 (a multiple of the groups)")
    if cfg.penalty_alpha is not None and cfg.penalty_alpha > 0 and cfg.greedy:
        if not cfg.top_k or cfg.top_k < 2:
            raise GenerationConfigError(f"contrastive search (penalty_alpha) needs top_k >= 2, got {cfg.top_k!r}")
        mode = GenerationMode.CONTRASTIVE_SEARCH
    else:
        mode = GenerationMode.GREEDY if cfg.greedy else GenerationMode.SAMPLE
    if cfg.num_return_sequences > 1 and mode is not GenerationMode.SAMPLE:
        raise GenerationConfigError(
            f"num_return_sequences={cfg.num_return_sequences} needs sampling (do_sample=True) or beam search "
            "(num_beams >= num_return_sequences): greedy decoding would return copies"
        )
    return mode

