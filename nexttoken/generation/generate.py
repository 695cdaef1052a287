"""`generate(model, input_ids, ...)`: the low-level entry point, shaped like transformers' `model.generate`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import torch

from ..errors import GenerationConfigError, PromptTooLongError
from ..model import Transformer
from .config import GenerationConfig
from .search.beam import beam_search
from .search.contrastive import contrastive_search
from .decode import DecodePlan, GenerationCache, StepHook, StepOutput, check_continuation, decode_steps
from .search.group_beam import group_beam_search
from .logprobs import LogprobCollector
from .modes import GenerationMode, generation_mode
from .outputs import GenerateOutput
from .processors.chain import ChainInputs, LogitsProcessor, build_processors
from .sampling import make_sampler
from .stopping import EosToken, MaxTime, StoppingChain, StoppingCriterion, StopStrings

DEFAULT_NEW_TOKENS = 20  # transformers' default max_length=20, which then counts new tokens


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


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), both (B, longest). Left padding puts every row's next token in the same column."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    return ids, mask


def default_attention_mask(input_ids: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    # transformers' rule: infer padding from pad_token_id only when it cannot be confused with EOS.
    pad = cfg.pad_token_id
    if pad is not None and pad not in cfg.eos_ids and bool((input_ids == pad).any()):
        return (input_ids != pad).long()
    return torch.ones_like(input_ids)


def new_token_budget(cfg: GenerationConfig, attention_mask: torch.Tensor, context: int) -> int:
    """How many tokens a left-padded batch generates: the request, cut so the longest prompt fits the context."""
    longest = int(attention_mask.sum(dim=1).max()) if attention_mask.numel() else 0
    return length_budget(cfg, longest, context, width=attention_mask.shape[1])


def length_budget(cfg: GenerationConfig, prompt_length: int, context: int, width: int | None = None) -> int:
    """New tokens for a prompt of `prompt_length` tokens: max_new_tokens, or max_length minus the prompt (its
    padded `width` in a batch), or transformers' default of 20; cut so prompt + output fit `context`. The one
    place a length budget is worked out, for the decode loop, the search strategies and the engine."""
    P = prompt_length if width is None else width
    if prompt_length >= context:
        raise PromptTooLongError(
            f"the prompt has {prompt_length} tokens but the model's context is {context}: shorten it to at most "
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
    return min(wanted, context - prompt_length)


def _as_list(items: Callable | Iterable | None) -> list:
    if items is None:
        return []
    if callable(items) and not isinstance(items, (list, tuple)):
        return [items]
    return list(items)


def _expansion(cfg: GenerationConfig, mode: GenerationMode) -> int:
    """Rows per prompt: beams, or independent samples (interleaved: prompt b owns rows b*n .. b*n+n-1)."""
    if mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE, GenerationMode.GROUP_BEAM_SEARCH):
        return cfg.num_beams
    return cfg.num_return_sequences if mode is GenerationMode.SAMPLE else 1


def _stopping(
    cfg: GenerationConfig, tokenizer: Any, prompt_length: int,
    user: Sequence[StoppingCriterion] | StoppingCriterion | None,
) -> StoppingChain:
    """EOS, stop strings and max_time, then the caller's criteria."""
    criteria: list[StoppingCriterion] = []
    if cfg.stop_ids:
        criteria.append(EosToken(sorted(cfg.stop_ids)))
    if cfg.stop_string_list:
        if tokenizer is None:
            raise GenerationConfigError("stop_strings need a tokenizer: pass tokenizer=... (or use LLM.generate)")
        criteria.append(StopStrings(tokenizer, cfg.stop_string_list, prompt_length))
    if cfg.max_time is not None:
        criteria.append(MaxTime(cfg.max_time))  # the clock starts now, when the call is planned
    criteria.extend(_as_list(user))
    return StoppingChain(criteria)


