"""`generate(model, input_ids, ...)`: the low-level entry point, shaped like transformers' `model.generate`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from ..errors import GenerationConfigError, PromptTooLongError
from ..model import Transformer
from .config import GenerationConfig
from .decode import DecodePlan, StepOutput, decode_steps
from .processors import LogitsProcessor, build_processors
from .sampling import Sampler
from .stopping import EosToken, StoppingChain, StoppingCriterion, StopStrings

DEFAULT_NEW_TOKENS = 20  # transformers' default max_length=20, which then counts new tokens


@dataclass
class GenerateOutput:
    """What `generate(..., return_dict_in_generate=True)` returns."""

    sequences: torch.Tensor  # (B, P + new) prompts then generated ids; finished rows padded with pad_token_id
    scores: tuple[torch.Tensor, ...] | None = None  # per step (B, V): processed scores, when output_scores
    logits: tuple[torch.Tensor, ...] | None = None  # per step (B, V): raw logits, when output_logits
    finished: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))  # (B,) stopped, not cut


def model_generation_config(model: Transformer) -> GenerationConfig:
    """The model's defaults: its generation_config.json when loaded with one, else config.json's special tokens."""
    cfg = getattr(model, "generation_config", None)
    if cfg is not None:
        return cfg
    mc = model.config
    return GenerationConfig(bos_token_id=mc.bos_token_id, eos_token_id=mc.eos_token_id, pad_token_id=mc.pad_token_id)


def resolve_config(
    model: Transformer, generation_config: GenerationConfig | None, options: dict[str, Any]
) -> GenerationConfig:
    base = model_generation_config(model)
    if generation_config is not None:
        # A caller's config replaces the model's, but inherits the special tokens it leaves unset.
        inherit = {
            k: getattr(base, k)
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if getattr(generation_config, k) is None
        }
        base = generation_config.updated(**inherit) if inherit else generation_config
    return base.updated(**options)


def default_attention_mask(input_ids: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    # transformers' rule: infer padding from pad_token_id only when it cannot be confused with EOS.
    pad = cfg.pad_token_id
    if pad is not None and pad not in cfg.eos_ids and bool((input_ids == pad).any()):
        return (input_ids != pad).long()
    return torch.ones_like(input_ids)


def new_token_budget(cfg: GenerationConfig, attention_mask: torch.Tensor, context: int) -> int:
    """How many tokens to generate: the request, cut so the longest prompt stays inside the context."""
    P = attention_mask.shape[1]
    longest = int(attention_mask.sum(dim=1).max()) if attention_mask.numel() else 0
    if longest >= context:
        raise PromptTooLongError(
            f"the prompt has {longest} tokens but the model's context is {context}: shorten it to at most "
            f"{context - 1} tokens so that at least one new token fits"
        )
    if cfg.max_new_tokens is not None:
        wanted = cfg.max_new_tokens
    elif cfg.max_length is not None:
        wanted = cfg.max_length - P
        if wanted < 0:
            raise GenerationConfigError(
                f"max_length={cfg.max_length} is shorter than the prompt ({P} tokens); "
                "set max_new_tokens to count new tokens only"
            )
    else:
        wanted = DEFAULT_NEW_TOKENS
    return min(wanted, context - longest)


def _as_list(items: Callable | Iterable | None) -> list:
    if items is None:
        return []
    if callable(items) and not isinstance(items, (list, tuple)):
        return [items]
    return list(items)


def plan_generation(
    model: Transformer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cfg: GenerationConfig,
    logits_processor: Sequence[LogitsProcessor] | LogitsProcessor | None = None,
    stopping_criteria: Sequence[StoppingCriterion] | StoppingCriterion | None = None,
    tokenizer: Any = None,
) -> DecodePlan:
    """Turn validated options into the fixed plan the decode loop runs."""
    if input_ids.dim() != 2 or input_ids.dtype != torch.long or input_ids.shape[1] == 0:
        raise GenerationConfigError(
            f"input_ids must be a non-empty (batch, length) tensor of int64 token ids, got shape "
            f"{tuple(input_ids.shape)} and dtype {input_ids.dtype}"
        )
    vocab = model.config.vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise GenerationConfigError(f"input_ids contain ids outside the vocabulary [0, {vocab})")
    device = model.device
    input_ids = input_ids.to(device)
    mask = default_attention_mask(input_ids, cfg) if attention_mask is None else attention_mask.to(device)
    if mask.shape != input_ids.shape:
        raise GenerationConfigError(f"attention_mask shape {tuple(mask.shape)} != input_ids {tuple(input_ids.shape)}")
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_ids or [0])[0]
    padding = (mask == 0).sum(dim=1)  # (B,) left-padding length per row

    criteria: list[StoppingCriterion] = []
    if cfg.eos_ids:
        criteria.append(EosToken(cfg.eos_ids))
    if cfg.stop_string_list:
        if tokenizer is None:
            raise GenerationConfigError("stop_strings need a tokenizer: pass tokenizer=... (or use LLM.generate)")
        criteria.append(StopStrings(tokenizer, cfg.stop_string_list, input_ids.shape[1]))
    criteria.extend(_as_list(stopping_criteria))

    return DecodePlan(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=new_token_budget(cfg, mask, model.config.max_position_embeddings),
        pad_token_id=pad,
        processors=build_processors(cfg, _as_list(logits_processor), padding=padding),
        sampler=Sampler(cfg.greedy, cfg.seed, device),
        stopping=StoppingChain(criteria),
    )


def generate(
    model: Transformer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor: Sequence[LogitsProcessor] | LogitsProcessor | None = None,
    stopping_criteria: Sequence[StoppingCriterion] | StoppingCriterion | None = None,
    streamer: Any = None,
    tokenizer: Any = None,
    **options: Any,
) -> torch.Tensor | GenerateOutput:
    """Generate continuations of left-padded `input_ids` (B, P), like transformers' `model.generate`.

    Returns the (B, P + new) tensor, or a GenerateOutput when `return_dict_in_generate=True`. `streamer` is any
    object with transformers' streamer interface (`put(ids)`, `end()`).
    """
    cfg = resolve_config(model, generation_config, options)
    plan = plan_generation(model, input_ids, attention_mask, cfg, logits_processor, stopping_criteria, tokenizer)
    if streamer is not None:
        streamer.put(plan.input_ids.cpu())
    steps: list[StepOutput] = []
    for step in decode_steps(model, plan):
        steps.append(step)
        if streamer is not None:
            streamer.put(step.tokens.cpu())
    if streamer is not None:
        streamer.end()
    new = torch.stack([s.tokens for s in steps], dim=1) if steps else plan.input_ids[:, :0]
    sequences = torch.cat([plan.input_ids, new], dim=1)
    if not cfg.return_dict_in_generate:
        return sequences
    finished = steps[-1].unfinished.logical_not() if steps else torch.zeros(len(sequences), dtype=torch.bool)
    return GenerateOutput(
        sequences=sequences,
        scores=tuple(s.scores for s in steps) if cfg.output_scores else None,
        logits=tuple(s.logits for s in steps) if cfg.output_logits else None,
        finished=finished,
    )
