"""OpenAI response bodies: choices, logprobs in the completions and chat layouts, usage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.sequence import TokenEvent, TopLogprobs


MIN_LOGPROB = -9999.0  # JSON has no -inf: a token masked out (processed log-probs) reports this, as vLLM does


def _finite(lp: float | None) -> float | None:
    return None if lp is None else max(lp, MIN_LOGPROB)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


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

    def add(self, event: TokenEvent) -> None:
        self.text += event.text
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs
        self.top_logprobs += event.top_logprobs
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
        self.num_prompt_tokens = event.num_prompt_tokens


class LogprobFormatter:
    """Token strings for logprobs: the vocabulary piece of each id (exact, one per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def piece(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        return piece if piece is not None else f"token_id:{token_id}"

    def completion(
        self, ids: list[int], logprobs: list[float | None], tops: list[TopLogprobs | None], offset: int
    ) -> dict[str, Any]:
        """The legacy completions layout: parallel lists, top alternatives as {token: logprob}."""
        tokens = [self.piece(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp) for lp in logprobs],
            "top_logprobs": [None if top is None else {self.piece(i): _finite(lp) for i, lp in top} for top in tops],
            "text_offset": offsets,
        }

    def chat(self, ids: list[int], logprobs: list[float], tops: list[TopLogprobs]) -> dict[str, Any]:
        content = []
        for token_id, lp, top in zip(ids, logprobs, tops):
            piece = self.piece(token_id)
            content.append({
                "token": piece,
                "logprob": _finite(lp),
                "bytes": list(piece.encode("utf-8")),
                "top_logprobs": [
                    {"token": self.piece(i), "logprob": _finite(v), "bytes": list(self.piece(i).encode("utf-8"))} for i, v in top
                ],
            })
        return {"content": content}


def echo_logprobs(prompt_ids: list[int], prompt_logprobs: list | None) -> tuple[list[float | None], list[TopLogprobs | None]]:
    """Prompt logprobs (first token: None) as the two parallel lists the completions layout wants."""
    values: list[float | None] = []
    tops: list[TopLogprobs | None] = []
    for i in range(len(prompt_ids)):
        entry = prompt_logprobs[i] if prompt_logprobs and i < len(prompt_logprobs) else None
        values.append(None if entry is None else entry[0])
        tops.append(None if entry is None else entry[1])
    return values, tops
