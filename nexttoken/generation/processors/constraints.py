"""Processors that allow, forbid or force tokens by position: min length, forced BOS/EOS, suppression,
prefix constraints, the EOS length penalty, invalid-value removal and renormalization (transformers' semantics).

Lengths are those of `input_ids` as the loop passes it: the left-padded prompt width plus the new tokens, as
in transformers, so `min_length` counts the prompt and `min_new_tokens` does not.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ...errors import GenerationConfigError

NEG_INF = -math.inf


def _ids(name: str, ids: Any) -> torch.Tensor:
    ids = [ids] if isinstance(ids, int) and not isinstance(ids, bool) else ids
    is_id = lambda t: isinstance(t, int) and not isinstance(t, bool) and t >= 0  # noqa: E731
    if not isinstance(ids, (list, tuple)) or not all(is_id(t) for t in ids):
        raise GenerationConfigError(f"{name} must be a token id or a list of token ids (integers >= 0), got {ids!r}")
    return torch.tensor(list(ids), dtype=torch.long)


def _length(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise GenerationConfigError(f"{name} must be an integer >= 0, got {v!r}")
    return v


def _ban(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.isin(torch.arange(scores.shape[-1], device=scores.device), ids.to(scores.device))
    return scores.masked_fill(mask, NEG_INF)


def _force(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    forced = torch.full_like(scores, NEG_INF)
    forced[:, ids.to(scores.device)] = 0.0
    return forced


class MinLength:
    """EOS is banned while the sequence (prompt included) is shorter than `min_length`."""

    def __init__(self, min_length: int, eos_ids: Any) -> None:
        self.min_length, self.eos = _length("min_length", min_length), _ids("eos_token_id", eos_ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return _ban(scores, self.eos) if input_ids.shape[-1] < self.min_length else scores


class MinNewTokens:
    """EOS is banned until `min_new_tokens` tokens were generated after the `prompt_length` prompt columns.

    Only EOS is held back, as in transformers: a stop string can still end the generation earlier.
    """

    def __init__(self, prompt_length: int, min_new_tokens: int, eos_ids: Any) -> None:
        self.prompt_length = _length("prompt_length", prompt_length)
        self.min_new_tokens = _length("min_new_tokens", min_new_tokens)
        self.eos = _ids("eos_token_id", eos_ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids.shape[-1] - self.prompt_length
        return _ban(scores, self.eos) if generated < self.min_new_tokens else scores


class PrefixConstrained:
    """transformers' `prefix_allowed_tokens_fn(batch_id, ids) -> allowed ids`, one call per row (and beam)."""

    def __init__(self, fn: Callable[[int, torch.Tensor], Sequence[int]], num_beams: int = 1) -> None:
        if not callable(fn):
            raise GenerationConfigError(f"prefix_allowed_tokens_fn must be callable, got {fn!r}")
        self.fn, self.num_beams = fn, _length("num_beams", num_beams) or 1

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(scores, NEG_INF)
        for row in range(input_ids.shape[0]):
            allowed = list(self.fn(row // self.num_beams, input_ids[row]))
            if not allowed:
                raise GenerationConfigError(
                    f"prefix_allowed_tokens_fn returned no token for batch item {row // self.num_beams}: "
                    "the constraint cannot be satisfied"
                )
            mask[row, allowed] = 0.0
        out = scores + mask
        # A prompt whose allowed tokens all score -inf falls back to the mask alone (transformers does the same).
        dead = out.amax(dim=-1).isneginf().view(-1, self.num_beams).all(dim=-1)
        return torch.where(dead.repeat_interleave(self.num_beams)[:, None], mask, out)


class ForcedBOS:
    """Force `bos_token_id` as the first generated token when the input holds a single token."""

    def __init__(self, bos_token_id: int) -> None:
        self.bos = _ids("forced_bos_token_id", bos_token_id)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return _force(scores, self.bos) if input_ids.shape[-1] == 1 else scores


class ForcedEOS:
    """Force an EOS id as the last token, when the sequence reaches `max_length - 1`."""

    def __init__(self, max_length: int, eos_ids: Any) -> None:
        self.max_length, self.eos = _length("max_length", max_length), _ids("forced_eos_token_id", eos_ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return _force(scores, self.eos) if input_ids.shape[-1] == self.max_length - 1 else scores


class RemoveInvalidValues:
    """NaN -> 0 and +-inf -> the dtype's largest / smallest finite value, so sampling cannot fail."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        info = torch.finfo(scores.dtype)
        out = torch.where(scores != scores, 0.0, scores)
        out = torch.where(scores == math.inf, info.max, out)
        return torch.where(scores == NEG_INF, info.min, out)


class ExponentialDecayLengthPenalty:
    """Raise EOS by |score| * (factor ** (len - start) - 1) once `start` new tokens were generated."""

    def __init__(self, start_and_factor: Sequence[Any], eos_ids: Any, prompt_length: int) -> None:
        ok = isinstance(start_and_factor, (list, tuple)) and len(start_and_factor) == 2
        if not ok or not isinstance(start_and_factor[0], int) or isinstance(start_and_factor[1], bool) or not (
            isinstance(start_and_factor[1], (int, float)) and start_and_factor[1] > 0
        ):
            raise GenerationConfigError(
                f"exponential_decay_length_penalty must be (start_index: int, decay_factor: float > 0), "
                f"got {start_and_factor!r}"
            )
        self.start = start_and_factor[0] + _length("prompt_length", prompt_length)
        self.factor = float(start_and_factor[1])
        self.eos = _ids("eos_token_id", eos_ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cur = input_ids.shape[-1]
        if cur <= self.start:
            return scores
        eos = self.eos.to(scores.device)
        eos_scores = scores[:, eos]
        try:
            growth = self.factor ** (cur - self.start) - 1
        except OverflowError:  # a factor > 1 over many tokens: past float's range, EOS as high as a score goes
            growth = math.inf
        penalty = (eos_scores.abs() * growth).masked_fill(~eos_scores.isfinite(), 0.0).nan_to_num(nan=0.0)
        # Saturate at the dtype's largest finite value: an inf score would make the distribution nan.
        top = torch.finfo(scores.dtype).max
        out = scores.clone()
        out[:, eos] = (eos_scores + penalty).clamp(max=top)
        return out


class SuppressTokens:
    """Ban `suppress_tokens` at every step."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = _ids("suppress_tokens", list(tokens) if isinstance(tokens, (list, tuple)) else tokens)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return _ban(scores, self.tokens)


class SuppressTokensAtBegin:
    """Ban `begin_suppress_tokens` at the first generated position (`begin_index` = that input length)."""

    def __init__(self, tokens: Sequence[int], begin_index: int) -> None:
        self.tokens = _ids("begin_suppress_tokens", list(tokens) if isinstance(tokens, (list, tuple)) else tokens)
        self.begin_index = _length("begin_index", begin_index)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return _ban(scores, self.tokens) if input_ids.shape[-1] == self.begin_index else scores


class LogitNormalization:
    """`renormalize_logits`: log-softmax, so scores are log-probabilities again after the other processors."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.log_softmax(dim=-1)
