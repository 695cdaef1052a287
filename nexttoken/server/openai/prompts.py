"""From a validated OpenAI request to what the engine runs: prompt token ids, the length budget, the jobs."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...text.chat_template import RenderLimits
from ...errors import NextTokenError
from ...images import ImageInputs
from ..http.errors import bad_request
from ..images import image_parts
from ...chat import TemplateSupport, ToolUse
from ...chat.render import ChatPrompt, ChatRenderer
from .protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest

# The response header that says a request's tools reached the model through the tools preamble (the chat template
# renders no tools): its value is the call format whose words were used (docs/tool_calls.md).
PREAMBLE_HEADER = "x-nexttoken-tools-preamble"

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass(frozen=True)
class Limits:
    max_model_len: int  # tokens per request: the context, or less when the KV pool holds fewer
    vocab_size: int
    max_n: int
    max_token_bytes: int = 0  # the most UTF-8 bytes one token stands for (0: no tokenizer, no text check)
    pool_bound: bool = False  # max_model_len is the KV pool's capacity, not the model's context

    @property
    def what(self) -> str:
        return ("this server's KV pool holds" if self.pool_bound else "this model's maximum context length is")



def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the bytes of text one token covers: the longest vocabulary string in UTF-8 (a byte-level
    BPE writes each byte as one character of 1-2 bytes, SentencePiece's "▁" is 3 bytes for one space, a byte
    fallback "<0x41>" 6 for one byte: the string is never shorter than the text)."""
    if tokenizer is None:
        return 0
    return max(len(t.encode("utf-8")) for t in tokenizer.backend.get_vocab(with_added_tokens=True))


def check_text_length(text: str, limits: Limits, param: str) -> None:
    """A text too long to fit the context whatever its tokens (bytes > max_model_len x max_token_bytes) is a 400
    before tokenizing it: a megabyte prompt costs no tokenizer time."""
    if not limits.max_token_bytes or len(text) * 4 <= limits.max_model_len * limits.max_token_bytes:
        return  # (at most 4 bytes a character: no need to encode a short text to count them)
    size = len(text.encode("utf-8"))
    if size > limits.max_model_len * limits.max_token_bytes:
        raise bad_request(
            f"the {param} is {size} bytes, more than the {limits.max_model_len} tokens of this model's context can "
            f"hold (at most {limits.max_token_bytes} bytes a token): shorten it", param)


def check_ids(ids: list[int], vocab: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"{param} contains token ids {bad[:5]} outside the vocabulary [0, {vocab})", param)


def completion_prompts(p: Any, tokenizer: Any, limits: Limits, param: str = "prompt") -> list[list[int]]:
    """A request's prompts (`prompt`, or embeddings' `input`) as token ids: a string, a list of strings, ids, or a
    list of id lists. Tokenizing takes time: the server calls this off the event loop."""
    vocab = limits.vocab_size
    if isinstance(p, str) or (p and isinstance(p[0], str)):
        texts = [p] if isinstance(p, str) else p
        if tokenizer is None:
            raise bad_request(f"this model has no tokenizer: send the {param} as token ids", param)
        for text in texts:
            check_text_length(text, limits, param)
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


def render_request(req: ChatCompletionRequest | TokenizeRequest, renderer: ChatRenderer | None,
                   use: ToolUse | None = None, variables: dict[str, Any] | None = None,
                   limits: Limits | None = None, images: ImageInputs | None = None) -> ChatPrompt:
    """The request's conversation through the one chat renderer (chat/render.py, which `LLM.chat` renders with
    too): the prompt's ids and text, the tools preamble's format (None: the template renders the tools itself) and
    what the answer is read with. With `limits`, a rendering too long for the context is a 400 before it is
    tokenized; a conversation the template cannot render is a 400 naming `messages`. Untrusted template work: the
    server calls this off the event loop. `images`: the request's images, loaded and prepared (Serving.image_inputs),
    one per image_url part in order: each part's placeholder is expanded to the image's tokens, and the prompt
    (an ImagePrompt) carries them."""
    if renderer is None:
        raise bad_request("this model has no tokenizer, so chat is not available", "messages")
    check = None if limits is None else (lambda text: check_text_length(text, limits, "messages"))
    try:
        messages = [_message(m) for m in req.messages or []]
        if len(image_parts(messages)) != (len(images) if images is not None else 0):
            raise bad_request("this route does not load the messages' image_url parts: send them to "
                              "/v1/chat/completions or /tokenize", "messages")
        if images is None:
            return renderer.render(messages, use, variables, req.add_generation_prompt, check)
        prompt = renderer.render(messages, use, variables, req.add_generation_prompt, check, expand=images.expand)
        return ImagePrompt(**{f.name: getattr(prompt, f.name) for f in dataclasses.fields(prompt)}, images=images)
    except NextTokenError as e:
        raise bad_request(str(e), "messages") from e


@dataclasses.dataclass(frozen=True)
class ImagePrompt(ChatPrompt):
    """A rendered conversation with images: its ids hold each image's placeholder tokens (expanded)."""

    images: ImageInputs | None = None


def render_chat(req: ChatCompletionRequest | TokenizeRequest, tokenizer: Any, use: ToolUse | None = None,
                support: TemplateSupport | None = None, variables: dict[str, Any] | None = None,
                limits: Limits | None = None, special_in_content: bool = True) -> tuple[list[int], str, str | None]:
    """`render_request` with a renderer made for this one call, as (token ids, text, preamble); `support` None:
    the tools go to the template whatever it renders of them (no preamble)."""
    renderer = None
    if tokenizer is not None:
        renderer = ChatRenderer(tokenizer, limits=TEMPLATE_LIMITS, special_in_content=special_in_content,
                                support=support or TemplateSupport(tools=True, calls=True, results=True))
    prompt = render_request(req, renderer, use, variables, limits)
    return prompt.ids, prompt.text, prompt.preamble


def chat_prompt(req: ChatCompletionRequest | TokenizeRequest, tokenizer: Any, use: ToolUse | None = None,
                support: TemplateSupport | None = None, variables: dict[str, Any] | None = None,
                limits: Limits | None = None, special_in_content: bool = True) -> list[int]:
    """`render_chat`'s token ids."""
    return render_chat(req, tokenizer, use, support, variables, limits, special_in_content)[0]


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
            f"{limits.what} {limits.max_model_len} tokens, but the prompt has {longest}: shorten it", param
        )
    wanted = max_tokens if max_tokens is not None else room
    if wanted > room:
        raise bad_request(
            f"{limits.what} {limits.max_model_len} tokens, but {longest} prompt "
            f"tokens + max_tokens {wanted} = {longest + wanted}: lower max_tokens or shorten the prompt", "max_tokens"
        )
    return wanted
