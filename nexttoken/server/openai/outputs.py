"""OpenAI response bodies: choices, logprobs in the completions and chat layouts, usage."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

from ...engine.sequence import TokenEvent, TopLogprobs


MIN_LOGPROB = -9999.0  # JSON has no -inf: a token masked out (processed log-probs) reports this, as vLLM does


def _finite(lp: float | None) -> float | None:
    return None if lp is None else max(lp, MIN_LOGPROB)


def usage(prompt_tokens: int, completion_tokens: int, speculated: list[tuple[int, int]] = ()) -> dict:
    """`speculated`: (draft tokens verified, kept) per choice; with drafts, completion_tokens_details reports them
    in OpenAI's predicted-output fields."""
    body: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    drafted, kept = sum(d for d, _ in speculated), sum(k for _, k in speculated)
    if drafted:
        body["completion_tokens_details"] = {"accepted_prediction_tokens": kept,
                                             "rejected_prediction_tokens": drafted - kept}
    return body


@dataclass
class Choice:
    """One choice, accumulated from its events (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    trace: dict | None = None  # a traced request's trace, with its last event
    speculated: tuple[int, int] = (0, 0)  # draft tokens verified, kept
    hidden_stop: bool = False  # the last id is a stop id the text leaves out (engine/sequence.TokenEvent)

    def add(self, event: TokenEvent) -> None:
        self.text += event.text
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs
        self.top_logprobs += event.top_logprobs
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
        self.num_prompt_tokens = event.num_prompt_tokens
        if event.trace is not None:
            self.trace = event.trace
        self.speculated = (event.spec_draft_tokens, event.spec_accepted_tokens)
        self.hidden_stop = event.hidden_stop


class TokenTexts:
    """Each token's text as it appears in the returned text, and where in that text it starts (completions'
    `tokens` and `text_offset`), token after token; a stream keeps one per choice.

    A token's text is its bytes as the decoder writes them, read in context: the decoder drops `strip`
    characters at the very start of a text (SentencePiece's leading space), so the first text token of an echoed
    prompt loses them (`"▁Once"` starts the text as `"Once"`). A token that is part of a multi-byte character is
    written \\xNN (its bytes are its own). Offsets count characters of the returned text, so the byte tokens of
    one character all point at where that character starts. Special tokens that the text skips keep their name
    and add nothing."""

    def __init__(self, tokenizer: Any, skip_special: bool, strip: int = 0) -> None:
        self.tokenizer, self.strip = tokenizer, strip
        self.skipped = tokenizer.skipped_special_ids if (tokenizer is not None and skip_special) else frozenset()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0  # characters the tokens so far wrote, before the strip

    def text(self, token_id: int) -> str:
        """The text `token_id` shows if it comes next (the chosen token or an alternative)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        text = self.tokenizer.token_text(token_id)
        if self.chars >= self.strip or token_id in self.skipped or self.decoder.getstate()[0]:
            return text
        whole = text.encode("utf-8") == self.tokenizer.token_bytes(token_id)  # not a piece of a character
        return text[self.strip - self.chars :] if whole else text

    def advance(self, token_id: int) -> int:
        """Take the next token; returns where its text starts in the returned text."""
        at = max(0, self.chars - self.strip)
        if self.tokenizer is not None and token_id not in self.skipped:
            self.chars += len(self.decoder.decode(self.tokenizer.token_bytes(token_id)))
        return at


def echo_token_texts(tokenizer: Any, prompt_ids: list[int], skip_special: bool) -> TokenTexts:
    """Token texts for a completion that echoes its prompt: the returned text starts with the prompt's decode,
    which may drop characters the tokens write (SentencePiece's leading space); those are the strip."""
    strip = 0
    if tokenizer is not None:
        skipped = tokenizer.skipped_special_ids if skip_special else frozenset()
        written = b"".join(tokenizer.token_bytes(t) for t in prompt_ids if t not in skipped)
        whole = written.decode("utf-8", errors="replace")
        shown = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special)
        strip = len(whole) - len(shown) if whole.endswith(shown) else 0
    return TokenTexts(tokenizer, skip_special, strip)


class LogprobFormatter:
    """Logprobs in OpenAI's layouts: each token as the text it adds to the output (" Once", not the vocabulary
    piece "▁Once"; a byte of a multi-byte character as \\xNN) and its exact UTF-8 bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id) if self.tokenizer is not None else f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> list[int]:
        raw = self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else self.token(token_id).encode()
        return list(raw)

    def completion(
        self, ids: list[int], logprobs: list[float | None], tops: list[TopLogprobs | None], texts: TokenTexts,
        hidden_stop: bool = False,
    ) -> dict[str, Any]:
        """The legacy completions layout: parallel lists, top alternatives as {token: logprob}. `hidden_stop`:
        the last id is a stop id the text leaves out, so the tokens leave it out too (their texts join to the
        text, as OpenAI's and vLLM's do)."""
        ids, logprobs, tops = _shown(ids, logprobs, tops, hidden_stop)
        tokens, top_logprobs, offsets = [], [], []
        for i, token_id in enumerate(ids):
            top = tops[i] if i < len(tops) else None
            tokens.append(texts.text(token_id))
            top_logprobs.append(None if top is None else {texts.text(i): _finite(lp) for i, lp in top})
            offsets.append(texts.advance(token_id))
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp) for lp in logprobs],
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def chat(self, ids: list[int], logprobs: list[float], tops: list[TopLogprobs],
             hidden_stop: bool = False) -> dict[str, Any]:
        """The chat layout; without the stop id the answer leaves out (`hidden_stop`), so the tokens' bytes join
        to the answer's."""
        ids, logprobs, tops = _shown(ids, logprobs, tops, hidden_stop)
        content = []
        for token_id, lp, top in zip(ids, logprobs, tops):
            content.append({
                "token": self.token(token_id),
                "logprob": _finite(lp),
                "bytes": self.token_bytes(token_id),
                "top_logprobs": [
                    {"token": self.token(i), "logprob": _finite(v), "bytes": self.token_bytes(i)} for i, v in top
                ],
            })
        return {"content": content}


def _shown(ids: list[int], logprobs: list, tops: list, hidden_stop: bool) -> tuple[list[int], list, list]:
    """The tokens the text shows: all but a last stop id the text leaves out."""
    if hidden_stop and ids:
        return ids[:-1], logprobs[: len(ids) - 1], tops[: len(ids) - 1]
    return ids, logprobs, tops


def echo_logprobs(prompt_ids: list[int], prompt_logprobs: list | None) -> tuple[list[float | None], list[TopLogprobs | None]]:
    """Prompt logprobs (first token: None) as the two parallel lists the completions layout wants."""
    values: list[float | None] = []
    tops: list[TopLogprobs | None] = []
    for i in range(len(prompt_ids)):
        entry = prompt_logprobs[i] if prompt_logprobs and i < len(prompt_logprobs) else None
        values.append(None if entry is None else entry[0])
        tops.append(None if entry is None else entry[1])
    return values, tops
