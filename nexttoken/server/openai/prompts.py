"""From a validated OpenAI request to what the engine runs: prompt token ids, the length budget, the jobs."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...chat_template import RenderLimits
from ...errors import NextTokenError
from ..http.errors import bad_request
from ...tools import template_messages
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, TokenizeRequest

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass(frozen=True)
class Limits:
    max_model_len: int  # tokens per request: the context, or less when the KV pool holds fewer
    vocab_size: int
    max_n: int
    pool_bound: bool = False  # max_model_len is the KV pool's capacity, not the model's context

    @property
    def what(self) -> str:
        return ("this server's KV pool holds" if self.pool_bound else "this model's maximum context length is")


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


# A request's chat template rendering: the template is the model's, but the messages are the client's, and a
# template can loop over them; the server gives it this much (off the event loop, see app.chat_completions).
TEMPLATE_LIMITS = RenderLimits(seconds=2.0, characters=2_000_000)


def chat_prompt(req: ChatCompletionRequest | TokenizeRequest, tokenizer: Any, tools: list | None = None) -> list[int]:
    """The conversation rendered by the model's chat template (with `tools`, as sent), as token ids."""
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so chat is not available", "messages")
    try:
        messages = template_messages([_message(m) for m in req.messages or []])
    except NextTokenError as e:
        raise bad_request(str(e), "messages") from e
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                             tools=tools, limits=TEMPLATE_LIMITS)
    except NextTokenError as e:
        raise bad_request(str(e), "messages") from e
    return tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS itself


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as templates read it: text content; an assistant's calls and a tool result's call id kept."""
    message: dict[str, Any] = {"role": m.role, "content": m.text() if m.content is not None or not m.tool_calls
                               else None}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def new_tokens(prompts: list[list[int]], max_tokens: int | None, n: int, limits: Limits, param: str) -> int:
    """max_tokens, checked against the context (a 400, not a silent cut: OpenAI's contract); None: all that fits."""
    if n > limits.max_n:
        raise bad_request(f"n={n} is over this server's limit of {limits.max_n} (--max-n)", "n")
    longest = max(len(p) for p in prompts)
    room = limits.max_model_len - longest
    if room < 1:
        raise bad_request(
            f"{limits.what} {limits.max_model_len} tokens, but the prompt has {longest}: shorten it", param
        )
    wanted = max_tokens if max_tokens is not None else room
    if wanted > room:
        raise bad_request(
            f"{limits.what} {limits.max_model_len} tokens, but {longest} prompt "
            f"tokens + max_tokens {wanted} = {longest + wanted}: lower max_tokens or shorten the prompt", "max_tokens"
        )
    return wanted
