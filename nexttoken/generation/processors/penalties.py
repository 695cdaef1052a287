"""Penalties on tokens already seen: transformers' repetition / n-gram / sequence-bias processors and OpenAI's
presence, frequency and logit_bias.

Every processor is a pure `(input_ids (B, L), scores (B, V)) -> scores`: arguments are checked in the
constructor (GenerationConfigError naming the bad value), the input tensors are never written.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from ...errors import GenerationConfigError
from ..values import parse_logit_bias, parse_sequence_bias

NEG_INF = -math.inf


def _positive_number(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
        raise GenerationConfigError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


def _int_at_least(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise GenerationConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
    return v


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Repeat a per-prompt tensor (B, ...) for B*n rows (beams / return sequences are interleaved per prompt)."""
    return t if t.shape[0] == rows else t.repeat_interleave(rows // t.shape[0], dim=0)


def _token_counts(input_ids: torch.Tensor, vocab: int, start: int = 0) -> torch.Tensor:
    """(B, V) how often each id occurs in columns >= start (ids >= vocab are ignored)."""
    ids = input_ids[:, start:].clamp(max=vocab)
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


class RepetitionPenalty:
    """Divide positive (multiply negative) scores of tokens already in the sequence by `penalty` (CTRL paper).

    `ignore_before` (B,) skips each row's first columns: the left padding, whose pad id is no real token.
    """

    def __init__(self, penalty: float, ignore_before: torch.Tensor | None = None) -> None:
        self.penalty = _positive_number("repetition_penalty", penalty)
        self.ignore_before = ignore_before

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        if self.ignore_before is not None:
            cols = torch.arange(input_ids.shape[1], device=input_ids.device)
            ignore = _rows(self.ignore_before.to(input_ids.device), input_ids.shape[0])
            # Ignored columns point at an extra, discarded vocabulary slot.
            input_ids = input_ids.masked_fill(cols < ignore[:, None], vocab)
        seen = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
        seen.scatter_(1, input_ids.clamp(max=vocab), True)
        penalized = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(seen[:, :vocab], penalized, scores)


class EncoderRepetitionPenalty:
    """transformers' `encoder_repetition_penalty`: tokens of the prompt are *favoured* by `penalty` (> 1)."""

    def __init__(self, penalty: float, prompt_ids: torch.Tensor) -> None:
        self.penalty = 1 / _positive_number("encoder_repetition_penalty", penalty)
        self.prompt_ids = prompt_ids  # (B, P)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = _rows(self.prompt_ids.to(scores.device), scores.shape[0])
        score = scores.gather(1, ids)
        score = torch.where(score < 0, score * self.penalty, score / self.penalty)
        return scores.scatter(1, ids, score)


class PresencePenalty:
    """OpenAI `presence_penalty`: subtract `penalty` once from every token generated so far (prompt excluded).

    OpenAI's definition: mu[j] -= alpha_presence * float(c[j] > 0), c[j] = times j was sampled before
    (platform.openai.com/docs/advanced-usage, "frequency and presence penalties").
    """

    def __init__(self, penalty: float, prompt_length: int) -> None:
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not -2.0 <= penalty <= 2.0:
            raise GenerationConfigError(f"presence_penalty must be a number in [-2, 2], got {penalty!r}")
        self.penalty = float(penalty)
        self.prompt_length = _int_at_least("prompt_length", prompt_length, 0)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = _token_counts(input_ids, scores.shape[-1], self.prompt_length)
        return scores - self.penalty * (counts > 0).to(scores.dtype)


class FrequencyPenalty:
    """OpenAI `frequency_penalty`: subtract `penalty` times the count of each token generated so far."""

    def __init__(self, penalty: float, prompt_length: int) -> None:
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not -2.0 <= penalty <= 2.0:
            raise GenerationConfigError(f"frequency_penalty must be a number in [-2, 2], got {penalty!r}")
        self.penalty = float(penalty)
        self.prompt_length = _int_at_least("prompt_length", prompt_length, 0)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = _token_counts(input_ids, scores.shape[-1], self.prompt_length)
        return scores - self.penalty * counts.to(scores.dtype)


class LogitBias:
    """OpenAI `logit_bias`: add a fixed bias to chosen tokens' logits (-100 bans, +100 forces in practice)."""

    def __init__(self, bias: Mapping[Any, Any]) -> None:
        self.bias = parse_logit_bias(bias)
        self.ids = torch.tensor(list(self.bias), dtype=torch.long)
        self.values = torch.tensor(list(self.bias.values()), dtype=torch.float32)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.bias and int(self.ids.max()) >= scores.shape[-1]:
            raise GenerationConfigError(
                f"logit_bias names token {int(self.ids.max())} but the vocabulary has {scores.shape[-1]} tokens"
            )
        add = torch.zeros(scores.shape[-1], dtype=scores.dtype, device=scores.device)
        add[self.ids.to(scores.device)] = self.values.to(scores.device, scores.dtype)
        return scores + add


class SequenceBias:
    """transformers' `sequence_bias`: add a bias to the last token of a sequence when the rest was just generated.

    `sequence_bias` is {tuple of ids: bias} or [[ids, bias], ...]; a one-token sequence is biased always.
    """

    def __init__(self, sequence_bias: Any) -> None:
        self.bias = parse_sequence_bias(sequence_bias)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        bad = [t for seq in self.bias for t in seq if t >= vocab]
        if bad:
            raise GenerationConfigError(f"sequence_bias names tokens {bad} outside the vocabulary (size {vocab})")
        bias = torch.zeros_like(scores)
        for seq, value in self.bias.items():
            prefix = seq[:-1]
            if len(prefix) > input_ids.shape[1]:
                continue  # the context is shorter than the prefix: it cannot match yet
            if prefix:
                want = torch.tensor(prefix, device=input_ids.device)
                match = (input_ids[:, -len(prefix):] == want).all(dim=1)  # (B,)
            else:
                match = torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device)
            bias[:, seq[-1]] += torch.where(match, value, 0.0).to(bias.dtype)
        return scores + bias