def plan_generation(
    model: Transformer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cfg: GenerationConfig,
    logits_processor: Sequence[LogitsProcessor] | LogitsProcessor | None = None,
    stopping_criteria: Sequence[StoppingCriterion] | StoppingCriterion | None = None,
    tokenizer: Any = None,
    *,
    hooks: Sequence[StepHook] = (),
    past_key_values: GenerationCache | None = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], Sequence[int]] | None = None,
) -> DecodePlan:
    """Turn validated options into the fixed plan the decode loop (or a search module) runs."""
    if input_ids.dim() != 2 or input_ids.dtype != torch.long or input_ids.shape[1] == 0:
        raise GenerationConfigError(
            f"input_ids must be a non-empty (batch, length) tensor of int64 token ids, got shape "
            f"{tuple(input_ids.shape)} and dtype {input_ids.dtype}"
        )
    vocab = model.config.vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise GenerationConfigError(f"input_ids contain ids outside the vocabulary [0, {vocab})")
    mode = generation_mode(cfg)
    device = model.device
    input_ids = input_ids.to(device)
    if past_key_values is not None:
        cached = check_continuation(past_key_values, input_ids)
        if attention_mask is None:  # the cached rows' padding, then the new tokens
            attention_mask = torch.cat([past_key_values.key_valid.long(), torch.ones_like(input_ids[:, cached:])], 1)
    mask = default_attention_mask(input_ids, cfg) if attention_mask is None else attention_mask.to(device)
    if mask.shape != input_ids.shape:
        raise GenerationConfigError(f"attention_mask shape {tuple(mask.shape)} != input_ids {tuple(input_ids.shape)}")
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_ids or [0])[0]
    padding = (mask == 0).sum(dim=1)  # (B,) left-padding length per row
    max_new = new_token_budget(cfg, mask, model.config.max_position_embeddings)

    chain_inputs = ChainInputs(
        prompt_ids=input_ids, padding=padding, max_new_tokens=max_new, model=model,
        negative_prompt_ids=negative_prompt_ids, negative_prompt_attention_mask=negative_prompt_attention_mask,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, vocab_size=vocab, tokenizer=tokenizer,
    )
    n = _expansion(cfg, mode)
    if n > 1 and past_key_values is not None:
        raise GenerationConfigError("past_key_values continues one sequence per row: use num_beams=1 and "
                                    "num_return_sequences=1 when continuing")
    return DecodePlan(
        input_ids=input_ids.repeat_interleave(n, dim=0),
        attention_mask=mask.repeat_interleave(n, dim=0),
        max_new_tokens=max_new,
        pad_token_id=pad,
        processors=build_processors(cfg, _as_list(logits_processor), inputs=chain_inputs),
        sampler=make_sampler(cfg, device),
        stopping=_stopping(cfg, tokenizer, input_ids.shape[1], stopping_criteria),
        hooks=list(hooks),
        past=past_key_values,
        prompt_logprobs=cfg.prompt_logprobs,
    )


def decode(model: Transformer, plan: DecodePlan, cfg: GenerationConfig, streamer: Any = None) -> GenerateOutput:
    """Greedy / sampling / mirostat: run the decode loop and keep what the options ask for, step by step (a
    step's (B, V) logits and scores are kept only when output_logits / output_scores ask for them)."""
    if streamer is not None:
        streamer.put(plan.input_ids.cpu())
    logprobs_asked = cfg.return_dict_in_generate  # LogprobCollector reads every step's logits
    plan = dataclasses.replace(plan, per_step_logits=cfg.output_scores or cfg.output_logits or logprobs_asked)
    tokens: list[torch.Tensor] = []
    scores: list[torch.Tensor] = []
    logits: list[torch.Tensor] = []
    logprobs = LogprobCollector(cfg.top_logprobs) if cfg.return_dict_in_generate else None
    last: StepOutput | None = None
    for last in decode_steps(model, plan):
        tokens.append(last.tokens)
        if cfg.output_scores:
            scores.append(last.scores)
        if cfg.output_logits:
            logits.append(last.logits)
        if logprobs is not None:
            logprobs.add(last.logits, last.tokens)
        if streamer is not None:
            streamer.put(last.tokens.cpu())
    if streamer is not None:
        streamer.end()
    new = torch.stack(tokens, dim=1) if tokens else plan.input_ids[:, :0]
    sequences = torch.cat([plan.input_ids, new], dim=1)
    finished = last.unfinished.logical_not() if last else torch.zeros(len(sequences), dtype=torch.bool)
    state = last.state if last else None
    out = GenerateOutput(
        sequences=sequences,
        scores=tuple(scores) if cfg.output_scores else None,
        logits=tuple(logits) if cfg.output_logits else None,
        finished=finished,
        prompt_logprobs=state.prompt_logprobs if state is not None else None,
        past_key_values=state.generation_cache() if state is not None else None,
    )
    if tokens and logprobs is not None:  # a plain tensor result has no room for them
        out.logprobs, out.top_logprobs, out.top_logprob_ids = logprobs.result()
    return out


