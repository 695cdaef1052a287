"""From a validated OpenAI request to what the engine runs: prompt token ids and one SamplingParams per choice."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..engine.params import SamplingParams
from ..errors import NextTokenError
from ..generation.config import GenerationConfig
from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_n: int


def check_ids(ids: list[int], vocab: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"{param} contains token ids {bad[:5]} outside the vocabulary [0, {vocab})", param)


def completion_prompts(req: CompletionRequest, tokenizer: Any, vocab: int) -> list[list[int]]:
    """The request's prompts as token ids (a string, a list of strings, ids, or a list of id lists)."""
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], str)):
        texts = [p] if isinstance(p, str) else p
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
        prompts = [tokenizer.encode(t) for t in texts]
    else:
        prompts = [p] if isinstance(p[0], int) else p  # type: ignore[list-item]
    for ids in prompts:
        if not ids:
            raise bad_request("the prompt is empty (it encodes to no tokens)", "prompt")
        check_ids(ids, vocab, "prompt")
    return prompts


def chat_prompt(req: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so chat is not available", "messages")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
    except NextTokenError as e:
        raise bad_request(str(e), "messages") from e
    return tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS itself


def sampling_params(
    req: SamplingFields,
    prompt_len: int,
    max_tokens: int | None,
    base: GenerationConfig,
    limits: Limits,
    logprobs: int | None,
    prompt_logprobs: int | None,
    param: str,
) -> list[SamplingParams]:
    """One SamplingParams per choice (n of them); choice i draws from seed + i when a seed is given."""
    if req.n > limits.max_n:
        raise bad_request(f"n={req.n} is over this server's limit of {limits.max_n} (--max-n)", "n")
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"this model's maximum context length is {limits.max_model_len} tokens, but the prompt has "
            f"{prompt_len}: shorten it", param
        )
    wanted = max_tokens if max_tokens is not None else room
    if wanted > room:
        raise bad_request(
            f"this model's maximum context length is {limits.max_model_len} tokens, but {prompt_len} prompt "
            f"tokens + max_tokens {wanted} = {prompt_len + wanted}: lower max_tokens or shorten the prompt", "max_tokens"
        )
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    check_ids(list(bias), limits.vocab_size, "logit_bias")
    check_ids(req.stop_token_ids or [], limits.vocab_size, "stop_token_ids")
    temperature = 1.0 if req.temperature is None else req.temperature
    options = dict(
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k if req.top_k and req.top_k > 0 else None,
        min_p=req.min_p or None,
        repetition_penalty=req.repetition_penalty or 1.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=bias or None,
        stop_strings=None,  # the engine matches stop strings on the streamed text itself
    )
    out = []
    for i in range(req.n):
        seed = None if req.seed is None else (req.seed + i) % 2**63
        try:
            gen = base.updated(seed=seed, **options)
            out.append(SamplingParams(
                generation=gen,
                max_tokens=wanted,
                stop=tuple(req.stop_list),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
            ))
        except NextTokenError as e:
            raise APIError(400, str(e)) from e
    return out


def server_generation_base(model_defaults: GenerationConfig) -> GenerationConfig:
    """The model's special tokens with OpenAI's sampling defaults (transformers' top_k=50 is not OpenAI's)."""
    return GenerationConfig(
        bos_token_id=model_defaults.bos_token_id,
        eos_token_id=model_defaults.eos_token_id,
        pad_token_id=model_defaults.pad_token_id,
        top_k=None,
    )