class NoBadWords(SequenceBias):
    """transformers' `bad_words_ids`: ban each listed sequence's last token when the rest was just generated.

    A bad word that is exactly one EOS id is dropped, as transformers does (banning EOS is min_length's job).
    """

    def __init__(self, bad_words_ids: Sequence[Sequence[int]], eos_ids: Sequence[int] = ()) -> None:
        is_id = lambda t: isinstance(t, int) and not isinstance(t, bool) and t >= 0  # noqa: E731
        if not isinstance(bad_words_ids, (list, tuple)) or not bad_words_ids or not all(
            isinstance(w, (list, tuple)) and w and all(is_id(t) for t in w) for w in bad_words_ids
        ):
            raise GenerationConfigError(
                f"bad_words_ids must be a non-empty list of non-empty lists of token ids, got {bad_words_ids!r}"
            )
        words = [list(w) for w in bad_words_ids if not (len(w) == 1 and w[0] in set(eos_ids))]
        self.bias = {tuple(w): NEG_INF for w in words}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return super().__call__(input_ids, scores) if self.bias else scores


def _banned_by_ngrams(history: list[int], context: list[int], n: int) -> list[int]:
    """Tokens t such that context[-(n-1):] + [t] is an n-gram of history."""
    if len(context) < n - 1:
        return []
    prefix = tuple(context[len(context) - (n - 1):]) if n > 1 else ()
    return [history[i + n - 1] for i in range(len(history) - n + 1) if tuple(history[i : i + n - 1]) == prefix]


class NoRepeatNGram:
    """transformers' `no_repeat_ngram_size`: never complete an n-gram that already occurs in the sequence."""

    def __init__(self, ngram_size: int) -> None:
        self.n = _int_at_least("no_repeat_ngram_size", ngram_size, 1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] < self.n:  # transformers: nothing is banned before the first full n-gram
            return scores
        banned = torch.zeros_like(scores, dtype=torch.bool)
        for row, ids in enumerate(input_ids.tolist()):
            for t in _banned_by_ngrams(ids, ids, self.n):
                banned[row, t] = True
        return scores.masked_fill(banned, NEG_INF)


class EncoderNoRepeatNGram:
    """transformers' `encoder_no_repeat_ngram_size`: never complete an n-gram that occurs in the prompt."""

    def __init__(self, ngram_size: int, prompt_ids: torch.Tensor) -> None:
        self.n = _int_at_least("encoder_no_repeat_ngram_size", ngram_size, 1)
        self.prompts = prompt_ids.tolist()  # (B, P) as lists: the n-gram tables are built on demand

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        per_prompt = scores.shape[0] // len(self.prompts)
        banned = torch.zeros_like(scores, dtype=torch.bool)
        for row, ids in enumerate(input_ids.tolist()):
            for t in _banned_by_ngrams(self.prompts[row // per_prompt], ids, self.n):
                banned[row, t] = True
        return scores.masked_fill(banned, NEG_INF)
