"""From a validated OpenAI request to what the engine runs: prompt token ids, the length budget, the jobs."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

from ...text.chat_template import RenderLimits
from ...errors import NextTokenError
from ..http.errors import bad_request
from ...chat import TemplateSupport, ToolUse, template_messages, with_preamble
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


def chat_prompt(req: ChatCompletionRequest | TokenizeRequest, tokenizer: Any, use: ToolUse | None = None,
                support: TemplateSupport | None = None, variables: dict[str, Any] | None = None,
                limits: Limits | None = None, special_in_content: bool = True) -> list[int]:
    """`render_chat`'s token ids."""
    return render_chat(req, tokenizer, use, support, variables, limits, special_in_content)[0]


def render_chat(req: ChatCompletionRequest | TokenizeRequest, tokenizer: Any, use: ToolUse | None = None,
                support: TemplateSupport | None = None, variables: dict[str, Any] | None = None,
                limits: Limits | None = None, special_in_content: bool = True) -> tuple[list[int], str, str | None]:
    """The conversation rendered by the model's chat template, as (token ids, text, preamble).

    The request's tools go to the template as sent, with the template `variables` (e.g. enable_thinking); when the
    template renders no tools (`support`, found once per server) and the tools have a call format, they go into the
    system message as that format's preamble instead, and `preamble` names the format (else None). With `limits`, a
    rendering too long for the context is a 400 before it is tokenized. `special_in_content=False`
    (--no-special-tokens-in-content): a special token's text inside a message's content ("<|im_start|>") is encoded
    as plain text, as transformers' split_special_tokens does, while the template's own stay special."""
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so chat is not available", "messages")
    try:
        messages = template_messages([_message(m) for m in req.messages or []])
    except NextTokenError as e:
        raise bad_request(str(e), "messages") from e
    tools = list(use.tools) if use is not None else None
    preamble = None
    if use is not None and use.format is not None and support is not None and not support.tools:
        messages, tools, preamble = with_preamble(messages, use.tools, use.format, support), None, use.format.name
    variables = variables or {}
    text = _render(tokenizer, messages, req.add_generation_prompt, tools, variables)
    if limits is not None:
        check_text_length(text, limits, "messages")
    if not special_in_content:
        specials = _special_texts(tokenizer)
        if any(isinstance(m.get("content"), str) and any(s in m["content"] for s in specials) for m in messages):
            ids = _encode_content_as_text(tokenizer, messages, req.add_generation_prompt, tools, text, variables)
            return ids, text, preamble
    return tokenizer.encode(text, add_special_tokens=False), text, preamble  # the template writes BOS itself


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list | None,
            variables: dict[str, Any]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             limits=TEMPLATE_LIMITS, **variables)
    except NextTokenError as e:
        raise bad_request(str(e), "messages") from e


def _special_texts(tokenizer: Any) -> list[str]:
    return [t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special and t.content]


_SPLITTING: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_SPLITTING_LOCK = threading.Lock()


def _splitting(tokenizer: Any, first: bool) -> Any:
    """A copy of the tokenizer's backend that encodes special tokens' text as plain text (tokenizers'
    encode_special_tokens; a copy, since requests encode on several threads at once). `first`: for the text's
    first piece; a Metaspace that prepends "▁" to the first piece only gets a copy that never does, for the rest."""
    with _SPLITTING_LOCK:
        if tokenizer not in _SPLITTING:
            copies = []
            for scheme in ("first", "never"):
                copy = type(tokenizer.backend).from_str(tokenizer.backend.to_str())
                copy.encode_special_tokens = True
                if scheme == "never" and getattr(copy.pre_tokenizer, "prepend_scheme", None) == "first":
                    copy.pre_tokenizer.prepend_scheme = "never"
                copies.append(copy)
            _SPLITTING[tokenizer] = copies
        return _SPLITTING[tokenizer][0 if first else 1]


def _encode_split(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> list[int]:
    specials = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    normal = tokenizer.backend.encode(text, add_special_tokens=False)
    inside = lambda a, b: any(s <= a and b <= e for s, e in spans)  # noqa: E731
    cuts = [(i, a, b) for i, (a, b) in zip(normal.ids, normal.offsets) if i in specials and not inside(a, b)]
    ids, start, first = [], 0, True
    for token, a, b in [*cuts, (None, len(text), len(text))]:
        if a > start:
            ids += _splitting(tokenizer, first).encode(text[start:a], add_special_tokens=False).ids
        first = False
        if token is not None:
            ids.append(token)
        start = b
    return ids


_MARK = "\ue000{}\ue001"  # private-use characters around a message's number: where its content goes


def _encode_content_as_text(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                            tools: list | None, text: str, variables: dict[str, Any]) -> list[int]:
    """`text` (the rendering) as the tokenizer encodes it, except that special tokens inside a message's content are
    not matched: where the contents lie comes from a rendering with a marker in place of each (a template that
    rewrites content cannot be split this way: a 400); the special tokens outside them (the template's) split the
    text as the tokenizer itself splits it, and each piece between them is encoded with special tokens read as
    plain text. A text whose contents hold no special token gets exactly the usual ids."""
    marked = [dict(m, content=_MARK.format(i)) if isinstance(m.get("content"), str) else m
              for i, m in enumerate(messages)]
    rest, at, spans = _render(tokenizer, marked, add_generation_prompt, tools, variables), 0, []  # content (start, end)
    for i, m in enumerate(messages):
        if not isinstance(m.get("content"), str):
            continue
        before, found, rest = rest.partition(_MARK.format(i))
        if not found or _MARK.format(i) in rest:
            break
        at += len(before)
        spans.append((at, at + len(m["content"])))
        at += len(m["content"])
    else:
        if at + len(rest) == len(text) and all(text[s:e] == m for (s, e), m in zip(spans, (
                m["content"] for m in messages if isinstance(m.get("content"), str)))):
            return _encode_split(tokenizer, text, spans)
    raise bad_request("this model's chat template rewrites message content, so special tokens in it cannot be "
                      "kept as text (--no-special-tokens-in-content): remove them from the messages", "messages")


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