def _runners() -> dict[GenerationMode, Callable[..., GenerateOutput]]:
    """The runner of each mode: (model, plan, cfg, streamer) -> GenerateOutput."""
    return {
        GenerationMode.GREEDY: decode,
        GenerationMode.SAMPLE: decode,
        GenerationMode.BEAM_SEARCH: beam_search,
        GenerationMode.BEAM_SAMPLE: beam_search,
        GenerationMode.GROUP_BEAM_SEARCH: group_beam_search,
        GenerationMode.CONTRASTIVE_SEARCH: contrastive_search,
    }


def generate(
    model: Transformer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor: Sequence[LogitsProcessor] | LogitsProcessor | None = None,
    stopping_criteria: Sequence[StoppingCriterion] | StoppingCriterion | None = None,
    streamer: Any = None,
    tokenizer: Any = None,
    *,
    hooks: Sequence[StepHook] = (),
    past_key_values: GenerationCache | None = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], Sequence[int]] | None = None,
    **options: Any,
) -> torch.Tensor | GenerateOutput:
    """Generate continuations of left-padded `input_ids` (B, P), like transformers' `model.generate`.

    Returns the (B*n, P + new) tensor, or a GenerateOutput when `return_dict_in_generate=True`. The strategy
    (greedy, sampling, beam search, beam sampling, group beam search, contrastive search) follows transformers'
    flags, see `modes.generation_mode`. `streamer` is any object with transformers' streamer interface
    (`put(ids)`, `end()`); `hooks` are per-step StepHooks (docs/hooks.md); `past_key_values` is a previous
    output's cache, with input_ids = its sequences plus the new tokens.
    """
    assistant = options.pop("assistant_model", None)
    cfg = resolve_config(model, generation_config, options)
    if cfg.trace:
        raise GenerationConfigError(
            "trace is recorded by the engine, for greedy decoding and sampling: use LLM.generate / chat / stream, "
            "the server's `trace` field or `nexttoken generate --trace` (the padded-batch generate() and the "
            "search strategies are not traced)"
        )
    if assistant is not None or cfg.prompt_lookup_num_tokens is not None:
        raise GenerationConfigError(
            "speculative decoding (assistant_model, prompt_lookup_num_tokens) runs in the engine: use "
            "nexttoken.load(...).generate(prompts, ...) or the server, which decode the same tokens at any batch")
    mode = generation_mode(cfg)
    plan = plan_generation(
        model, input_ids, attention_mask, cfg, logits_processor, stopping_criteria, tokenizer,
        hooks=hooks, past_key_values=past_key_values, negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
    )
    if mode not in (GenerationMode.GREEDY, GenerationMode.SAMPLE):
        if streamer is not None or hooks:
            raise GenerationConfigError(f"streamer and hooks work with greedy decoding and sampling, not {mode.value}")
        if cfg.guidance_scale not in (None, 1.0):
            raise GenerationConfigError(f"guidance_scale works with greedy decoding and sampling, not {mode.value}")
    out = _runners()[mode](model, plan, cfg, streamer)
    return out if cfg.return_dict_in_generate else out.sequences
