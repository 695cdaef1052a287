"""Streaming detokenization: turn ids into text deltas as they are generated, never splitting a character.

Decoding a token alone is wrong in two ways: SentencePiece decoders strip the leading space of a text (so "▁world"
alone reads "world"), and one character can span several tokens (byte-level BPE pieces, or `<0xE6>`-style
byte-fallback tokens), so a lone token decodes to U+FFFD. As in vLLM and TGI, each step therefore decodes a short
window that carries its context and emits only the difference. Here the context is one fixed "anchor" token (e.g.
"a") put in front of the tokens not yet emitted: the decoder strips the anchor's start, not the window's, and the
anchor ends on a whole character. The window is cut only where the text is final — it does not end in U+FFFD (an
unfinished character) nor in a run of byte-fallback tokens (the decoder turns a whole run into U+FFFDs if it turns
out invalid) — so it stays a few tokens long, and the concatenated deltas equal decoding all ids at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"

# Prompt tokens searched backwards for a clean start (see `_start_after_prompt`).
_PROMPT_LOOKBACK = 8

_ANCHOR_CANDIDATES = ("a", "A", "x", "the", "0", ".")


class IncrementalDetokenizer:
    """Text deltas for ids pushed one at a time; `"".join(deltas) + flush() == tokenizer.decode(ids)`.

    With `prompt_ids`, the deltas continue the prompt's text (the first one keeps its leading space) instead of
    starting a new text. If the prompt ends inside a character, the first delta repeats that character whole.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # decode(skip_special_tokens=True) filters these out before decoding, so they cannot affect the text.
        self._skipped = tokenizer.skipped_special_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_fallback_ids
        self._anchor = _find_anchor(tokenizer, self._byte_ids)
        # Decoded in front of every window once text has started: the anchor, or, for a vocabulary without a
        # usable one (never seen in practice), all the final ids — exact, but O(n) per token.
        self._context = self._anchor
        self._context_text = tokenizer.decode(self._anchor, skip_special_tokens=self._skip)
        self._pending: list[int] = []  # ids whose text is not final yet
        self._emitted = 0  # characters of the pending window's text already returned
        # False until some text is final: until then the window is the text's true start, decoded without anchor,
        # so the decoder's leading-space strip applies exactly as in a full decode.
        self._started = False
        if prompt_ids:
            self._start_after_prompt(prompt_ids)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often "", e.g. inside a multi-byte character)."""
        token_id = int(token_id)  # tensor and numpy scalars would miss the id sets below
        if token_id in self._skipped:
            return ""
        self._pending.append(token_id)
        if token_id in self._byte_ids:
            # A run of byte tokens decodes as a unit (one bad byte turns the whole run into U+FFFDs), so nothing
            # in it is final before it ends: wait without decoding, to keep long runs (CJK text in a small
            # vocabulary) linear instead of re-decoding the run at every byte.
            return ""
        text = self._window_text(self._pending)
        if self._is_final(self._pending, text):
            delta = text[self._emitted :]
            if text or self._started:  # an empty start (e.g. a lone "▁") must stay to be stripped in context
                self._commit()
            return delta
        stable = self._stable_length(self._pending, text)
        if stable <= self._emitted:
            return ""
        delta = text[self._emitted : stable]
        self._emitted = stable
        return delta

    def flush(self) -> str:
        """Return the text held back at the end of the stream (an unfinished character decodes to U+FFFD)."""
        text = self._window_text(self._pending)
        delta = text[self._emitted :]
        if text or self._started:
            self._commit()
        return delta

    def _commit(self) -> None:
        if not self._anchor:
            self._context = self._context + self._pending
            self._context_text = self._tok.decode(self._context, skip_special_tokens=self._skip)
        self._pending = []
        self._emitted = 0
        self._started = True

    # ---- windows -------------------------------------------------------------------------------------------

    def _window_text(self, window: list[int]) -> str:
        """Text of `window` as it reads after the final text: decoded behind the anchor, which is then cut off."""
        if not self._started:
            return self._tok.decode(window, skip_special_tokens=self._skip)
        text = self._tok.decode(self._context + window, skip_special_tokens=self._skip)
        assert text.startswith(self._context_text), (self._context, window, text)
        return text[len(self._context_text) :]

    def _is_final(self, window: list[int], text: str) -> bool:
        return not text.endswith(_REPLACEMENT) and window[-1] not in self._byte_ids

    def _stable_length(self, window: list[int], text: str) -> int:
        """How much of a non-final window's text no later token can change."""
        if window[-1] in self._byte_ids:
            # A byte-fallback run decodes as a unit: all of it waits, the text before it is final.
            start = len(window)
            while start and window[start - 1] in self._byte_ids:
                start -= 1
            return len(self._window_text(window[:start])) if start else 0
        # Byte-level text: only the trailing unfinished character (U+FFFD) can still change.
        return len(text.rstrip(_REPLACEMENT))

    def _start_after_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Start the window at the last prompt token after which the text is final (a clean cut), so the
        decoder sees enough context; the prompt's own text counts as already emitted."""
        prompt = [int(i) for i in prompt_ids if int(i) not in self._skipped]
        if not prompt:
            return
        # Without a clean cut among the last tokens (garbage ids), start at the lookback limit: best effort.
        cut = max(0, len(prompt) - _PROMPT_LOOKBACK)
        for end in range(len(prompt), cut, -1):
            last = prompt[end - 1]
            alone = self._tok.decode([last], skip_special_tokens=self._skip)
            if alone and not alone.endswith(_REPLACEMENT) and last not in self._byte_ids:
                cut = end
                break
        self._pending = prompt[cut:]
        self._started = cut > 0
        if self._started and not self._anchor:
            self._context = prompt[:cut]
            self._context_text = self._tok.decode(self._context, skip_special_tokens=self._skip)
        if self._pending:
            # The prompt's text was shown whole, unless it ends in an unfinished character: that one is re-emitted
            # complete. (A byte-fallback run that reads fine now but turns invalid later cannot be taken back.)
            text = self._window_text(self._pending)
            finished = not text.endswith(_REPLACEMENT)
            self._emitted = len(text) if finished else self._stable_length(self._pending, text)


def detokenize_stream(
    tokenizer: Tokenizer, ids: Iterable[int], skip_special_tokens: bool = True
) -> Iterator[str]:
    """Yield the non-empty text deltas of `ids`, then what `flush` returns."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    for token_id in ids:
        if delta := detok.push(token_id):
            yield delta
    if tail := detok.flush():
        yield tail


def _find_anchor(tokenizer: Tokenizer, byte_ids: frozenset[int]) -> list[int]:
    """One ordinary token whose text is whole characters with no leading space: [] when none is found."""
    added = set(tokenizer.backend.get_added_tokens_decoder())

    def usable(i: int | None) -> bool:
        if i is None or i in added or i in byte_ids:
            return False
        text = tokenizer.decode([i], skip_special_tokens=False)
        return (
            bool(text)
            and not text[0].isspace()
            and _REPLACEMENT not in text
            and tokenizer.decode([i, i], skip_special_tokens=False) == text * 2
        )

    for candidate in _ANCHOR_CANDIDATES:
        if usable(i := tokenizer.token_to_id(candidate)):
            return [i]
    for i in range(min(tokenizer.vocab_size, 5000)):
        if usable(i):
            return [i]
    return []
