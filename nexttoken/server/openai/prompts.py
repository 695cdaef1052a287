"""From a validated OpenAI request to what the engine runs: prompt token ids, the length budget, the jobs."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...chat_template import RenderLimits
from ...errors import NextTokenError
from ..http.errors import bad_request
from ...tools import TemplateSupport, ToolUse, template_messages, with_preamble
from .protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest

# The response header that says a request's tools reached the model through the tools preamble (the chat template
# renders no tools): its value is the call format whose words were used (docs/tool_calls.md).
PREAMBLE_HEADER = "x-nexttoken-tools-preamble"

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


def completion_prompts(p: Any, tokenizer: Any, vocab: int, param: str = "prompt") -> list[list[int]]:
    """A request's prompts (`prompt`, or embeddings' `input`) as token ids: a string, a list of strings, ids, or a
    list of id lists."""
    if isinstance(p, str) or (p and isinstance(p[0], str)):
        texts = [p] if isinstance(p, str) else p
        if tokenizer is None:
            raise bad_request(f"this model has no tokenizer: send the {param} as token ids", param)
        prompts = [tokenizer.encode(t) for t in texts]
    else:
        prompts = [p] if isinstance(p[0], int) else p  # type: ignore[list-item]
    for ids in prompts:
        if not ids:
            raise bad_request(f"the {param} is empty (it encodes to no tokens)", param)
        check_ids(ids, vocab, param)
    return prompts


# A request's chat template rendering: the template is the model's, but the messages are the client's, and a
# template can loop over them; the server gives it this much (off the event loop, see app.chat_completions).
TEMPLATE_LIMITS = RenderLimits(seconds=2.0, characters=2_000_000)


# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them.
_RESERVED = {"messages", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
             "continue_final_message", "limits"}


def template_kwargs(defaults: dict[str, Any], req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """The template's variables: the server's defaults (--default-chat-template-kwargs), the request's over them."""
    given = req.chat_template_kwargs or {}
    reserved = sorted(set(given) & _RESERVED)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved}: they are the request's own fields",
                          "chat_template_kwargs")
    return {**defaults, **given}


def chat_prompt(req: ChatCompletionRequest | TokenizeRequest, tokenizer: Any, use: ToolUse | None = None,
                support: TemplateSupport | None = None, variables: dict[str, Any] | None = None
                ) -> tuple[list[int], str | None]:
    """`chat_text`'s rendering as token ids, and the call format whose tools preamble it holds (or None)."""
    text, preamble = chat_text(req, tokenizer, use, support, variables)
    return tokenizer.encode(text, add_special_tokens=False), preamble  # the template writes BOS itself


def chat_text(req: ChatCompletionRequest | TokenizeRequest, tokenizer: Any, use: ToolUse | None = None,
              support: TemplateSupport | None = None, variables: dict[str, Any] | None = None
              ) -> tuple[str, str | None]:
    """The conversation rendered by the model's chat template (with the request's tools, as sent, and the template
    `variables`, e.g. enable_thinking), as text; and the call format whose tools preamble went into the system
    message, or None. The preamble is written when the template renders no tools (`support`, found once per
    server) and the tools have a format."""
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so chat is not available", "messages")
    messages = template_messages([_message(m) for m in req.messages or []])
    tools = list(use.tools) if use is not None else None
    preamble = None
    if use is not None and use.format is not None and support is not None and not support.tools:
        messages, tools, preamble = with_preamble(messages, use.tools, use.format, support), None, use.format.name
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                             tools=tools, limits=TEMPLATE_LIMITS, **(variables or {}))
    except NextTokenError as e:
        raise bad_request(str(e), "messages") from e
    return text, preamble


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as OpenAI sent it (its refusal kept out of the prompt), for `template_messages`."""
    return m.model_dump(exclude_none=True, exclude={"refusal", "function_call", "audio"})


def new_tokens(prompts: list[list[int]], max_tokens: int | None, n: int, limits: Limits, param: str) -> int:
    """max_tokens, checked against the context (a 400, not a silent cut: OpenAI's contract); None: all that fits."""
    if n > limits.max_n:
        raise bad_request(f"n={n} is over this server's limit of {limits.max_n} (--max-n)", "n")
    longest = max(len(p) for p in prompts)
    room = limits.max_model_len - longest
    if room < 1:
        raise bad_request(
            f"this model's maximum context length is {limits.max_model_len} tokens, but the prompt has "
            f"{longest}: shorten it", param
        )
    wanted = max_tokens if max_tokens is not None else room
    if wanted > room:
        raise bad_request(
            f"this model's maximum context length is {limits.max_model_len} tokens, but {longest} prompt "
            f"tokens + max_tokens {wanted} = {longest + wanted}: lower max_tokens or shorten the prompt", "max_tokens"
        )
    return wanted
