"""Logits processors: pure functions of (input_ids (B, L), scores (B, V)) -> scores (B, V), and the one place that
orders them, `build_processors`.

The processors themselves live by concept: penalties.py (repetition, n-grams, sequence bias, OpenAI
presence/frequency/logit_bias), constraints.py (min length, forced / suppressed tokens), warpers.py (temperature
and the truncation rules), llamacpp.py (DRY, XTC, top-n-sigma, mirostat), watermark.py, guidance.py. A
processor is any callable with this signature; transformers' `LogitsProcessor` objects included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ...errors import GenerationConfigError
from ..values import WARPER_NAMES
from ..config import GenerationConfig
from .constraints import (
    ExponentialDecayLengthPenalty,
    ForcedBOS,
    ForcedEOS,
    LogitNormalization,
    MinLength,
    MinNewTokens,
    PrefixConstrained,
    RemoveInvalidValues,
    SuppressTokens,
    SuppressTokensAtBegin,
)
from .guidance import ClassifierFreeGuidance
from .llamacpp import DRY, XTC, TopNSigma
from .structured import GrammarMask, compile_for, constraint_of
from .thinking import ThinkingBudget
from .penalties import (
    EncoderNoRepeatNGram,
    EncoderRepetitionPenalty,
    FrequencyPenalty,
    LogitBias,
    NoBadWords,
    NoRepeatNGram,
    PresencePenalty,
    RepetitionPenalty,
    SequenceBias,
)
from .warpers import Epsilon, Eta, MinP, Temperature, TopH, TopK, TopP, Typical
from .watermark import Watermark

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
NEG_INF = -math.inf

__all__ = [
    "LogitsProcessor", "ProcessorChain", "ChainInputs", "build_processors", "WARPERS",
    "RepetitionPenalty", "Temperature", "TopK", "TopP", "MinP",
]


class ProcessorChain:
    """Processors applied in order; an empty chain returns the scores unchanged."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for p in self.processors:
            scores = p(input_ids, scores)
        return scores

    def __len__(self) -> int:  # an empty chain is falsy: the decode loop then skips it
        return len(self.processors)


@dataclass
class ChainInputs:
    """What some processors need besides the options: the prompt, the model (guidance), the length budget."""

    prompt_ids: torch.Tensor | None = None  # (B, P) left-padded prompts, before beams / return sequences
    padding: torch.Tensor | None = None  # (B,) left-padding length of each prompt
    max_new_tokens: int = 0
    model: Any = None  # for classifier-free guidance
    negative_prompt_ids: torch.Tensor | None = None
    negative_prompt_attention_mask: torch.Tensor | None = None
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], Sequence[int]] | None = None
    vocab_size: int | None = None  # for watermarking and grammar masks (the model's logits width)
    tokenizer: Any = None  # for structured output (a grammar is compiled against the tokens)

    @property
    def prompt_length(self) -> int:
        return 0 if self.prompt_ids is None else self.prompt_ids.shape[1]


def _derived_seed(seed: int | None) -> int | None:
    """XTC's own stream: seeded from the request's seed, but not the sampler's stream itself."""
    return None if seed is None else (seed * 6364136223846793005 + 1442695040888963407) % 2**63


Warper = Callable[[GenerationConfig, ChainInputs, int], "LogitsProcessor | None"]

# Sampling-only processors, by name, in their default order: transformers' (temperature first, so truncation
# sees the distribution that is sampled), then llama.cpp's top-n-sigma and XTC. `sampler_order` reorders them.
WARPERS: dict[str, Warper] = {
    "temperature": lambda c, x, k: Temperature(c.temperature) if c.temperature != 1.0 else None,
    "top_h": lambda c, x, k: TopH(c.top_h) if c.top_h is not None else None,
    "top_k": lambda c, x, k: TopK(c.top_k, k) if c.top_k else None,
    "top_p": lambda c, x, k: TopP(c.top_p, k) if c.top_p < 1.0 else None,
    "min_p": lambda c, x, k: MinP(c.min_p, k) if c.min_p is not None else None,
    "typical_p": lambda c, x, k: Typical(c.typical_p, k) if c.typical_p < 1.0 else None,
    "epsilon_cutoff": lambda c, x, k: Epsilon(c.epsilon_cutoff, k) if 0.0 < c.epsilon_cutoff < 1.0 else None,
    "eta_cutoff": lambda c, x, k: Eta(c.eta_cutoff, k) if 0.0 < c.eta_cutoff < 1.0 else None,
    "top_n_sigma": lambda c, x, k: TopNSigma(c.top_n_sigma) if c.top_n_sigma is not None else None,
    "xtc": lambda c, x, k: XTC(c.xtc_threshold, c.xtc_probability, _derived_seed(c.seed), min_tokens_to_keep=k)
    if c.xtc_probability > 0
    else None,
}
assert tuple(WARPERS) == WARPER_NAMES  # config.py checks sampler_order against the names, without this module


def _penalties(cfg: GenerationConfig, x: ChainInputs) -> list[LogitsProcessor]:
    """transformers' order up to the user's processors, with OpenAI's penalties and DRY after repetition_penalty."""
    chain: list[LogitsProcessor] = []
    P, eos = x.prompt_length, cfg.eos_ids
    if cfg.guidance_scale is not None and cfg.guidance_scale != 1:
        chain.append(ClassifierFreeGuidance(
            cfg.guidance_scale, x.model, x.max_new_tokens, x.negative_prompt_ids, x.negative_prompt_attention_mask
        ))
    if cfg.sequence_bias is not None:
        chain.append(SequenceBias(cfg.sequence_bias))
    if cfg.encoder_repetition_penalty != 1.0 and x.prompt_ids is not None:
        chain.append(EncoderRepetitionPenalty(cfg.encoder_repetition_penalty, x.prompt_ids))
    if cfg.repetition_penalty != 1.0:
        chain.append(RepetitionPenalty(cfg.repetition_penalty, ignore_before=x.padding))
    if cfg.presence_penalty != 0.0:
        chain.append(PresencePenalty(cfg.presence_penalty, P))
    if cfg.frequency_penalty != 0.0:
        chain.append(FrequencyPenalty(cfg.frequency_penalty, P))
    if cfg.dry_multiplier > 0.0:
        chain.append(DRY(cfg.dry_multiplier, cfg.dry_base, cfg.dry_allowed_length, cfg.dry_penalty_last_n,
                         cfg.dry_sequence_breakers or ()))
    if cfg.logit_bias:
        chain.append(LogitBias(cfg.logit_bias))
    if cfg.no_repeat_ngram_size > 0:
        chain.append(NoRepeatNGram(cfg.no_repeat_ngram_size))
    if cfg.encoder_no_repeat_ngram_size > 0 and x.prompt_ids is not None:
        chain.append(EncoderNoRepeatNGram(cfg.encoder_no_repeat_ngram_size, x.prompt_ids))
    if cfg.bad_words_ids is not None:
        chain.append(NoBadWords(cfg.bad_words_ids, eos))
    if cfg.min_length > 0 and eos:
        chain.append(MinLength(cfg.min_length, eos))
    banned = sorted(set(eos) | set(cfg.stop_token_ids or ()))  # every id that would end the sequence
    if cfg.min_new_tokens and banned:
        chain.append(MinNewTokens(P, cfg.min_new_tokens, banned))
    if x.prefix_allowed_tokens_fn is not None:
        chain.append(PrefixConstrained(x.prefix_allowed_tokens_fn, cfg.num_beams))
    if cfg.forced_bos_token_id is not None:
        chain.append(ForcedBOS(cfg.forced_bos_token_id))
    if cfg.forced_eos_token_id is not None:
        chain.append(ForcedEOS(P + x.max_new_tokens, cfg.forced_eos_token_id))
    if cfg.remove_invalid_values:
        chain.append(RemoveInvalidValues())
    if cfg.exponential_decay_length_penalty is not None and eos:
        chain.append(ExponentialDecayLengthPenalty(cfg.exponential_decay_length_penalty, eos, P))
    if cfg.suppress_tokens is not None:
        chain.append(SuppressTokens(cfg.suppress_tokens))
    if cfg.begin_suppress_tokens is not None:
        begin = P if (P > 1 or cfg.forced_bos_token_id is None) else P + 1
        chain.append(SuppressTokensAtBegin(cfg.begin_suppress_tokens, begin))
    return chain


def warpers(cfg: GenerationConfig, x: ChainInputs) -> list[LogitsProcessor]:
    """The sampling warpers that are switched on, in `sampler_order` or the default order."""
    # Beam sampling keeps one more token than there are EOS ids, so that every beam can continue.
    keep = (len(cfg.eos_ids) + 1 if cfg.eos_ids else 2) if cfg.num_beams > 1 else 1
    built = {name: make(cfg, x, keep) for name, make in WARPERS.items()}
    order = list(cfg.sampler_order) if cfg.sampler_order is not None else list(WARPERS)
    left_out = [n for n, p in built.items() if p is not None and n not in order]
    if left_out:
        raise GenerationConfigError(
            f"sampler_order {order} leaves out the enabled sampler(s) {left_out}: list them, or switch them off"
        )
    return [built[n] for n in order if built[n] is not None]  # type: ignore[misc]


def build_processors(
    cfg: GenerationConfig,
    user: Sequence[LogitsProcessor] = (),
    padding: torch.Tensor | None = None,
    inputs: ChainInputs | None = None,
) -> ProcessorChain:
    """The chain transformers' `_get_logits_processor` builds for these options, in its order.

    Penalties and constraints first, then the user's processors, then the grammar mask of structured output
    (so truncation only ever keeps tokens the grammar allows), then (only when sampling) the warpers, then the
    watermark and finally `renormalize_logits`.
    """
    x = inputs or ChainInputs()
    if padding is not None:
        x.padding = padding
    chain = _penalties(cfg, x)
    chain.extend(user)
    constraint = constraint_of(cfg)
    if constraint is not None:  # after everything that may add to scores, before truncation picks from them
        if x.vocab_size is None:
            raise GenerationConfigError(f"{constraint.kind} needs the vocabulary size (ChainInputs.vocab_size)")
        compiled = compile_for(cfg, x.tokenizer, x.vocab_size)
        prompt = x.prompt_ids[0].tolist() if x.prompt_ids is not None else []
        chain.append(GrammarMask(compiled, x.prompt_length, x.vocab_size, constraint.kind,  # type: ignore[arg-type]
                                 cfg.thinking, prompt))
    if cfg.thinking is not None and cfg.thinking.budget is not None:  # last word before sampling: close the block
        chain.append(ThinkingBudget(cfg.thinking, x.prompt_length))
    if not cfg.greedy:
        chain.extend(warpers(cfg, x))
    if cfg.watermarking_config is not None:
        if x.vocab_size is None:
            raise GenerationConfigError("watermarking needs the vocabulary size (pass ChainInputs.vocab_size)")
        chain.append(Watermark(x.vocab_size, cfg.watermarking_config))
    if cfg.renormalize_logits:
        chain.append(LogitNormalization())
    return ProcessorChain(chain)
